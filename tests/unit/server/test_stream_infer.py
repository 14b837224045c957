"""ModelStreamInfer's own limit: at most STREAM_INFLIGHT requests of one call in progress or
awaiting their write; the next message waits unread (and HTTP/2 flow control then holds the
client), and every request is still answered."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import grpc_frontend
from meshserve.server.core import InferResult, RequestContext
from tests.support import eventually_async
from tests.support.h2 import inference_service

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


class _HeldCore:
    """Answers nothing until released; counts the requests in progress."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.inflight = 0
        self.most = 0

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            await self.release.wait()
        finally:
            self.inflight -= 1
        return InferResult(message=pb.ModelInferResponse(id=request.id, model_name=request.model_name))


async def test_a_stream_has_at_most_its_limit_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_frontend, "STREAM_INFLIGHT", 8)
    core = _HeldCore()
    async with inference_service(grpc_frontend.inference_methods(core)) as endpoint:  # type: ignore[arg-type]
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = channel.stream_stream(STREAM)(
                iter([pb.ModelInferRequest(model_name="m", id=f"r{i}").SerializeToString() for i in range(20)]))
            await eventually_async(lambda: core.inflight == 8, 2.0, "the first eight in")
            await asyncio.sleep(0.2)  # the point: time for a ninth that must not start
            assert core.inflight == 8 and core.most == 8
            core.release.set()
            answers = [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]
        assert sorted(a.infer_response.id for a in answers) == sorted(f"r{i}" for i in range(20))
        assert all(not a.error_message for a in answers) and core.most == 8
