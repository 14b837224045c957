"""The HTTP front door's own cost per infer request, in process: the httptools Connection
(meshserve/server/http1) with a fake transport, HttpFrontend, http_codec, observe.infer, and
a core that answers at once (outputs = inputs). No socket, no model: what this measures is the
front door's Python path, from the request's bytes in data_received to its answer's write.

usage: python http_path.py add_sub|mlp binary|json|json-pa N [profile]
(json-pa: the JSON body with Inference-Header-Content-Length = its length, as perf_analyzer sends it;
mlp: the bench model's one input of 512 floats. Both added in session 5 for
../2026-11-26-s5-jsonpath, whose scripts call this one; this folder's numbers are add_sub binary
and json, unchanged by them.)
Prints µs per request (best of 5 rounds of N). Run under callgrind with N and with 0 for the
instructions of N requests.
"""
from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import numpy as np

from load import inputs
from load.rawhttp import build_request
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import http1
from meshserve.server.access import Grant
from meshserve.server.core import InferResult
from meshserve.server.http_frontend import HttpFrontend
from meshserve.server.limits import ServerLimits

MODELS = {"add_sub": ([("INPUT0", [16]), ("INPUT1", [16])], ["OUTPUT0", "OUTPUT1"]),
          "mlp": ([("INPUT0", [512])], ["OUTPUT0"])}


class EchoCore:
    """Answers every infer with its inputs as outputs (the model's work left out)."""

    def authorize(self, op: Any, model: str, ctx: Any) -> Grant:
        return Grant()

    async def infer(self, request: pb.ModelInferRequest, ctx: Any) -> InferResult:
        out = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for i, (t, name) in enumerate(zip(request.inputs, self.outputs, strict=True)):
            out.outputs.add(name=name, datatype=t.datatype, shape=t.shape)
            out.raw_output_contents.append(request.raw_input_contents[i])
        return InferResult(out)


class FakeTransport:
    def __init__(self) -> None:
        self.done: asyncio.Future[None] | None = None
        self.n = 0

    def write(self, data: bytes) -> None:
        self.n += 1
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def writelines(self, data: list[bytes]) -> None:
        self.write(b"")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def can_write_eof(self) -> bool: return True
    def write_eof(self) -> None: ...
    def close(self) -> None: ...


async def main(model: str, kind: str, n: int, profile: bool) -> None:
    specs, outs = MODELS[model]
    core = EchoCore()
    core.outputs = outs  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    info = inputs.ModelInfo(model, 64, [inputs.TensorSpec(name, "FP32", shape) for name, shape in specs], outs)
    arrays = {name: rng.random((1, *shape), dtype=np.float32) for name, shape in specs}
    p = inputs.encode(model, "", arrays, info)
    path = f"/v2/models/{model}/infer"
    if kind == "binary":
        raw = build_request("127.0.0.1:1", path, p.http_binary,
                            {"Inference-Header-Content-Length": str(p.http_binary_header_len),
                             "Content-Type": "application/octet-stream"})
    elif kind == "json-pa":
        raw = build_request("127.0.0.1:1", path, p.http_json, {"Content-Type": "application/json",
                                                               "Inference-Header-Content-Length": str(len(p.http_json))})
    else:
        raw = build_request("127.0.0.1:1", path, p.http_json, {"Content-Type": "application/json"})
    limits = ServerLimits()
    frontend = HttpFrontend(core, limits)  # type: ignore[arg-type]
    server = http1.Http1Server(getattr(frontend, "answer", frontend.handle), limits)  # (before: handle)
    conn = http1.server.Connection(server)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()

    async def one() -> None:
        transport.done = loop.create_future()
        conn.data_received(raw)
        await transport.done

    for _ in range(200):
        await one()
    assert transport.n == 200, transport.n
    if profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            await one()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
        return
    best = []
    for _ in range(5 if n else 1):
        t0 = time.perf_counter()
        for _ in range(n):
            await one()
        best.append(time.perf_counter() - t0)
    if n:
        print(f"{model} {kind}: {min(best) / n * 1e6:.1f} us per request (best of 5 x {n})")


if __name__ == "__main__":
    import uvloop
    uvloop.install()
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), len(sys.argv) > 4))
