"""What bounds each side-by-side cell that misses a goal: py-spy and per-process CPU under load.

    python -m load.bench.profile_cells RESULTS_DIR [--seconds 6] [--all] [--only MODEL:MODE:C]
    (or: PROFILE=1 load/bench/side_by_side.sh, which runs it after the table; UP_ARGS as there)

For every cell of RESULTS_DIR (a side_by_side.sh run) that misses one of issue 21's goals (or every
cell with --all), the same perf_analyzer sweep as the table (../shared/bench/drive.sh, one cell)
runs again against `meshserve up` (gateway + ONNX service), and against the ONNX service alone
where direct-to-service is itself below Triton. While it runs, ``py-spy record`` samples each
meshserve process for ``--seconds`` and /proc gives each process's CPU over the same window.
Written to RESULTS_DIR/profiles/: one raw py-spy profile per process and cell, and ``bounds.md``:
per cell, each process's cores, its top frames (self and inclusive) and the bound this suggests:
- a process at ≥ SATURATED of a core: its one event loop is the ceiling (Python per request);
- the machine's cores all busy (meshserve + perf_analyzer ≥ MACHINE_BUSY of all cores);
- otherwise the latency chain: requests wait on one another (batching cycle, hops), no core full.

py-spy samples from its own process (no pauses: --nonblocking) but its CPU is the machine's: the
profiling pass's throughput is not the table's, so bounds.md quotes CPU and shares, not rates.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from load.bench import ratios
from load.bench.procs import cpu_seconds, running, spawn, stop_process

ROOT = Path(__file__).resolve().parents[2]
SATURATED = 0.9  # cores: one event loop (plus its helper threads) counts as the ceiling above this
MACHINE_BUSY = 0.9  # share of all cores busy


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def meshserve_processes(root_pid: int) -> dict[str, int]:
    """``root_pid`` and its descendants that are meshserve processes, named by role
    (gateway, service-onnx, ...)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children[ppid].append(int(entry))
    found: dict[str, int] = {}
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode() for a in argv if a]
        if "meshserve" not in " ".join(words):
            continue
        if "gateway" in words:
            role = "gateway"
        elif "service" in words:
            role = "service-" + words[words.index("service") + 1]
        else:
            continue  # `meshserve up` itself: it only waits
        name, n = role, 1
        while name in found:  # several processes of one role (workers, replicas)
            n += 1
            name = f"{role}-{n}"
        found[name] = pid
    return found


@dataclass
class Profile:
    samples: int = 0
    own: collections.Counter[str] = field(default_factory=collections.Counter)
    inclusive: collections.Counter[str] = field(default_factory=collections.Counter)
    threads: collections.Counter[str] = field(default_factory=collections.Counter)  # samples per thread (--threads)


def _frame_key(frame: str) -> str:
    where = re.search(r"\(([^)]*)\)", frame)
    return frame.split(" (")[0] + " " + (where.group(1).split("/")[-1].split(":")[0] if where else "")


def read_profile(path: Path) -> Profile:
    """Self and inclusive sample counts per frame (function + file) of a ``py-spy record -f raw``
    output (a frame counts once per sample: recursion), and the samples per thread of one
    recorded with ``--threads`` ("-" without); py-spy's thread and process entries are no frames."""
    p = Profile()
    if not path.exists():
        return p
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        p.samples += n
        frames = stack.split(";")
        p.threads[next((f for f in frames[:2] if f.startswith("thread")), "-")] += n  # (after a process entry)
        frames = [f for f in frames if not f.startswith(("thread", "process"))]
        if frames:
            p.own[_frame_key(frames[-1])] += n
        for key in {_frame_key(f) for f in frames}:
            p.inclusive[key] += n
    return p


def summary(path: Path, own: int = 15, inclusive: int = 25) -> str:
    """A profile's text summary (``python -m load.bench.pyspy_summary``): its samples, the
    share of each thread where it has several, the top ``own`` self and ``inclusive`` frames."""
    p = read_profile(path)
    total = max(1, p.samples)
    lines = [f"== {path}: {p.samples} samples"]
    if len(p.threads) > 1:
        lines += [f"{100 * n / total:5.1f}% {t}" for t, n in p.threads.most_common()]
    lines.append(f"-- self (top {own})")
    lines += [f"{100 * n / total:5.1f}% {k[:110]}" for k, n in p.own.most_common(own)]
    lines.append(f"-- inclusive (top {inclusive})")
    lines += [f"{100 * n / total:5.1f}% {k[:110]}" for k, n in p.inclusive.most_common(inclusive)]
    return "\n".join(lines)


def top(counter: collections.Counter[str], total: int, n: int, skip: tuple[str, ...] = ()) -> str:
    picked = [(k, v) for k, v in counter.most_common(n + len(skip) + 8) if not k.startswith(skip)][:n]
    return "; ".join(f"{k.strip()} {100 * v / max(1, total):.0f}%" for k, v in picked)


