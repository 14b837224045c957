"""The mesh benchmark's Triton case (`python -m load.bench --mesh --cases triton`; docs/perf/model-mesh.md).

The real Triton (2.51, the binary in nvidia-pytriton's wheel: ../shared/bench/README.md) in explicit
model control mode, asked to load the whole mesh repository one model at a time through the
repository API (POST /v2/repository/models/<m>/load, what `--load-model=*` does at start, but
observable per model), under a memory cap: the memory the mesh's replicas may use in all
(`--triton-memory-mib`; by default each replica's budget + its measured base + the stated slack,
times the replicas). Then the same Zipf mix as the other cases for ``--triton-duration`` seconds over
all the models, whatever loaded, with every failure counted by its reason.

Each model is the mesh's ONNX graph run by Triton's Python backend through onnxruntime, with the
side by side's model.py (../shared/bench/gen_models.py:TRITON_MODEL_PY, its onnxruntime branch):
Triton's wheel ships no onnxruntime backend. The python backend runs one stub process per model
instance, which is what Triton's explicit mode costs per model here.

The cap, so that a shared machine is never driven out of memory: a memory cgroup made under this
process's own (v2 memory.max, or v1 memory.limit_in_bytes), which tritonserver and its stubs run
in; the kernel's OOM killer acts inside it at the cap. Without a writable cgroup, a watchdog sums
the RSS of tritonserver and its stubs every 0.2 s and kills them all at the cap ("out of memory at N
models loaded"). start_triton.sh takes no --model-control-mode, so the binary is started here with
the backend layout and environment that script sets up (the stub copied next to libtriton_python.so,
the venv first on PATH).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load.bench import mesh_models, procs
from load.bench.mesh import Sample, _percentiles, mix
from load.bench.sbs import triton_binary
from services.base.memory import pss_bytes, rss_bytes
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT.parent / "shared" / "bench"
LOAD_TIMEOUT_S = 120.0
STOP_AFTER_FAILURES = 5  # consecutive failed loads that end the load phase (the cap is reached)
# tritonserver's --exit-timeout-secs (its default: 30): how long its exit waits for models to
# unload. A model whose stub the cap OOM-killed never does, so at the default every "out of
# memory" run ended with 30 s of "Found 1 live models" before tritonserver exited; the mix is
# over by then, nothing is in flight
EXIT_TIMEOUT_S = 2


# ---- the repository Triton serves --------------------------------------------------------------
def model_py() -> str:
    """The side by side's Python-backend model.py, its onnxruntime branch (runs 1/model.onnx)."""
    spec = importlib.util.spec_from_file_location("shared_gen_models", BENCH / "gen_models.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"no {BENCH / 'gen_models.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.TRITON_MODEL_PY.format(model="mlp"))


def triton_repository(mesh_repo: Path, names: list[str], dest: Path) -> Path:
    """``dest``: each mesh model as a python-backend model over the same model.onnx (a symlink)."""
    code = model_py()
    for name in names:
        folder = dest / name / "1"
        folder.mkdir(parents=True, exist_ok=True)
        (dest / name / "config.pbtxt").write_text(
            mesh_models.config(name).replace('platform: "onnxruntime_onnx"', 'backend: "python"'))
        (folder / "model.py").write_text(code)
        link = folder / "model.onnx"
        if not link.exists():
            link.symlink_to((mesh_repo / name / "1" / "model.onnx").resolve())
    return dest


# ---- the memory cap ----------------------------------------------------------------------------
class Cgroup:
    """A memory cgroup of our own under this process's cgroup (v2 or v1), removed by ``close``."""

    def __init__(self, path: Path, version: int, limit: int):
        self.path, self.version, self.limit = path, version, limit

    @classmethod
    def make(cls, limit: int, name: str) -> Cgroup | None:
        for version, base, limit_file in _memory_hierarchies():
            parent = base / _own_group(version).strip("/")
            at = parent / name
            try:
                at.mkdir()
            except OSError:
                continue
            try:
                (at / limit_file).write_text(str(limit))
                if int((at / limit_file).read_text().split()[0]) > limit:
                    raise OSError("limit not taken")
                return cls(at, version, limit)
            except (OSError, ValueError):
                try:
                    at.rmdir()
                except OSError:
                    pass
        return None

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def usage(self) -> int:
        return self._read("memory.current" if self.version == 2 else "memory.usage_in_bytes")

    def peak(self) -> int:
        return self._read("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        try:
            text = (self.path / ("memory.events" if self.version == 2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(m.group(1)) if m else 0

    def _read(self, name: str) -> int:
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                left = [int(p) for p in self.procs.read_text().split()]
            except OSError:
                return
            for pid in left:  # only processes we started are in it (tritonserver's stubs, orphaned)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def _memory_hierarchies() -> list[tuple[int, Path, str]]:
    """(version, mount point, limit file) of each mounted cgroup hierarchy with the memory controller."""
    out: list[tuple[int, Path, str]] = []
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return out
    for line in mounts:
        parts = line.split()
        if len(parts) < 4:
            continue
        where = Path(parts[1])
        if parts[2] == "cgroup2":
            try:
                if "memory" in (where / "cgroup.controllers").read_text().split():
                    out.append((2, where, "memory.max"))
            except OSError:
                continue
        elif parts[2] == "cgroup" and "memory" in parts[3].split(","):
            out.append((1, where, "memory.limit_in_bytes"))
    return out


def _own_group(version: int) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        if (version == 2 and controllers == "") or (version == 1 and "memory" in controllers.split(",")):
            return group
    return "/"


def descendants(pid: int) -> list[int]:
    """``pid`` and every live (not zombie) process under it (one pass over /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parent[int(entry)] = int(fields[1])
            except (OSError, ValueError, IndexError):
                continue
    out, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


@dataclass
class Meter:
    """Tritonserver's process tree sampled every 0.2 s: peak tree RSS, and the watchdog."""

    pid: int
    cap: int
    cgroup: Cgroup | None
    peak_tree_rss: int = 0
    killed_by_watchdog: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    def tree_rss(self) -> int:
        return sum(rss_bytes(p) for p in descendants(self.pid))

    def run(self) -> None:
        while not self.stop.is_set():
            rss = self.tree_rss()
            self.peak_tree_rss = max(self.peak_tree_rss, rss)
            if self.cgroup is None and rss >= self.cap and not self.killed_by_watchdog:
                self.killed_by_watchdog = True
                for p in reversed(descendants(self.pid)):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
            self.stop.wait(0.2)


# ---- tritonserver ------------------------------------------------------------------------------
class Triton:
    """tritonserver --model-control-mode=explicit on ``repo``, inside ``cgroup`` when there is one."""

    def __init__(self, venv: Path, repo: Path, work: Path, cgroup: Cgroup | None):
        binary = triton_binary(venv)
        if binary is None:
            raise SystemExit(f"no tritonserver in {venv} (../shared/bench/README.md: pip install nvidia-pytriton)")
        ts = binary.parents[1]
        site = ts.parents[1]
        pyver = re.sub(r"^python", "", site.parent.name)
        backends = work / "backends" / "python"
        backends.mkdir(parents=True, exist_ok=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            if not (backends / name).exists():
                (backends / name).symlink_to(ts / "backends" / "python" / name)
        stub = backends / "triton_python_backend_stub"
        if not stub.exists():
            stub.write_bytes((ts / "python_backend_stubs" / pyver / "triton_python_backend_stub").read_bytes())
            stub.chmod(0o755)
        self.http_port, self.grpc_port, metrics = free_port(), free_port(), free_port()
        env = {**os.environ, "LD_LIBRARY_PATH": str(site / "nvidia_pytriton.libs"),
               "PYTHONPATH": str(site), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               "BENCH_ORT_THREADS": "1", "CGROUP_PROCS": str(cgroup.procs) if cgroup else "/dev/null"}
        argv = [str(binary), f"--model-repository={repo}", f"--backend-directory={work / 'backends'}",
                "--model-control-mode=explicit", "--http-address=127.0.0.1", f"--http-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}", "--metrics-address=127.0.0.1",
                f"--metrics-port={metrics}", "--allow-gpu-metrics=false", "--log-verbose=0",
                f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]
        self.log = work / "tritonserver.log"
        self._shm_before = _stub_regions()
        # the shell joins the cgroup, then becomes tritonserver: every stub it starts is inside
        # (its own process group: stop() waits out the python stubs it starts too, procs.stop_process)
        self.proc = procs.spawn(["sh", "-c", 'echo $$ > "$CGROUP_PROCS" && exec "$@"', "sh", *argv],
                                env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self.http, self.grpc = f"127.0.0.1:{self.http_port}", f"127.0.0.1:{self.grpc_port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 120) -> None:
        try:
            procs.wait_ready(self.http, timeout, self.proc)
        except RuntimeError as exc:
            raise SystemExit(f"tritonserver {exc}; see {self.log}") from None

    def load(self, name: str) -> tuple[bool, str]:
        req = urllib.request.Request(f"http://{self.http}/v2/repository/models/{name}/load", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=LOAD_TIMEOUT_S) as r:
                return r.status == 200, ""
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                return False, str(json.loads(body).get("error", body))
            except ValueError:
                return False, body
        except OSError as exc:
            return False, f"{type(exc).__name__}: {exc}"

    def ready_models(self) -> list[str]:
        req = urllib.request.Request(f"http://{self.http}/v2/repository/index", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return [m["name"] for m in json.loads(r.read()) if m.get("state") == "READY"]
        except (OSError, ValueError):
            return []

    def stop(self) -> None:
        procs.stop_process(self.proc, signal.SIGTERM, timeout=30)
        # a stub or a tritonserver the cap killed leaves its shared-memory region in /dev/shm (1 MiB
        # each, for good): the regions that came while it ran go with it
        for region in _stub_regions() - self._shm_before:
            region.unlink(missing_ok=True)


def _stub_regions() -> set[Path]:
    """The python backend's shared-memory regions (``/dev/shm/triton_python_backend_shm_region_*``)."""
    return set(Path("/dev/shm").glob("triton_python_backend_shm_region_*"))


def reason(outcome: str) -> str:
    """A failure's outcome with model names taken out (one row per reason, not per model)."""
    return re.sub(r"mesh_\d+", "<model>", outcome)


def run(mesh_repo: Path, names: list[str], weights: list[float], args: argparse.Namespace,
        cap: int, workdir: Path) -> dict[str, Any]:
    """The Triton case: load every model under ``cap``, then the Zipf mix on what loaded."""
    repo = triton_repository(mesh_repo, names, workdir / "triton_repo")
    cgroup = Cgroup.make(cap, f"meshbench-triton-{os.getpid()}")
    result: dict[str, Any] = {"case": "triton", "memory_cap_bytes": cap,
                              "cap_by": (f"cgroup v{cgroup.version} memory limit" if cgroup
                                         else "watchdog on tritonserver's process-tree RSS")}
    triton = Triton(args.triton_venv, repo, workdir, cgroup)
    meter = Meter(triton.proc.pid, cap, cgroup)
    watcher = threading.Thread(target=meter.run, daemon=True)
    loads: list[dict[str, Any]] = []
    samples: list[Sample] = []
    try:
        triton.wait_ready()
        watcher.start()
        result["idle_tree_rss_bytes"] = meter.tree_rss()
        result["idle_cgroup_bytes"] = cgroup.usage() if cgroup else None
        t0 = time.monotonic()
        failures_in_row = 0
        for name in names:
            if not triton.alive() or meter.killed_by_watchdog:
                break
            if time.monotonic() - t0 > args.triton_load_limit:
                result["load_phase_cut"] = f"after {args.triton_load_limit:.0f} s (--triton-load-limit)"
                break
            started = time.monotonic()
            ok, error = triton.load(name)
            loads.append({"model": name, "ok": ok, "seconds": round(time.monotonic() - started, 3),
                          "error": reason(error)[:200], "cgroup_bytes": cgroup.usage() if cgroup else None,
                          "tree_rss_bytes": meter.tree_rss(), "stubs": max(0, len(descendants(triton.proc.pid)) - 1),
                          "oom_kills": cgroup.oom_kills() if cgroup else None})
            failures_in_row = 0 if ok else failures_in_row + 1
            if failures_in_row >= STOP_AFTER_FAILURES:
                result["load_phase_cut"] = f"{STOP_AFTER_FAILURES} loads in a row failed"
                break
        load_s = time.monotonic() - t0
        ready = triton.ready_models() if triton.alive() else []
        procs = descendants(triton.proc.pid) if triton.alive() else []
        result.update({
            "load_attempts": len(loads), "loads_ok": sum(1 for x in loads if x["ok"]),
            "load_errors": dict(Counter(x["error"] for x in loads if not x["ok"])),
            "load_seconds": round(load_s, 1),
            "load_p50_s": round(statistics.median([x["seconds"] for x in loads if x["ok"]]), 3)
            if any(x["ok"] for x in loads) else None,
            "ready_after_loads": len(ready), "server_alive_after_loads": triton.alive(),
            "killed_by_watchdog": meter.killed_by_watchdog,
            "oom_kills_after_loads": cgroup.oom_kills() if cgroup else None,
            "cgroup_bytes_after_loads": cgroup.usage() if cgroup else None,
            "tree_rss_bytes_after_loads": meter.tree_rss() if triton.alive() else 0,
            "tree_pss_bytes_after_loads": sum(pss_bytes(p) for p in procs),
            "stub_processes_after_loads": max(0, len(procs) - 1),  # live ones: an OOM-killed stub is gone
            "weight_share_ready": round(sum(w for n, w in zip(names, weights, strict=True) if n in set(ready))
                                        / sum(weights), 4),
        })
        # the Zipf mix over every model, as the other cases (whatever Triton has loaded)
        samples, elapsed = mix(triton.grpc, names, weights, args.clients, args.triton_duration)
        ok_samples = [s for s in samples if s.outcome == "OK"]
        result.update({
            "requests": len(samples), "ok": len(ok_samples), "failed": len(samples) - len(ok_samples),
            "failures": dict(Counter(reason(s.outcome) for s in samples if s.outcome != "OK")),
            "throughput_rps": round(len(samples) / elapsed, 1) if elapsed else None,
            "latency_ok": _percentiles([s.end - s.start for s in ok_samples]),
            "latency_failed": _percentiles([s.end - s.start for s in samples if s.outcome != "OK"]),
            "duration_s": round(elapsed, 1),
            "ready_after_mix": len(triton.ready_models()) if triton.alive() else 0,
            "server_alive_after_mix": triton.alive(),
            "oom_kills_after_mix": cgroup.oom_kills() if cgroup else None,
        })
    finally:
        meter.stop.set()
        result["peak_tree_rss_bytes"] = meter.peak_tree_rss
        result["peak_cgroup_bytes"] = cgroup.peak() if cgroup else None
        triton.stop()
        if cgroup:
            cgroup.close()
    result["outcome"] = verdict(result)
    result["loads"] = loads
    return result


def verdict(r: dict[str, Any]) -> str:
    """Refused, out of memory, or served (the issue's three words), with the counts that say so."""
    attempted, ok = r.get("load_attempts", 0), r.get("loads_ok", 0)
    ready, stubs = r.get("ready_after_loads", 0), r.get("stub_processes_after_loads", 0)
    kills = r.get("oom_kills_after_mix") or r.get("oom_kills_after_loads") or 0
    if r.get("killed_by_watchdog"):
        return f"out of memory at {ok} models loaded: the watchdog killed tritonserver at the cap"
    if not r.get("server_alive_after_loads", False):
        return (f"out of memory at {ok} models loaded: tritonserver was killed ({kills} processes OOM-killed "
                f"in all, the stubs of earlier models first)")
    if kills:
        return (f"out of memory: {ok} of {attempted} loads accepted, {kills} processes OOM-killed at the cap; "
                f"{ready} models READY but {stubs} stub processes alive: the others' requests fail")
    if ok < attempted:
        return f"refused: {ok} of {attempted} models loaded"
    if r.get("failed", 1) == 0:
        return f"served: all {ok} models loaded, every request answered"
    return f"{ok} models loaded; {r.get('failed')} requests failed"
