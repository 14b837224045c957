"""The ONNX service's per-request cost below the transport, in one process: a ServiceCore on
the bench repository, C coroutines calling observe.infer (what both front ends call) with a
request parsed from its bytes each time, on uvloop. Prints CPU and wall per request and rows per
execution. Run from a tree's root:
  PYTHONPATH=. python3 load/results/2026-11-26-s4-svcpath/core_bench.py MODEL C N [--profile OUT]
Under callgrind (instructions per request of the core path: counters zeroed after the warm-up,
dumped after the N requests; ../2026-11-26-refactor/per-request.sh N DIR reads DIR/cg.out.1):
  CALLGRIND=1 valgrind --tool=callgrind --callgrind-out-file=DIR/cg.out \
    /root/.pyenv/versions/3.11.7/bin/python3 .../core_bench.py add_sub 32 2000"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import uvloop

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import observe
from meshserve.server.core import RequestContext
from services.base.core import ServiceCore
from services.onnx.runtime import OnnxRuntimeAdapter

REPO = Path(os.environ.get("REPO", "/tmp/bench-models/onnx_repo"))


def request_bytes(model: str) -> bytes:
    names, dim = (("INPUT0", "INPUT1"), 16) if model == "add_sub" else (("INPUT0",), 512)
    req = pb.ModelInferRequest(model_name=model)
    for n in names:
        req.inputs.add(name=n, datatype="FP32", shape=[1, dim])
        req.raw_input_contents.append(np.random.rand(1, dim).astype(np.float32).tobytes())
    return req.SerializeToString()


async def client(core: ServiceCore, raw: bytes, n: int) -> None:
    for _ in range(n):
        request = pb.ModelInferRequest.FromString(raw)
        result, _ = await observe.infer(core, request, RequestContext(protocol="grpc", raw=raw))
        result.serialized()


async def measured(core: ServiceCore, raw: bytes, c: int, n: int) -> None:
    await asyncio.gather(*(client(core, raw, n // c) for _ in range(c)))


async def callgrind(command: str) -> None:
    """Under callgrind (CALLGRIND=1): zero (-z) or dump (-d) this process's counters."""
    if os.environ.get("CALLGRIND"):
        proc = subprocess.Popen(["callgrind_control", command, str(os.getpid())], stdout=subprocess.DEVNULL)
        while proc.poll() is None:
            await asyncio.sleep(0.05)


async def main(model: str, c: int, n: int, profile: str | None) -> None:
    core = ServiceCore("onnx", REPO, {"onnxruntime": OnnxRuntimeAdapter()})
    await core.start()
    raw = request_bytes(model)
    await measured(core, raw, c, 300 // c * c)  # warm-up
    mv = core.models[model].versions[1]
    e0, i0 = mv.stats.execution_count, mv.stats.inference_count
    await callgrind("-z")
    t0, p0 = time.perf_counter(), time.process_time()
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    await measured(core, raw, c, n)
    if profile:
        prof.disable()
        prof.dump_stats(profile)
    wall, cpu = time.perf_counter() - t0, time.process_time() - p0
    await callgrind("-d")
    done = n // c * c
    rows = (mv.stats.inference_count - i0) / max(1, mv.stats.execution_count - e0)
    st = mv.stats
    print(f"  queue {st.queue.ns / st.queue.count / 1e3:.1f} us, request {st.success.ns / st.success.count / 1e3:.1f} us (averages over the whole run)")
    for size, b in sorted(mv.stats.batches.items()):
        if b.compute_infer.count > 10:
            print(f"  batch {size}: {b.compute_infer.count} runs, input {b.compute_input.ns / b.compute_input.count / 1e3:.1f} "
                  f"infer {b.compute_infer.ns / b.compute_infer.count / 1e3:.1f} "
                  f"output {b.compute_output.ns / b.compute_output.count / 1e3:.1f} us")
    print(f"{model} c{c}: {done} requests, CPU {cpu / done * 1e6:.1f} us/request, wall {wall / done * 1e6:.1f} "
          f"us/request, {rows:.2f} rows/exec")
    await core.stop()


if __name__ == "__main__":
    prof = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
    uvloop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), prof))