# frames every event-loop stack has: they say nothing about where the time goes
_OUTER = ("<module>", "run ", "run_forever", "_run_once", "_run ", "main ", "amain", "run_module", "_run_code",
          "_run_module_as_main", "serve ", "_cmd_", "Runner.run ", "Thread._bootstrap", "Thread.run ")


RUNTIME_FRAMES = ("Session.run ", "OnnxInstance.run ")  # the model itself (onnxruntime), not meshserve's Python


def bound(cores: dict[str, float], busy_share: float, runtime_share: dict[str, float] | None = None) -> str:
    """What the CPU figures point to. ``runtime_share``: per process, the share of its samples
    inside the model's own execution (onnxruntime's Session.run)."""
    runtime_share = runtime_share or {}
    hot = []
    for name, c in cores.items():
        if c >= SATURATED:
            share = runtime_share.get(name, 0.0)
            what = (f"the model's execution: onnxruntime, {100 * share:.0f}% of its samples" if share >= 0.4
                    else "its event loop's Python per request")
            hot.append(f"{name} ({c:.2f} core) — {what}")
    if hot:
        return "one process at a full core: " + "; ".join(hot)
    if busy_share >= MACHINE_BUSY:
        return f"the machine: {100 * busy_share:.0f}% of all cores busy (meshserve + perf_analyzer)"
    return ("no core full (" + ", ".join(f"{n} {c:.2f}" for n, c in cores.items())
            + f"; machine {100 * busy_share:.0f}% busy): the latency chain — requests wait for the batch "
            "cycle and the hops, not for CPU")


