"""ModelStreamInfer's own limit: at most STREAM_INFLIGHT requests of one call in progress or
awaiting their write; the next message waits unread (and HTTP/2 flow control then holds the
client), and every request is still answered."""
from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError
from meshserve.server import grpc_frontend, inflate
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


async def _at_most_in_progress(messages: list[bytes], most: int) -> None:
    """A stream of ``messages`` to a core that holds them: ``most`` start, and no more start while
    they are held; once released every request is answered, without error."""
    core = _HeldCore()
    async with inference_service(grpc_frontend.inference_methods(core)) as endpoint:  # type: ignore[arg-type]
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = channel.stream_stream(STREAM)(iter(messages))
            await eventually_async(lambda: core.inflight == most, 2.0, f"the first {most} in")
            await asyncio.sleep(0.2)  # the point: time for one more that must not start
            assert core.inflight == most and core.most == most
            core.release.set()
            answers = [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]
        assert sorted(a.infer_response.id for a in answers) == sorted(f"r{i}" for i in range(len(messages)))
        assert all(not a.error_message for a in answers) and core.most == most


async def test_a_stream_has_at_most_its_limit_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_frontend, "STREAM_INFLIGHT", 8)
    await _at_most_in_progress([pb.ModelInferRequest(model_name="m", id=f"r{i}").SerializeToString()
                                for i in range(20)], 8)


def _sized(i: int, size: int) -> bytes:
    """A request of ``size`` bytes of tensor (zeros: they compress to almost nothing)."""
    request = pb.ModelInferRequest(model_name="m", id=f"r{i}", raw_input_contents=[bytes(size)])
    request.inputs.add(name="INPUT0", datatype="UINT8", shape=[size])
    return request.SerializeToString()


async def test_a_stream_holds_at_most_its_byte_budget_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded in bytes too: messages of 1 MiB count 2 MiB each in progress (the message and its
    parse); with a budget of 4 MiB the third waits unread until earlier requests end."""
    monkeypatch.setattr(grpc_frontend, "STREAM_HELD_BYTES", 4 << 20)
    await _at_most_in_progress([_sized(i, 1 << 20) for i in range(12)], 2)


async def test_a_streamed_message_stays_charged_inflated_until_its_request_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A compressed message of a stream is its own request: its inflated bytes stay charged to the
    process's budget (inflate.INFLATING) while that request is in progress, not only until the
    handler takes the next message, and are given back when it ends. With room for one 2 MiB
    message, the second of a stream whose first is still in progress is refused."""
    core = _HeldCore()
    async with inference_service(grpc_frontend.inference_methods(core)) as endpoint:  # type: ignore[arg-type]
        monkeypatch.setattr(inflate.INFLATING, "limit", 3 << 20)
        assert inflate.INFLATING.used == 0
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = channel.stream_stream(STREAM)(iter([_sized(0, 2 << 20)]), compression=grpc.Compression.Gzip)
            await eventually_async(lambda: core.inflight == 1, 2.0, "the first in")
            await asyncio.sleep(0.1)  # (the handler asks for the next message: the end of the stream)
            assert inflate.INFLATING.used >= 2 << 20, "its inflated bytes are charged while it is in progress"
            second = channel.stream_stream(STREAM)(iter([_sized(1, 2 << 20)]), compression=grpc.Compression.Gzip)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [raw async for raw in second]
            assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            core.release.set()
            answers = [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]
        assert [a.infer_response.id for a in answers] == ["r0"] and not answers[0].error_message
        await eventually_async(lambda: inflate.INFLATING.used == 0, 2.0, "the charge given back")


class _Refusing:
    """Refuses every request from a frame that holds a marker object (as a request's bytes would be held)."""

    def __init__(self) -> None:
        self.markers: list[weakref.ref[object]] = []

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        marker = _Marker()
        self.markers.append(weakref.ref(marker))
        raise InferError.not_found(f"not yours: {request.model_name}")


class _Marker:
    pass


async def test_a_refused_streamed_request_is_freed_without_the_collector() -> None:
    """An answered error lets go of the frames it was raised through: they held the request (and
    its bytes) in a cycle with the error's traceback, freed only when the collector ran, which a
    server runs rarely (meshserve/server/process.py:GEN0_THRESHOLD): a flood of refused 24 MiB
    requests grew a gateway's RSS by 2.9 GiB, never given back."""
    core = _Refusing()
    gc.disable()
    try:
        async with inference_service(grpc_frontend.inference_methods(core)) as endpoint:  # type: ignore[arg-type]
            async with grpc.aio.insecure_channel(endpoint) as channel:
                call = channel.stream_stream(STREAM)(iter([_sized(i, 1024) for i in range(5)]))
                answers = [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]
        assert len(answers) == 5 and all("not yours" in a.error_message for a in answers)
        assert len(core.markers) == 5
        await eventually_async(lambda: all(m() is None for m in core.markers), 2.0, "every refused request freed")
    finally:
        gc.enable()


def test_a_hops_budget_follows_the_process_s_inflight_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway's hop holds at least HOP_HELD_BYTES in progress, and twice --max-inflight-bytes
    where that is raised: the service's admission (per request) bounds it then, not the stream's
    reading (which would hold up every tenant's requests on the hop behind one tenant's); a
    client's stream keeps its own bound."""
    from meshserve.server import admission

    monkeypatch.setattr(admission.gate, "max_bytes", admission.UNBOUNDED)
    assert grpc_frontend.held_budget(True) == grpc_frontend.HOP_HELD_BYTES
    monkeypatch.setattr(admission.gate, "max_bytes", 64 << 20)  # (lowered: the hop keeps its floor)
    assert grpc_frontend.held_budget(True) == grpc_frontend.HOP_HELD_BYTES
    monkeypatch.setattr(admission.gate, "max_bytes", 1 << 30)  # --max-inflight-bytes 1 GiB
    assert grpc_frontend.held_budget(True) == 2 << 30
    assert grpc_frontend.held_budget(False) == grpc_frontend.STREAM_HELD_BYTES
