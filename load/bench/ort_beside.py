"""Raw onnxruntime's CPU per row alone and beside other work on the same cores, in interleaved
rounds: what sharing two cores with a gateway, a service's event loop and a client does to
onnxruntime's own CPU per row (issue 36: mlp's onnxruntime cost 87 µs per row alone, 143 inside
the service beside the gateway and the client).

    python -m load.bench.ort_beside [--batch 16[,32,...]] [--threads 1,2] [--beside alone,spin,mem,stack]
        [--rounds 5] [--runs 300] [--stack-rate 3000]

Each measurement is ``--runs`` runs of the bench models' mlp (``load/bench/sbs.py:raw_ort_session``
with the config's session options and ``intra_op_thread_count`` set to each of ``--threads``, 0 for
not set) at each of ``--batch``'s rows per run (a list of them tells a run's fixed cost from its cost
per row), each run fed a fresh input (64 different batches in turn: the service's inputs are never
the one cached array), this process's CPU seconds (every thread) per row. Beside:

- ``alone``: nothing started.
- ``spin``: one process running a pure-Python loop (takes a core, touches next to no memory).
- ``mem``: one process copying a 64 MiB buffer over and over (takes a core and the caches).
- ``stack``: the serving path without onnxruntime's work: a gateway in front of an ONNX service on
  ``load/bench/light_mlp.py``'s graph (mlp's config, one ``Mul``; ``MESHSERVE_INLINE_RUN_US=0``, so
  batches go to the worker thread as the real mlp's do), driven by ``python -m load`` over gRPC in
  open loop at ``--stack-rate`` requests/s (the real mlp stack's rate: the hop's CPU, the event loop,
  the client).

Conditions alternate within a round (the order rotates from round to round); the report gives
each condition's median and min-max over the rounds, and the other processes' CPU per second.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load.bench import light_mlp, procs
from load.bench.hop_batches import bench_models

SPIN = "while True: pass"
MEM = ("import numpy as np\na = np.ones(1 << 24, np.float32)\nb = np.empty_like(a)\n"
       "while True: np.copyto(b, a)")


def session(repo: Path, model: str, threads: int) -> Any:
    import onnxruntime as ort
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc
    from services.onnx.runtime import session_options

    config = text_format.Parse((repo / model / "config.pbtxt").read_text(), mc.ModelConfig())
    if threads:  # (0: the config's own, here unset: onnxruntime's default, its pool pinned to cores)
        config.parameters["intra_op_thread_count"].string_value = str(threads)
    return ort.InferenceSession(str(repo / model / "1" / "model.onnx"), session_options(config),
                                providers=["CPUExecutionProvider"])


def busy_s() -> float:
    """CPU seconds every process on the machine has used (/proc/stat: all but idle and iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_cores: float, timeout: float) -> float:
    """Wait (up to ``timeout`` s) for a second in which the machine used under ``max_cores``;
    the last second's cores."""
    end = time.monotonic() + timeout
    while True:
        b0 = busy_s()
        time.sleep(1)
        cores = busy_s() - b0
        if cores < max_cores or time.monotonic() > end:
            return cores


def cpu_per_row(sess: Any, batch: int, runs: int) -> tuple[float, float]:
    """(CPU µs per row of this process, cores the rest of the machine used meanwhile)."""
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((batch, 512), dtype=np.float32) for _ in range(64)]
    name_in, names = sess.get_inputs()[0].name, [o.name for o in sess.get_outputs()]
    for f in feeds[:5]:
        sess.run(names, {name_in: f})
    c0, b0, t0 = time.process_time(), busy_s(), time.monotonic()
    for i in range(runs):
        sess.run(names, {name_in: feeds[i % 64]})
    cpu = time.process_time() - c0
    return 1e6 * cpu / (runs * batch), (busy_s() - b0 - cpu) / (time.monotonic() - t0)


