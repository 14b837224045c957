"""The side by side that holds still (issue 36): Triton, meshserve through the gateway and the ONNX
service direct, started ONCE, then per cell (model × protocol × concurrency) the three measured one
after the other, repeated ``--repeats`` times, so that each gateway run has a Triton run and a
direct run beside it in time.

    python -m load.bench --side-by-side [RESULTS_DIR] [--repeats 3] [--models add_sub,mlp]
        [--modes grpc,http,http-json] [--concurrency 1,8,32] [--interval 2000] [--triton auto|off]
        [--raw-ort mlp@32] [--raw-ort-runs 1000]
    (smoke: --models add_sub --modes grpc --concurrency 8 --repeats 1 --interval 1000 --triton off)

Each run is one perf_analyzer measurement through ../shared/bench/drive.py (the team's harness: same
stabilisation, same statistics-extension deltas for rows per execution). Around it this module
reads /proc for the CPU of every server process (gateway with its workers, service, Triton with its
Python-backend stubs) and divides it by the requests the server counted in the same run: CPU per
request, per process, for every repeat. The report (``RESULTS_DIR/side_by_side.md``, printed) gives
per cell the median and min–max over the repeats of gw/Triton and gw/direct (each ratio from runs
of the same repeat), the p99s, and marks a cell whose gw/Triton spread crosses 1.0 ("±": not
evidence either way). Every run's record is in ``RESULTS_DIR/runs.jsonl``.

CPU per served row against raw onnxruntime (``--raw-ort mlp@32``, the issue's "within 1.5×"): right
after each gateway and direct run of such a cell, the same ONNX file runs in a separate process
(``--raw-ort-serve``, started once, pinned as the service is) with onnxruntime alone: the session
options the service builds from the same config.pbtxt (services/onnx/runtime.py:session_options),
the perf_analyzer sample tiled to the run's mean rows per execution (floor and ceil mixed to that
mean), ``--raw-ort-runs`` runs; its process CPU time (every thread) per row is the reference. The
ratio is (gateway + service CPU per row) / raw, and service / raw for the direct run.

Topology: the same two processes `meshserve up` starts (an ONNX service, a gateway with
``--upstream`` to its gRPC port and ``--federate-metrics``), started here one by one so the service
also opens an HTTP port (the direct HTTP cells) and each process's PID is known.

Without Triton (no tritonserver in ``--triton-venv``, or ``--triton off``) the Triton columns are
dashes and the rest runs; without perf_analyzer it stops with the reason.

``--native``: meshserve's processes (service and gateway) run the mypyc build of the hot path
(docs/perf/native.md): the build of these sources is made first if the cache lacks it
(``python -m meshserve.native build``), the processes start with ``MESHSERVE_NATIVE=1``, and each
process's log must say "running compiled", else the run stops with the log's line. Without it
they run pure Python (``MESHSERVE_NATIVE`` removed from their environment). The mode is in the
report's knobs line, meta.json and every meshserve record of runs.jsonl (``native``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load.bench import procs
from tests.support.net import free_port as free_port  # (client_cost uses sbs.free_port)

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(os.environ.get("BENCH_DIR", ROOT.parent / "shared" / "bench"))
LABELS = ("triton", "gateway", "direct")
HZ = os.sysconf("SC_CLK_TCK")
Key = tuple[str, str, int]


def env_list(name: str, default: str) -> str:
    return os.environ.get(name, default).replace(" ", ",")


# --- /proc ---------------------------------------------------------------------------------------

def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(kids.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid``'s tree (live processes)."""
    total = 0.0
    for p in tree(pid):
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / HZ
        except (OSError, IndexError, ValueError):
            pass
    return total


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """User + system CPU seconds of one thread ``tid`` of ``pid`` (0.0 when it is gone)."""
    try:
        f = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / HZ
    except (OSError, IndexError, ValueError):
        return 0.0


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid``'s tree onto ``cpus`` (threads started later inherit it)."""
    for p in tree(pid):
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:
                pass


def parse_pin(text: str) -> dict[str, set[int]]:
    """``gateway=0,service=1,client=0-1`` -> {name: cpus}; names: gateway, service, triton, client."""
    out: dict[str, set[int]] = {}
    for part in filter(None, text.replace(" ", ",").split(",")):
        name, _, cpus = part.partition("=")
        if name not in ("gateway", "service", "triton", "client") or not cpus:
            raise argparse.ArgumentTypeError(f"--pin: {part!r} is not NAME=CPUS (gateway, service, triton, client)")
        lo, _, hi = cpus.partition("-")
        out[name] = set(range(int(lo), int(hi or lo) + 1))
    return out


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# --- processes -----------------------------------------------------------------------------------

@dataclass
class Server:
    label: str
    proc: subprocess.Popen[bytes]
    http: str
    grpc: str
    log: Path

    def stop(self) -> None:
        """Stopped with everything it started (a gateway's workers: ``procs.stop_process``)."""
        if isinstance(self.proc, _Adopted):
            self.proc.stop()
        else:
            procs.stop_process(self.proc, timeout=30)


def wait_ready(server: Server, timeout: float) -> None:
    try:
        procs.wait_ready(server.http, timeout, server.proc)
    except RuntimeError as exc:
        raise SystemExit(f"{server.label}: {exc}; see {server.log}") from None


NATIVE_ENV = "MESHSERVE_NATIVE"  # (meshserve/native.py:ENV)
COMPILED_LINE = "meshserve native: running compiled"  # what a process with the build loaded prints


