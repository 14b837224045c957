"""Tensors in system shared memory vs in the request, through a gateway + ONNX service
(docs/shared-memory.md, "Measurements").

    python -m load.bench.shm [--n 60] [--sizes 64,1048576,16777216]

For each tensor size (FP32 identity model, input and output the same size) and protocol,
sequential requests from tritonclient: the tensor sent in the request and returned in the
response, or both in registered regions (the gateway reads the input region, forwards the
request to the service, and writes the output region). Prints the median and p90 latency in
ms, alternating the two ways request by request so both see the same machine. Also times
``shm.uses_shared_memory`` on an ordinary request: what every request that names no region
pays.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shmutil

from load.bench import procs
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import shm


def _q(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def _cost_of_the_check() -> float:
    req = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        req.raw_input_contents.append(b"\0" * 64)
    n = 200_000
    return min(timeit.repeat(lambda: shm.uses_shared_memory(req), number=n, repeat=5)) / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60, help="requests per way, size and protocol")
    ap.add_argument("--sizes", default="64,1048576,16777216", help="tensor bytes (FP32: multiples of 4)")
    args = ap.parse_args()
    print(f"uses_shared_memory on a 2-input request without regions: {_cost_of_the_check():.0f} ns")

    # the test suite's model repository (identity_fp32); by name, so mypy does not check the tests
    build = importlib.import_module("tests.models.generate").build

    with tempfile.TemporaryDirectory() as tmp:
        repo = build(Path(tmp) / "repo")
        service = procs.service(repo, Path(tmp) / "service.log", procs.explicit_control_args())
        gateway = procs.gateway([service.grpc], Path(tmp) / "gateway.log")
        try:
            print("| protocol | tensor bytes | in the request: p50 / p90 ms | in shared memory: p50 / p90 ms |")
            print("|---|---|---|---|")
            for size in (int(s) for s in args.sizes.split(",")):
                for proto in ("http", "grpc"):
                    body, region = _measure(proto, gateway, size, args.n)
                    print(f"| {proto} | {size} | {statistics.median(body):.2f} / {_q(body, 0.9):.2f} | "
                          f"{statistics.median(region):.2f} / {_q(region, 0.9):.2f} |", flush=True)
        finally:
            gateway.stop()
            service.stop()


def _measure(proto: str, gateway: procs.Server, size: int, n: int) -> tuple[list[float], list[float]]:
    lib: Any = httpclient if proto == "http" else grpcclient
    data = np.random.default_rng(1).standard_normal(size // 4).astype(np.float32).reshape(1, -1)
    key_in, key_out = f"/msbench-{os.getpid()}-in", f"/msbench-{os.getpid()}-out"
    h_in = shmutil.create_shared_memory_region("in", key_in, size, create_only=True)
    h_out = shmutil.create_shared_memory_region("out", key_out, size, create_only=True)
    shmutil.set_shared_memory_region(h_in, [data])
    url = gateway.http if proto == "http" else gateway.grpc
    body_ms: list[float] = []
    region_ms: list[float] = []
    try:
        with lib.InferenceServerClient(url) as c:
            c.unregister_system_shared_memory()
            c.register_system_shared_memory("in", key_in, size)
            c.register_system_shared_memory("out", key_out, size)
            plain = lib.InferInput("INPUT0", list(data.shape), "FP32")
            plain.set_data_from_numpy(data)
            via = lib.InferInput("INPUT0", list(data.shape), "FP32")
            via.set_shared_memory("in", size)
            out = lib.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("out", size)
            for i in range(n + 5):  # the first 5 of each warm up
                t0 = time.perf_counter()
                got = c.infer("identity_fp32", [plain]).as_numpy("OUTPUT0")
                t1 = time.perf_counter()
                c.infer("identity_fp32", [via], outputs=[out])
                shm_got = shmutil.get_contents_as_numpy(h_out, np.float32, list(data.shape))
                t2 = time.perf_counter()
                if i == 0:
                    assert np.array_equal(got, data) and np.array_equal(shm_got, data)
                if i >= 5:
                    body_ms.append((t1 - t0) * 1e3)
                    region_ms.append((t2 - t1) * 1e3)
            c.unregister_system_shared_memory()
    finally:
        shmutil.destroy_shared_memory_region(h_in)
        shmutil.destroy_shared_memory_region(h_out)
    return body_ms, region_ms


if __name__ == "__main__":
    procs.clean_exit()
    main()
