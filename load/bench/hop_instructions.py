"""The gateway hop's own cost per request, in instructions (callgrind): a number that holds on a
busy machine, where CPU seconds and throughput do not.

    python -m load.bench.hop_instructions [--requests 200] [--protocols grpc,http,http-json]

One ONNX service on the team's bench models and one gateway run under ``valgrind --tool=callgrind``
with instrumentation off; per model and protocol, a tritonclient sends 30 warm-up requests, one at
a time, then instrumentation is switched on (``callgrind_control``, by the gateway's pid) for
``--requests`` more and the dump's program total is divided by them. Needs valgrind
(``apt-get install valgrind``). The gateway is ~50x slower under callgrind: c1 only.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from load.bench import procs
from load.bench.callgrind import program_total
from load.bench.hop_batches import bench_models
from meshserve.server.process import parse_ready_line


def _client_call(model: str, protocol: str, gateway: dict[str, int]) -> tuple[Callable[[], Any], Any]:
    """One request of ``model`` (batch 1) over ``protocol`` to the gateway, and the client."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    width = 16 if model == "add_sub" else 512
    names = ["INPUT0", "INPUT1"] if model == "add_sub" else ["INPUT0"]
    data = np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)
    if protocol == "grpc":
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway['grpc']}")
        ins = [grpcclient.InferInput(n, [1, width], "FP32") for n in names]
        for i in ins:
            i.set_data_from_numpy(data)
        return (lambda: g.infer(model, ins)), g
    binary = protocol == "http"
    h = httpclient.InferenceServerClient(f"127.0.0.1:{gateway['http']}")
    hins = [httpclient.InferInput(n, [1, width], "FP32") for n in names]
    for i in hins:
        i.set_data_from_numpy(data, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(n.replace("INPUT", "OUTPUT"), binary_data=binary) for n in names]
    return (lambda: h.infer(model, hins, outputs=outs)), h


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.hop_instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--protocols", default="grpc,http,http-json")
    ap.add_argument("--models", default="add_sub,mlp")
    ap.add_argument("--bench-models", default="/tmp/bench-models", help="gen_models.py output (made if missing)")
    a = ap.parse_args(argv)
    models = bench_models(a.bench_models)
    out = Path(tempfile.mkdtemp(prefix="hop-instructions-"))
    svc = procs.service(models / "onnx_repo", out / "service.log")
    gw = procs.spawn(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
                      sys.executable, "-m", "meshserve", "gateway", "--upstream", svc.grpc, "--grpc-port", "0",
                      "--http-port", "0", "--log-level", "WARNING"],
                     cwd=procs.ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ports: dict[str, int] | None = None
        assert gw.stdout is not None
        for line in gw.stdout:
            ports = parse_ready_line(line)
            if ports is not None:
                break
        if ports is None:
            raise SystemExit("the gateway under callgrind did not start")
        threading.Thread(target=gw.stdout.read, daemon=True).start()
        pid = str(gw.pid)
        print(f"gateway instructions per request (callgrind, c1, {a.requests} requests after 30 warm-up)")
        for model in a.models.split(","):
            for protocol in a.protocols.split(","):
                call, client = _client_call(model, protocol, ports)
                warm = failures = 0
                while warm < 30:  # (under callgrind a health probe may time out: the replica comes back)
                    try:
                        call()
                        warm += 1
                    except Exception:
                        failures += 1
                        if failures > 120:
                            raise
                        time.sleep(0.5)
                subprocess.run(["callgrind_control", "--zero", pid], capture_output=True)
                subprocess.run(["callgrind_control", "--instr=on", pid], capture_output=True)
                for _ in range(a.requests):
                    call()
                subprocess.run(["callgrind_control", "--instr=off", pid], capture_output=True)
                before = set(out.glob("cg.*"))
                subprocess.run(["callgrind_control", f"--dump={model}-{protocol}", pid], capture_output=True)
                client.close()
                for _ in range(50):  # the dump is written by the gateway's process: wait for it
                    dumps = [d for d in out.glob("cg.*") if d not in before]
                    if dumps:
                        break
                    time.sleep(0.1)
                else:
                    raise SystemExit(f"no callgrind dump appeared in {out}")
                dump = max(dumps, key=lambda d: d.stat().st_mtime)
                print(f"{model:8s} {protocol:9s} {program_total(dump) / a.requests / 1e6:.3f} M  ({dump})", flush=True)
    finally:
        procs.stop_process(gw)
        svc.stop()


if __name__ == "__main__":
    procs.clean_exit()
    main()