def meshserve_env(key: Path, native: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a meshserve process of the bench: the shared hop key, this tree first on
    the path, and MESHSERVE_NATIVE=1 with ``native`` (the build of these sources, made by
    ``prepare_native``), else without MESHSERVE_NATIVE at all (pure Python, whatever the caller's
    environment says)."""
    base = dict(os.environ if base is None else base)
    env = {"MESHSERVE_HOP_KEY_FILE": str(key), **base,
           "PYTHONPATH": f"{ROOT}{os.pathsep}{base.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    env.pop(NATIVE_ENV, None)
    if native:
        env[NATIVE_ENV] = "1"
    return env


def prepare_native() -> str:
    """Build the mypyc cache of these sources when it lacks it; the build's key. Stops the bench
    with the reason when it cannot be made."""
    from meshserve import native

    try:
        where = native.build(ROOT)
    except (RuntimeError, OSError) as exc:
        raise SystemExit(f"--native: the build could not be made: {exc}") from None
    print(f"native build: {where}", flush=True)
    return where.name


def native_line(log: Path) -> str:
    """The "meshserve native: ..." line a process printed at start (empty when none)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return next((ln.strip() for ln in text.splitlines() if ln.startswith("meshserve native:")), "")


def check_native(server: Server) -> None:
    """With --native: the process must run the build (its log says so), else the bench stops."""
    line = native_line(server.log)
    if not line.startswith(COMPILED_LINE):
        raise SystemExit(f"--native: {server.label} does not run the build: {line or 'no meshserve native line'}; "
                         f"see {server.log}")


def start_meshserve(label: str, argv: list[str], http: int, grpc: int, res: Path, native: bool = False) -> Server:
    log = res / f"{label}.log"
    key = res / "hop.key"  # the gateway and the service share a hop key, as under `meshserve up`: without
    if not key.exists():  # one the service believes none of the hop's extras (docs/security.md, "The authenticated hop")
        from meshserve.cli import write_hop_key

        write_hop_key(key)
    proc = procs.spawn([sys.executable, "-m", "meshserve", *argv], cwd=ROOT, env=meshserve_env(key, native),
                       stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return Server(label, proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", log)


def triton_binary(venv: Path) -> Path | None:
    for sp in sorted(venv.glob("lib/python3*/site-packages")):
        ts = sp / "pytriton" / "tritonserver" / "bin" / "tritonserver"
        if ts.exists():
            return ts
    return None


def start_triton(venv: Path, models: Path, res: Path) -> Server:
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = res / "triton.log"
    env = {**os.environ, "TRITON_VENV": str(venv), "TRITON_HTTP": str(http), "TRITON_GRPC": str(grpc),
           "TRITON_METRICS": str(metrics), "TRITON_WORK": str(res / "triton-work")}
    out = subprocess.run(["bash", str(BENCH / "start_triton.sh"), str(models / "triton_repo"), str(log)],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    pid = int(out[-1])
    # start_triton.sh backgrounds the binary: adopt it as a Popen-like handle
    return Server("triton", _Adopted(pid), f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", log)  # type: ignore[arg-type]


class _Adopted:
    """A process this module did not fork (tritonserver, started by start_triton.sh): poll/stop by PID."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "Z"
        if state == "Z":
            self.returncode = -1
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 15)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.2)
        return self.returncode or 0

    def stop(self) -> None:
        self.terminate()
        try:
            self.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()


def pa_venv() -> Path | None:
    """The virtual environment that holds perf_analyzer (../shared/bench's or ../shared/tools'), if any."""
    for venv in (Path(os.environ.get("PA_VENV", "/tmp/bench-venvs/pa")),
                 Path(os.environ.get("MESHSERVE_TOOLS", Path.home() / ".cache/meshserve-tools")) / "perf-analyzer"):
        if (venv / "bin" / "perf_analyzer").exists():
            return venv
    return None


def perf_analyzer() -> tuple[str, dict[str, str]]:
    """The perf_analyzer binary and the environment it needs (libcudart on the library path);
    ../shared/tools/perf_analyzer installs it on first use."""
    venv = pa_venv()
    tool = ROOT.parent / "shared" / "tools" / "perf_analyzer"
    if venv is None and tool.exists():
        subprocess.run(["bash", str(tool), "--help"], capture_output=True, timeout=600)
        venv = pa_venv()
    if venv is None:
        raise SystemExit("perf_analyzer not found: see ../shared/bench/README.md (PA_VENV) or ../shared/tools/perf_analyzer")
    lib = subprocess.run([str(venv / "bin" / "python"), "-c", "import nvidia.cuda_runtime as m, os; "
                          "print(os.path.join(list(m.__path__)[0], 'lib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    ld = os.environ.get("LD_LIBRARY_PATH")
    return str(venv / "bin" / "perf_analyzer"), {"LD_LIBRARY_PATH": lib + (f":{ld}" if ld else "")}


# --- raw onnxruntime: the CPU per row of the graph alone -----------------------------------------

def raw_ort_session(repo: Path, model: str) -> Any:
    """``model``'s newest version in ``repo`` as the ONNX service loads it: the same file, the session
    options the service builds from the same config.pbtxt, the CPU provider."""
    import onnxruntime as ort
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc
    from services.onnx.runtime import session_options

    config = text_format.Parse((repo / model / "config.pbtxt").read_text(), mc.ModelConfig())
    version = max((d for d in (repo / model).iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    return ort.InferenceSession(str(version / (config.default_model_filename or "model.onnx")),
                                session_options(config), providers=["CPUExecutionProvider"])


def raw_ort_cpu_per_row(session: Any, sample: dict[str, list[float]], batch: float, runs: int) -> dict[str, Any]:
    """``runs`` runs of ``session`` at a mean of ``batch`` rows (floor and ceil mixed), each row
    ``sample``; this process's CPU time (all threads: onnxruntime's pool too) per row."""
    import numpy as np

    lo = max(1, math.floor(batch))
    n_hi = round(runs * (batch - lo)) if batch > lo else 0
    feeds = {}
    for b in {lo, lo + 1}:
        feeds[b] = {i.name: np.tile(np.asarray(sample[i.name], dtype=np.float32), (b, 1))
                    for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    for _ in range(5):  # (the first runs allocate the arena)
        session.run(names, feeds[lo])
    plan = [lo + 1] * n_hi + [lo] * (runs - n_hi)
    c0, t0 = time.process_time(), time.perf_counter()
    for b in plan:
        session.run(names, feeds[b])
    cpu, wall, rows = time.process_time() - c0, time.perf_counter() - t0, sum(plan)
    return {"batch": round(rows / runs, 2), "runs": runs, "rows": rows,
            "cpu_us_per_row": round(1e6 * cpu / rows, 2), "wall_us_per_row": round(1e6 * wall / rows, 2)}


def raw_ort_serve(repo: Path, data: Path) -> int:
    """``--raw-ort-serve REPO PERF_DATA``: one JSON request a line on stdin ({"model", "batch",
    "runs"}), one JSON answer a line on stdout; sessions are kept, so only the runs are measured."""
    sessions: dict[str, Any] = {}
    for line in sys.stdin:
        ask = json.loads(line)
        model = ask["model"]
        if model not in sessions:
            sessions[model] = raw_ort_session(repo, model)
        sample = json.loads((data / f"{model}.json").read_text())["data"][0]
        print(json.dumps(raw_ort_cpu_per_row(sessions[model], sample, float(ask["batch"]), int(ask["runs"]))),
              flush=True)
    return 0


class RawOrt:
    """The ``--raw-ort-serve`` child, started on first use (pinned to ``cpus`` when given)."""

    def __init__(self, repo: Path, data: Path, cpus: set[int] | None):
        self.repo, self.data, self.cpus = repo, data, cpus
        self.proc: subprocess.Popen[str] | None = None

    def measure(self, model: str, batch: float, runs: int) -> dict[str, Any]:
        if self.proc is None:
            cpus = self.cpus
            self.proc = procs.spawn(
                [sys.executable, "-m", "load.bench.sbs", "--raw-ort-serve", str(self.repo), str(self.data)],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"model": model, "batch": batch, "runs": runs}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"raw onnxruntime process ended (rc {self.proc.wait()})")
        return dict(json.loads(line))

    def stop(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # (its end: it exits at EOF)
            procs.stop_process(self.proc, timeout=30)


def parse_raw_cells(text: str) -> set[tuple[str, int]]:
    """``mlp@32,add_sub@8`` -> {(model, concurrency)}; empty: none."""
    out = set()
    for part in filter(None, text.replace(" ", ",").split(",")):
        model, _, c = part.partition("@")
        if not model or not c.isdigit():
            raise argparse.ArgumentTypeError(f"--raw-ort: {part!r} is not MODEL@CONCURRENCY")
        out.add((model, int(c)))
    return out


# --- one run -------------------------------------------------------------------------------------

@dataclass
class Bench:
    args: argparse.Namespace
    res: Path
    pa: str
    pa_env: dict[str, str]
    servers: dict[str, Server] = field(default_factory=dict)
    procs: dict[str, dict[str, int]] = field(default_factory=dict)  # label -> process name -> pid
    raw: RawOrt | None = None
    native: str = "pure"  # meshserve's mode: "pure", or "compiled <build key>" (--native)

    def run(self, label: str, rep: int, key: Key, into: str = "runs.jsonl", interval: int = 0) -> dict[str, Any]:
        model, mode, c = key
        s = self.servers[label]
        tmp = self.res / "drive" / f"{label}-{model}-{mode}-c{c}-r{rep}.jsonl"
        tmp.parent.mkdir(exist_ok=True)
        cpu0 = {name: cpu_seconds(pid) for name, pid in self.procs[label].items()}
        svc = self.procs[label].get("service")
        loop0 = thread_cpu_seconds(svc, svc) if svc else 0.0  # the service's event loop (its main thread)
        t0 = time.monotonic()
        cmd = [sys.executable, str(BENCH / "drive.py"), "--http", s.http, "--grpc", s.grpc, "--model", model,
               "--label", f"{label}-r{rep}", "--modes", mode, "--concurrency", str(c), "--interval", str(interval or self.args.interval),
               *(["--max-trials", "4", "--stability", "999"] if interval else ["--max-trials", str(self.args.max_trials),
                                                                        "--stability", str(self.args.stability)]),
               "--stats", "triton",
               "--server-pid", str(s.proc.pid), "--quiet-wait", str(self.args.quiet_wait), "--pa", self.pa,
               "--timeout", str(int(self.args.timeout)), "--out", str(tmp), "--logdir", str(self.res / "pa-logs"),
               "--input-data", str(self.args.models_dir / "perf_data" / f"{model}.json")]
        client = self.args.pin.get("client")
        try:  # (drive.py stops a perf_analyzer run after --timeout, and may run it twice)
            run = subprocess.run(cmd, env={**os.environ, **self.pa_env}, capture_output=True, text=True,
                                 timeout=2 * self.args.timeout + 60,
                                 preexec_fn=None if client is None else lambda: os.sched_setaffinity(0, client))
            said = run.stdout + run.stderr
        except subprocess.TimeoutExpired:
            said = "drive.py did not end"
        wall = time.monotonic() - t0
        cpu1 = {name: cpu_seconds(pid) for name, pid in self.procs[label].items()}
        loop1 = thread_cpu_seconds(svc, svc) if svc else 0.0
        lines = [json.loads(x) for x in tmp.read_text().splitlines() if x.strip()] if tmp.exists() else []
        rec: dict[str, Any] = lines[-1] if lines else {"ok": False, "error": said[-600:]}
        rec.update(label=label, model=model, mode=mode, concurrency=c, repeat=rep,
                   load_avg=load_average(), drive_wall_s=round(wall, 1))
        if label != "triton":
            rec["native"] = self.native
        served = rec.get("server_inferences") or 0
        rec["cpu_s"] = {n: round(cpu1[n] - cpu0[n], 3) for n in cpu0}
        if rec.get("wall_s") and rec.get("cpu_busy_cores") is not None:
            # drive.py counts only --server-pid's tree as the server: through the gateway the service
            # is a sibling, so the rest of the machine is the busy cores less every server process here
            ours = sum(rec["cpu_s"].values()) / wall
            rec["cpu_foreign_cores"] = round(max(0.0, rec["cpu_busy_cores"] - ours - rec.get("cpu_pa_cores", 0)), 2)
        if served:
            rec["cpu_us_per_req"] = {n: round(1e6 * (cpu1[n] - cpu0[n]) / served, 1) for n in cpu0}
            if rec.get("cpu_pa_cores") is not None and rec.get("wall_s"):  # perf_analyzer's, over its own run
                rec["cpu_us_per_req"]["client"] = round(1e6 * rec["cpu_pa_cores"] * rec["wall_s"] / served, 1)
        if svc and served:
            # the service's CPU per row split: its event loop, and every other thread (the instance's
            # worker, which calls Session.run, with onnxruntime's intra-op pool): onnxruntime at work
            # in the same seconds as the rest, beside the raw reference run a moment later
            loop = 1e6 * (loop1 - loop0) / served
            rec["service_threads_us_per_row"] = {"event loop": round(loop, 1),
                                                 "other": round(rec["cpu_us_per_req"]["service"] - loop, 1)}
        if (self.raw is not None and into == "runs.jsonl" and label != "triton" and (model, c) in self.args.raw_ort
                and rec.get("ok") and rec.get("avg_batch") and rec.get("cpu_us_per_req")):
            # the graph alone at this run's rows per execution, right after it (the same machine state)
            rec["raw_ort"] = raw = self.raw.measure(model, float(rec["avg_batch"]), self.args.raw_ort_runs)
            ours = sum(v for n, v in rec["cpu_us_per_req"].items() if n != "client")
            rec["cpu_per_row_vs_raw"] = round(ours / raw["cpu_us_per_row"], 3)
            other = (rec.get("service_threads_us_per_row") or {}).get("other")
            if other and other > 0:
                rec["cpu_per_row_vs_inproc"] = round(ours / other, 3)
        with (self.res / into).open("a") as f:
            f.write(json.dumps(rec) + "\n")
        tmp.unlink(missing_ok=True)
        return rec


def say(rec: dict[str, Any]) -> None:
    tag = f"r{rec['repeat']} {rec['label']:8} {rec['model']} {rec['mode']} c{rec['concurrency']}"
    if not rec.get("ok"):
        print(f"  {tag}: FAILED {rec.get('error', '')[:300]}", flush=True)
        return
    per = " ".join(f"{n}={v:.0f}" for n, v in (rec.get("cpu_us_per_req") or {}).items())
    print(f"  {tag}: {rec['infer_per_s']:.0f}/s p99 {rec['p99_us'] / 1e3:.2f} ms rows/exec {rec.get('avg_batch')} "
          f"cpu µs/req {per} foreign {rec.get('cpu_foreign_cores')} load {rec['load_avg']}", flush=True)
    if rec.get("raw_ort"):
        raw = rec["raw_ort"]
        print(f"  {tag}: raw onnxruntime at {raw['batch']} rows/exec {raw['cpu_us_per_row']:.1f} CPU µs/row; "
              f"server / raw {rec['cpu_per_row_vs_raw']:.2f}; service threads µs/row "
              f"{rec.get('service_threads_us_per_row')}, server / in-process {rec.get('cpu_per_row_vs_inproc')}",
              flush=True)


# --- report --------------------------------------------------------------------------------------

def spread(vals: list[float]) -> tuple[float, float, float]:
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, math.nan
    return statistics.median(vals), min(vals), max(vals)


def _f(v: float, fmt: str) -> str:
    return "–" if math.isnan(v) else format(v, fmt)


def _ratio_cell(vals: list[float]) -> str:
    med, lo, hi = spread(vals)
    if math.isnan(med):
        return "–"
    mark = " ±" if lo < 1.0 <= hi else ""
    return f"{med:.2f} ({lo:.2f}–{hi:.2f}){mark}"


def report(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    by: dict[tuple[Key, str, int], dict[str, Any]] = {}
    keys: list[Key] = []
    for r in records:
        k = (r["model"], r["mode"], int(r["concurrency"]))
        if k not in keys:
            keys.append(k)
        if r.get("ok"):
            by[(k, r["label"], int(r["repeat"]))] = r
    reps = sorted({int(r["repeat"]) for r in records})

    def val(k: Key, label: str, rep: int, name: str) -> float:
        r = by.get((k, label, rep))
        v = None if r is None else r.get(name)
        return float(v) if v is not None else math.nan

    def cpu(k: Key, label: str, rep: int, proc: str) -> float:
        r = by.get((k, label, rep))
        v = None if r is None else (r.get("cpu_us_per_req") or {}).get(proc)
        return float(v) if v is not None else math.nan

    out = [f"# Side by side, alternating ({meta['when']})", "",
           f"command: `{meta['command']}`  ", f"commit: {meta['commit']}  ",
           f"knobs: repeats {meta['repeats']}, window {meta['interval']} ms, ORT threads {meta['ort_threads']}, "
           f"gateway workers {meta['gateway_workers']}, CPU placement {meta.get('pin', 'none')}, "
           f"Triton: {meta['triton']}, raw onnxruntime cells {meta.get('raw_ort', '–')} "
           f"({meta.get('raw_ort_runs', '–')} runs each), meshserve {meta.get('native', 'pure')}  ",
           f"load average at start {meta['load_start']}, at end {meta.get('load_end', '–')}; "
           f"wall {meta.get('wall_min', '–')} min", "",
           "Per cell: median (min–max) over the repeats; each ratio from the runs of one repeat (Triton, "
           "gateway, direct back to back). ± = the gw/Triton spread crosses 1.0 (no verdict). Throughput "
           "infer/s; p99 ms; CPU µs per request from /proc over each run divided by the requests the "
           "server counted (gw = gateway process(es), svc = ONNX service, T = Triton with its stubs). "
           "gw/direct by CPU: (service + perf_analyzer CPU per request, direct) / (gateway + service + "
           "perf_analyzer, through the gateway): the ratio if the shared cores were the only bound.", "",
           "| model | proto | c | Triton /s | gw /s | direct /s | gw/Triton | gw/direct | p99 T / gw / d | "
           "rows/exec T / gw / d | CPU µs/req gw+svc / T | svc direct | gw/direct by CPU | foreign cores |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ahead = crossing = total = 0
    for k in keys:
        tput = {lab: [val(k, lab, r, "infer_per_s") for r in reps] for lab in LABELS}
        gt = [g / t for g, t in zip(tput["gateway"], tput["triton"], strict=True)]
        gd = [g / d for g, d in zip(tput["gateway"], tput["direct"], strict=True)]
        med = {lab: spread(v)[0] for lab, v in tput.items()}
        p99 = {lab: spread([val(k, lab, r, "p99_us") / 1e3 for r in reps])[0] for lab in LABELS}
        rows = {lab: spread([val(k, lab, r, "avg_batch") for r in reps])[0] for lab in LABELS}
        hop = spread([cpu(k, "gateway", r, "gateway") + cpu(k, "gateway", r, "service") for r in reps])[0]
        gw_only = spread([cpu(k, "gateway", r, "gateway") for r in reps])[0]
        tri = spread([cpu(k, "triton", r, "triton") for r in reps])[0]
        svc_d = spread([cpu(k, "direct", r, "service") for r in reps])[0]
        foreign = spread([val(k, lab, r, "cpu_foreign_cores") for lab in LABELS for r in reps])[0]
        # what gw/direct would be if the cores were the only bound: the CPU per request of the
        # direct path (service + perf_analyzer) over the gateway path's (gateway + service + perf_analyzer)
        by_cpu = spread([(cpu(k, "direct", r, "service") + cpu(k, "direct", r, "client"))
                         / (cpu(k, "gateway", r, "gateway") + cpu(k, "gateway", r, "service")
                            + cpu(k, "gateway", r, "client")) for r in reps])[0]
        g = spread(gt)
        if not math.isnan(g[0]):
            total += 1
            ahead += g[1] >= 1.0
            crossing += g[1] < 1.0 <= g[2]
        out.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {_f(med['triton'], '.0f')} | {_f(med['gateway'], '.0f')} | "
            f"{_f(med['direct'], '.0f')} | {_ratio_cell(gt)} | {_ratio_cell(gd)} | "
            f"{' / '.join(_f(p99[lab], '.1f') for lab in LABELS)} | {' / '.join(_f(rows[lab], '.1f') for lab in LABELS)} | "
            f"{_f(hop, '.0f')} (gw {_f(gw_only, '.0f')}) / {_f(tri, '.0f')} | {_f(svc_d, '.0f')} | {_f(by_cpu, '.2f')} | {_f(foreign, '.2f')} |")
    out += ["", f"cells with Triton: {total}; gw/Triton min ≥ 1.0 in {ahead}; spread crosses 1.0 in {crossing}", ""]
    more = sorted({r["label"] for r in records} - set(LABELS))
    if more:  # other gateway worker counts against the first gateway, per repeat
        out += ["| model | proto | c | " + " | ".join(f"{m} /s | {m}/gateway | rows/exec" for m in more) + " |",
                "|---|---|---|" + "---|---|---|" * len(more)]
        for k in keys:
            cols = []
            for m in more:
                tm = [val(k, m, r, "infer_per_s") for r in reps]
                gm = [val(k, "gateway", r, "infer_per_s") for r in reps]
                cols += [_f(spread(tm)[0], ".0f"), _ratio_cell([a / b for a, b in zip(tm, gm, strict=True)]),
                         _f(spread([val(k, m, r, "avg_batch") for r in reps])[0], ".1f")]
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(cols) + " |")
        out.append("")
    out += raw_table(records, keys, reps)
    out += drift(records, keys, reps)
    out += ["## Every repeat", "",
            "| model | proto | c | rep | label | infer/s | p99 ms | rows/exec | CPU µs/req per process | foreign | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        per = ", ".join(f"{n} {v:.0f}" for n, v in (r.get("cpu_us_per_req") or {}).items())
        ok = r.get("ok")
        out.append(f"| {r['model']} | {r['mode']} | {r['concurrency']} | {r['repeat']} | {r['label']} | "
                   f"{r['infer_per_s']:.0f} | {r['p99_us'] / 1e3:.2f} | {r.get('avg_batch')} | {per} | "
                   f"{r.get('cpu_foreign_cores')} | {r.get('load_avg')} |" if ok else
                   f"| {r['model']} | {r['mode']} | {r['concurrency']} | {r['repeat']} | {r['label']} | "
                   f"FAILED | | | | | {r.get('load_avg')} |")
    return "\n".join(out) + "\n"


def raw_table(records: list[dict[str, Any]], keys: list[Key], reps: list[int]) -> list[str]:
    """The cells measured against raw onnxruntime (``--raw-ort``): server CPU per served row over the
    graph's alone at the same rows per execution, median (min–max) over the repeats."""
    by = {((r["model"], r["mode"], int(r["concurrency"])), r["label"], int(r["repeat"])): r
          for r in records if r.get("ok") and r.get("raw_ort")}
    if not by:
        return []

    def col(k: Key, label: str, get: Any) -> list[float]:
        return [float(get(by[(k, label, r)])) for r in reps if (k, label, r) in by]

    def other(r: dict[str, Any]) -> float:
        return float((r.get("service_threads_us_per_row") or {}).get("other", math.nan))

    def med(vals: list[float], fmt: str) -> str:
        m, lo, hi = spread(vals)
        return "–" if math.isnan(m) else f"{m:{fmt}} ({lo:{fmt}}–{hi:{fmt}})"

    out = ["## CPU per served row against raw onnxruntime", "",
           "Right after each gateway and direct run: the same graph in its own process with onnxruntime "
           "alone (the service's session options, the same input row), at that run's mean rows per execution; "
           "process CPU time per row. gw path = (gateway + service) / raw; direct = service / raw. "
           "Median (min–max) over the repeats; goal (issue 36) gw path ≤ 1.5. In-process: the service's "
           "threads other than its event loop (the worker that calls Session.run, onnxruntime's pool) in "
           "the same run, for a reference taken in the same seconds (it includes the worker's own Python: "
           "a ratio to it is a lower bound).", "",
           "| model | proto | c | rows/exec gw / d | raw µs/row | gw+svc µs/row | gw path / raw | "
           "svc direct µs/row | direct / raw | svc non-loop threads µs/row gw / d | gw path / in-process |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        if not any((k, lab, r) in by for lab in ("gateway", "direct") for r in reps):
            continue
        srv = col(k, "gateway", lambda r: sum(v for n, v in r["cpu_us_per_req"].items() if n != "client"))
        out.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {_f(spread(col(k, 'gateway', lambda r: r['avg_batch']))[0], '.1f')} / "
            f"{_f(spread(col(k, 'direct', lambda r: r['avg_batch']))[0], '.1f')} | "
            f"{med(col(k, 'gateway', lambda r: r['raw_ort']['cpu_us_per_row']), '.0f')} | {med(srv, '.0f')} | "
            f"{med(col(k, 'gateway', lambda r: r['cpu_per_row_vs_raw']), '.2f')} | "
            f"{med(col(k, 'direct', lambda r: r['cpu_us_per_req']['service']), '.0f')} | "
            f"{med(col(k, 'direct', lambda r: r['cpu_per_row_vs_raw']), '.2f')} | "
            f"{_f(spread(col(k, 'gateway', other))[0], '.0f')} / {_f(spread(col(k, 'direct', other))[0], '.0f')} | "
            f"{med(col(k, 'gateway', lambda r: r.get('cpu_per_row_vs_inproc', math.nan)), '.2f')} |")
    return out + [""]


def drift(records: list[dict[str, Any]], keys: list[Key], reps: list[int]) -> list[str]:
    """Which server moved between repeats: per server, over the cells, the median and the largest
    relative spread ((max - min) / median) of its throughput, rows per execution and CPU per
    request of each of its processes."""
    if len(reps) < 2:
        return []
    runs: dict[tuple[Key, str], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("ok"):
            runs.setdefault(((r["model"], r["mode"], int(r["concurrency"])), r["label"]), []).append(r)

    def rel(vals: list[float]) -> float:
        vals = [v for v in vals if not math.isnan(v)]
        return (max(vals) - min(vals)) / statistics.median(vals) if len(vals) > 1 and statistics.median(vals) else math.nan

    def num(r: dict[str, Any], *path: str) -> float:
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        return float(v) if v is not None else math.nan

    out = ["## Drift: which server moved between repeats", "",
           "Relative spread (max − min) / median over the repeats of one cell; median and largest over the cells.", "",
           "| server | throughput | rows/exec | CPU µs/req per process |", "|---|---|---|---|"]
    for label in sorted({lab for _, lab in runs}, key=lambda x: (x not in LABELS, LABELS.index(x) if x in LABELS else 0, x)):
        cells = [runs[(k, label)] for k in keys if (k, label) in runs]
        procs = sorted({n for rs in cells for r in rs for n in (r.get("cpu_us_per_req") or {})})

        def both(vals: list[float]) -> str:
            vals = [v for v in vals if not math.isnan(v)]
            return f"{statistics.median(vals):.0%} (max {max(vals):.0%})" if vals else "–"

        per = ", ".join(f"{n} {both([rel([num(r, 'cpu_us_per_req', n) for r in rs]) for rs in cells])}" for n in procs)
        out.append(f"| {label} | {both([rel([num(r, 'infer_per_s') for r in rs]) for rs in cells])} | "
                   f"{both([rel([num(r, 'avg_batch') for r in rs]) for rs in cells])} | {per} |")
    return out + [""]


def rewrite(res: Path) -> str:
    """The report of an earlier run again, from its runs.jsonl and meta.json (this module's report)."""
    records = [json.loads(x) for x in (res / "runs.jsonl").read_text().splitlines() if x.strip()]
    meta_path = res / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {
        "when": "?", "command": "?", "commit": "?", "repeats": "?", "interval": "?", "ort_threads": "?",
        "gateway_workers": "?", "triton": "?", "load_start": "?"}
    for r in records:  # (records written before perf_analyzer's CPU per request was kept)
        per, served = r.get("cpu_us_per_req"), r.get("server_inferences")
        if per is not None and "client" not in per and served and r.get("cpu_pa_cores") is not None and r.get("wall_s"):
            per["client"] = round(1e6 * r["cpu_pa_cores"] * r["wall_s"] / served, 1)
    return report(records, meta)


# --- main ----------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m load.bench --side-by-side", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path,
                    default=Path(f"/tmp/bench-results/side-by-side-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"))
    ap.add_argument("--models", default=env_list("BENCH_MODELS", "add_sub,mlp"))
    ap.add_argument("--modes", default=env_list("MODES", "grpc,http,http-json"))
    ap.add_argument("--concurrency", default=env_list("CONC", "1,8,32"))
    ap.add_argument("--repeats", type=int, default=int(os.environ.get("REPEATS", 3)))
    ap.add_argument("--interval", type=int, default=int(os.environ.get("INTERVAL", 2000)),
                    help="perf_analyzer window, ms (stabilised over 3 windows)")
    ap.add_argument("--max-trials", type=int, default=4,
                    help="perf_analyzer windows before a run without the stability criterion")
    ap.add_argument("--stability", type=int, default=30,
                    help="perf_analyzer's stability criterion, %% of the average latency (999: none, for a smoke run)")
    ap.add_argument("--warmup", type=int, default=int(os.environ.get("WARMUP", 1000)),
                    help="perf_analyzer window (ms) of the warm-up run per server, model and protocol; 0: none")
    ap.add_argument("--quiet-wait", type=float, default=float(os.environ.get("QUIET_WAIT", 0)),
                    help="drive.py: wait up to this many seconds for a quiet machine before each run")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per run")
    ap.add_argument("--triton", choices=("auto", "off"), default=os.environ.get("TRITON", "auto"))
    ap.add_argument("--triton-venv", type=Path, default=Path(os.environ.get("TRITON_VENV", "/tmp/bench-venvs/triton")))
    ap.add_argument("--models-dir", type=Path, default=None,
                    help="gen_models.py output (default: RESULTS_DIR/models, generated)")
    ap.add_argument("--gateway-workers", default=os.environ.get("GATEWAY_WORKERS", "1"),
                    help="the gateway's --workers; a comma list (1,2) starts one gateway per count in front of "
                         "the same service and alternates them too (gateway, gateway-w2)")
    ap.add_argument("--pin", type=parse_pin, default=parse_pin(os.environ.get("PIN", "")),
                    help="CPU placement, e.g. gateway=0,service=1,client=0-1 (triton too): every thread of that "
                         "process tree (client: perf_analyzer); default: the scheduler's")
    ap.add_argument("--ort-threads", default=os.environ.get("BENCH_ORT_THREADS", "2"))
    ap.add_argument("--native", action="store_true",
                    help="meshserve's processes run the mypyc build (made if missing; docs/perf/native.md); "
                         "default pure Python")
    ap.add_argument("--raw-ort", type=parse_raw_cells, default=parse_raw_cells(os.environ.get("RAW_ORT", "mlp@32")),
                    help="MODEL@C cells whose gateway and direct runs are each followed by the same graph run "
                         "with onnxruntime alone at the run's rows per execution (CPU per row against it); '' none")
    ap.add_argument("--raw-ort-runs", type=int, default=int(os.environ.get("RAW_ORT_RUNS", 1000)),
                    help="onnxruntime runs per raw measurement")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--report":  # python -m load.bench --side-by-side --report RESULTS_DIR
        print(rewrite(Path(argv[1])), end="")
        return 0
    if argv and argv[0] == "--raw-ort-serve":  # the raw onnxruntime child (RawOrt)
        return raw_ort_serve(Path(argv[1]), Path(argv[2]))
    args = parse(argv)
    procs.clean_exit()  # (SIGTERM, SIGHUP: the servers are stopped on the way out)
    res: Path = args.results.resolve()
    res.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    print(f"results -> {res}", flush=True)
    os.environ["BENCH_ORT_THREADS"] = args.ort_threads
    if args.models_dir is None:
        args.models_dir = res / "models"
        subprocess.run([sys.executable, str(BENCH / "gen_models.py"), str(args.models_dir)], check=True,
                       capture_output=True)
    pa, pa_env = perf_analyzer()
    keys = [(m, mode, int(c)) for m in args.models.split(",") for mode in args.modes.split(",")
            for c in args.concurrency.split(",")]
    triton_note = "off (--triton off)"
    bench = Bench(args, res, pa, pa_env)
    if args.native:
        bench.native = f"compiled {prepare_native()}"
    try:
        if args.triton == "auto":
            if triton_binary(args.triton_venv) is None:
                triton_note = f"unavailable (no tritonserver in {args.triton_venv}): Triton columns skipped"
            else:
                t = start_triton(args.triton_venv, args.models_dir, res)
                bench.servers["triton"] = t
                wait_ready(t, 180)
                bench.procs["triton"] = {"triton": t.proc.pid}
                triton_note = "2.51 (nvidia-pytriton 0.7.0), Python backend"
        print(f"Triton: {triton_note}", flush=True)
        repo = str(args.models_dir / "onnx_repo")
        svc_grpc, svc_http = free_port(), free_port()
        svc = start_meshserve("direct", ["service", "onnx", "--repository", repo, "--host", "127.0.0.1",
                                         "--grpc-port", str(svc_grpc), "--http-port", str(svc_http),
                                         "--model-control-mode", "explicit", "--load-model", "*",
                                         "--log-level", "WARNING"], svc_http, svc_grpc, res, args.native)
        bench.servers["direct"] = svc
        wait_ready(svc, 120)
        if args.native:
            check_native(svc)
        workers = [int(w) for w in str(args.gateway_workers).split(",")]
        for i, n in enumerate(workers):
            # the first gateway is "gateway"; more (--gateway-workers 1,2: another worker count in
            # front of the same service) are "gateway-wN", measured in the same alternation
            label = "gateway" if i == 0 else f"gateway-w{n}"
            gw_http, gw_grpc = free_port(), free_port()
            gw = start_meshserve(label, ["gateway", "--host", "127.0.0.1", "--http-port", str(gw_http),
                                         "--grpc-port", str(gw_grpc), "--log-level", "WARNING",
                                         "--repository", repo, "--federate-metrics",
                                         "--workers", str(n), "--metrics-port", "0",
                                         "--upstream", f"127.0.0.1:{svc_grpc}"], gw_http, gw_grpc, res,
                                 args.native)
            bench.servers[label] = gw
            wait_ready(gw, 120)
            if args.native:
                check_native(gw)
            bench.procs[label] = {"gateway": gw.proc.pid, "service": svc.proc.pid}
        bench.procs["direct"] = {"service": svc.proc.pid}
        if args.raw_ort:
            bench.raw = RawOrt(Path(repo), args.models_dir / "perf_data", args.pin.get("service"))
        for names in bench.procs.values():
            for name, pid in names.items():
                if name in args.pin:
                    pin(pid, args.pin[name])
        labels = [lab for lab in LABELS if lab in bench.servers] + [lab for lab in bench.servers if lab not in LABELS]
        meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
                "command": "python -m load.bench --side-by-side " + " ".join(argv),
                "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                         text=True).stdout.strip(),
                "interval": args.interval, "ort_threads": args.ort_threads, "gateway_workers": args.gateway_workers,
                "raw_ort": ", ".join(f"{m}@{c}" for m, c in sorted(args.raw_ort)) or "none",
                "raw_ort_runs": args.raw_ort_runs,
                "triton": triton_note, "load_start": load_average(), "native": bench.native,
                "pin": ", ".join(f"{k}={min(v)}-{max(v)}" for k, v in args.pin.items()) or "none"}
        print(f"{len(keys)} cells × {args.repeats} repeats × {len(labels)} servers", flush=True)
        if args.warmup:
            # the first requests a fresh meshserve process serves cost several times the later ones
            # (measured: add_sub gRPC c1, the first run after start 474/668 µs per request in the
            # gateway/service, 127-148/181-208 in the next repeats): each server serves every model
            # and protocol of the sweep once before anything counts (warmup.jsonl)
            print(f"== warm-up: every server, model and protocol at c8, windows of {args.warmup} ms", flush=True)
            for m in dict.fromkeys(k[0] for k in keys):
                for mode in dict.fromkeys(k[1] for k in keys):
                    for label in labels:
                        say(bench.run(label, -1, (m, mode, 8), into="warmup.jsonl", interval=args.warmup))
        records = []
        for i, key in enumerate(keys):
            print(f"== cell {i + 1}/{len(keys)}: {key[0]} {key[1]} c{key[2]}", flush=True)
            for rep in range(args.repeats):
                for label in labels:
                    rec = bench.run(label, rep, key)
                    records.append(rec)
                    say(rec)
        meta["load_end"] = load_average()
        meta["wall_min"] = round((time.monotonic() - t_start) / 60, 1)
        text = report(records, meta)
        (res / "side_by_side.md").write_text(text)
        (res / "meta.json").write_text(json.dumps(meta, indent=1))
        print(text, flush=True)
        print(f"== done: report {res / 'side_by_side.md'}, every run {res / 'runs.jsonl'}", flush=True)
        return 0
    finally:
        if bench.raw is not None:
            bench.raw.stop()
        for s in reversed(list(bench.servers.values())):
            s.stop()
        shutil.rmtree(res / "triton-work", ignore_errors=True)


if __name__ == "__main__":
    procs.clean_exit()
    raise SystemExit(main())