class Beside:
    """What runs beside the measurement (started by ``start``, ended by ``stop``)."""

    def __init__(self, kind: str, rate: int, work: Path):
        self.kind, self.rate, self.work = kind, rate, work
        self.procs: list[subprocess.Popen[Any]] = []
        self.servers: list[procs.Server] = []
        self.pids: list[int] = []
        self.cpu0 = 0.0
        self.t0 = 0.0

    def start(self) -> None:
        if self.kind in ("spin", "mem"):
            self.procs.append(subprocess.Popen([sys.executable, "-c", SPIN if self.kind == "spin" else MEM]))
            self.pids = [self.procs[-1].pid]
        elif self.kind == "stack":
            repo = light_mlp.write(self.work / "light")
            svc = procs.service(repo, self.work / "service.log", env={"MESHSERVE_INLINE_RUN_US": "0"})
            self.servers.append(svc)
            gw = procs.gateway([svc.grpc], self.work / "gateway.log")
            self.servers.append(gw)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "load", "--http", gw.http, "--grpc", gw.grpc, "-m", "mlp", "--protocol", "grpc",
                 "-r", str(self.rate), "-d", "3600", "--warmup", "0", "--quiet"],
                cwd=procs.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.pids = [svc.pid, gw.pid, self.procs[-1].pid]
        time.sleep(2 if self.kind == "stack" else 0.5)  # (up to speed before the measurement)
        self.cpu0, self.t0 = self.cpu(), time.monotonic()

    def cpu(self) -> float:
        return sum(procs.proc_tree_cpu_s(p) for p in self.pids)

    def cores(self) -> float:
        """Cores the beside processes used since ``start``."""
        return (self.cpu() - self.cpu0) / max(1e-9, time.monotonic() - self.t0)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait(20)
        for s in reversed(self.servers):
            s.stop()
        self.procs, self.servers, self.pids = [], [], []


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.ort_beside", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="16", help="rows per run (a comma list: each measured in turn)")
    ap.add_argument("--threads", default="0,1,2",
                    help="intra_op_thread_count values (0: not set, onnxruntime's default)")
    ap.add_argument("--beside", default="alone,spin,mem,stack")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--stack-rate", type=int, default=3000, help="the light stack's requests/s (open loop)")
    ap.add_argument("--bench-models", default="/tmp/bench-models")
    ap.add_argument("--quiet", type=float, default=0.3, metavar="CORES",
                    help="before each round, wait (up to --quiet-wait s) for a second under CORES busy")
    ap.add_argument("--quiet-wait", type=float, default=60)
    ap.add_argument("--json", type=Path, default=None, help="every measurement, one JSON object a line")
    a = ap.parse_args(argv)
    repo = bench_models(a.bench_models) / "onnx_repo"
    threads = [int(t) for t in a.threads.split(",")]
    batches = [int(b) for b in a.batch.split(",")]
    kinds = a.beside.split(",")
    sessions = {t: session(repo, "mlp", t) for t in threads}
    work = Path(tempfile.mkdtemp(prefix="ort-beside-"))
    cells: dict[tuple[str, int, int], list[float]] = {}
    cores: dict[str, list[float]] = {}
    out = a.json.open("w") if a.json else None
    others: dict[str, list[float]] = {}
    for r in range(a.rounds):
        wait_quiet(a.quiet, a.quiet_wait)
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            beside = Beside(kind, a.stack_rate, work)
            beside.start()
            try:
                for t, b in [(t, b) for t in threads for b in batches][::1 if r % 2 == 0 else -1]:
                    us, rest = cpu_per_row(sessions[t], b, a.runs)
                    cells.setdefault((kind, t, b), []).append(us)
                    others.setdefault(kind, []).append(rest)
                    if out:
                        print(json.dumps({"round": r, "beside": kind, "threads": t, "batch": b,
                                          "cpu_us_per_row": round(us, 1), "rest_cores": round(rest, 2)}),
                              file=out, flush=True)
                cores.setdefault(kind, []).append(beside.cores())
            finally:
                beside.stop()
    print(f"raw onnxruntime, mlp, CPU µs per row: median (min-max) over {a.rounds} rounds")
    print("| beside | rows per run | beside's cores | the rest of the machine (beside included), cores | "
          + " | ".join(f"intra_op_thread_count {t or 'unset'}" for t in threads) + " |")
    print("|---|---|---|---|" + "---|" * len(threads))
    for kind in kinds:
        for b in batches:
            row = [_spread(cells[(kind, t, b)], 1) for t in threads]
            print(f"| {kind} | {b} | {_spread(cores[kind], 2)} | {_spread(others[kind], 2)} | " + " | ".join(row) + " |")
    if out:
        out.close()


def _spread(xs: list[float], nd: int) -> str:
    s = sorted(xs)
    return f"{round(statistics.median(s), nd)} ({round(s[0], nd)}–{round(s[-1], nd)})"


if __name__ == "__main__":
    procs.clean_exit()
    main()