class Pass:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.res = Path(args.results)
        self.out = self.res / "profiles"
        self.out.mkdir(parents=True, exist_ok=True)
        self.bench = Path(os.environ.get("BENCH_DIR", ROOT.parent / "shared" / "bench"))
        self.models = Path(os.environ.get("MODELS_DIR", "/tmp/bench-models"))
        self.md: list[str] = []

    def log(self, msg: str) -> None:
        print(f"[profile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def start(self, argv: list[str], ready_url: str, log_name: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(self.out / log_name, "wb")
        proc = spawn([sys.executable, "-m", "meshserve", *argv], cwd=ROOT, env=env, stdout=log,
                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise SystemExit(f"meshserve {' '.join(argv)} exited (rc {proc.returncode}); see {log.name}")
                try:
                    with urllib.request.urlopen(ready_url, timeout=1) as r:
                        if r.status == 200:
                            return proc
                except OSError:
                    pass
                time.sleep(0.5)
        except BaseException:  # (not ready, or Ctrl-C meanwhile: nothing left behind)
            stop_process(proc)
            raise
        stop_process(proc)
        raise SystemExit(f"meshserve {' '.join(argv)}: not ready in 120 s; see {log.name}")

    def cell(self, label: str, root: subprocess.Popen[bytes], http: str, grpc: str, cell: ratios.Cell) -> None:
        m, mode, c = cell.key
        tag = f"{label}-{m}-{mode}-c{c}"
        procs = meshserve_processes(root.pid)
        with contextlib.ExitStack() as started:  # drive.sh and the spies stopped with their groups, however this ends
            self._measure(started, label, tag, procs, root, http, grpc, cell)

    def _measure(self, started: contextlib.ExitStack, label: str, tag: str, procs: dict[str, int],
                 root: subprocess.Popen[bytes], http: str, grpc: str, cell: ratios.Cell) -> None:
        m, mode, c = cell.key
        drive_env = dict(os.environ, OUT=str(self.out / "drive.jsonl"))
        drive = started.enter_context(running(spawn(
            [str(self.bench / "drive.sh"), http, grpc, m, f"profile-{label}", "--server-pid", str(root.pid),
             "--stats", "triton", "--interval", str(self.a.interval), "--concurrency", str(c), "--modes", mode,
             "--input-data", str(self.models / "perf_data" / f"{m}.json"), "--quiet-wait", "0",
             "--stability", "999"],  # three windows, no more: the py-spy window lies inside them
            env=drive_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(self.a.warmup)  # perf_analyzer's own warm-up and first window
        spies = {name: started.enter_context(running(spawn(
            ["py-spy", "record", "-p", str(pid), "-d", str(self.a.seconds), "-r", str(self.a.rate), "-f", "raw",
             "--nonblocking", "-o", str(self.out / f"{tag}-{name}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), signal.SIGINT)) for name, pid in procs.items()}
        c0 = {name: cpu_seconds(pid) for name, pid in procs.items()}
        b0, t0 = machine_busy()
        w0 = time.monotonic()
        for spy in spies.values():
            spy.wait()
        wall = time.monotonic() - w0
        b1, t1 = machine_busy()
        cores = {name: (cpu_seconds(pid) - c0[name]) / wall for name, pid in procs.items()}
        busy = (b1 - b0) / max(1, t1 - t0)
        drive.wait()
        profiles = {name: read_profile(self.out / f"{tag}-{name}.txt") for name in procs}
        runtime = {name: max((p.inclusive[k] for k in p.inclusive if k.startswith(RUNTIME_FRAMES)), default=0)
                   / max(1, p.samples) for name, p in profiles.items()}
        goals = ", ".join(cell.missed) or "none"
        self.md += [f"### {label}: {m} {mode} c{c}",
                    "",
                    f"- table: gw/Triton {cell.vs_triton:.2f}, gw/direct {cell.vs_direct:.2f}, p99 ms Triton / gw / "
                    f"direct {' / '.join(f'{p:.1f}' for p in cell.p99_ms)}, rows/exec "
                    f"{' / '.join(f'{r:.1f}' for r in cell.rows)}; goals missed: {goals}",
                    f"- CPU over {wall:.1f} s: " + ", ".join(f"{n} {v:.2f} core" for n, v in cores.items())
                    + f"; machine {100 * busy:.0f}% busy",
                    f"- **bound:** {bound(cores, busy, runtime)}"]
        for name, prof in profiles.items():
            self.md += [f"- {name} ({prof.samples} samples, `{tag}-{name}.txt`): self — "
                        + top(prof.own, prof.samples, 6),
                        "  inclusive — " + top(prof.inclusive, prof.samples, 8, _OUTER)]
        self.md.append("")
        self.log(f"{tag}: " + ", ".join(f"{n} {v:.2f}" for n, v in cores.items()) + f"; busy {100 * busy:.0f}%")

    def sweep(self, label: str, argv: list[str], http_port: int, cells: list[ratios.Cell]) -> None:
        """Start meshserve (``argv``; HTTP on ``http_port``, gRPC on the next port) and profile
        ``cells`` against it."""
        if not cells:
            return
        http, grpc = f"127.0.0.1:{http_port}", f"127.0.0.1:{http_port + 1}"
        proc = self.start(argv, f"http://{http}/v2/health/ready", f"meshserve-{label}.log")
        with running(proc, timeout=30):  # (with a gateway's workers, however the sweep ends)
            for cell in cells:
                self.cell(label, proc, http, grpc, cell)

    def run(self) -> None:
        chosen = [c for c in ratios.cells(self.res) if self.a.all or (c.known and not all(c.goals))]
        if self.a.only:
            chosen = [c for c in chosen if ":".join(map(str, c.key)) in self.a.only]
        direct_too = [c for c in chosen if self.a.all or c.direct < c.triton]
        self.md = [f"# What bounds each cell: {self.res}", "",
                   f"`python -m load.bench.profile_cells` — py-spy ({self.a.rate} Hz, {self.a.seconds} s) and "
                   f"/proc CPU per process while perf_analyzer drives the cell again; a process at ≥ {SATURATED} "
                   "core is its event loop's ceiling. Frames: function and file; shares of that process's samples. "
                   "py-spy counts C time in the Python frame that called it: `Runner.run`'s self time is the event "
                   "loop's own C (uvloop: epoll, socket reads and writes), `Connection._serve`'s includes httptools' "
                   "parser.",
                   "", "## Through the gateway (`meshserve up`)", ""]
        port = self.a.port_base
        repo = str(self.models / "onnx_repo")
        self.sweep("gateway", ["up", "--repository", repo, "--http-port", str(port), "--grpc-port", str(port + 1),
                               *os.environ.get("UP_ARGS", "").split()], port, chosen)
        self.md += ["## Direct to the ONNX service (cells where direct is below Triton)", ""]
        self.sweep("direct", ["service", "onnx", "--repository", repo, "--http-port", str(port + 100), "--grpc-port",
                              str(port + 101), "--log-level", "WARNING"], port + 100, direct_too)
        (self.out / "bounds.md").write_text("\n".join(self.md) + "\n")
        self.log(f"wrote {self.out / 'bounds.md'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.profile_cells", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a side_by_side.sh results directory (its *.jsonl)")
    ap.add_argument("--seconds", type=int, default=6, help="py-spy window per cell")
    ap.add_argument("--warmup", type=float, default=2.5, help="seconds of load before the window opens")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--interval", type=int, default=3000, help="perf_analyzer measurement window, ms")
    ap.add_argument("--port-base", type=int, default=int(os.environ.get("PORT_BASE", "19000")))
    ap.add_argument("--all", action="store_true", help="every cell, not only those that miss a goal")
    ap.add_argument("--only", action="append", default=[], metavar="MODEL:MODE:C",
                    help="only this cell (repeat), e.g. add_sub:http:32")
    Pass(ap.parse_args(argv)).run()


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
