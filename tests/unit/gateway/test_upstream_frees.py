"""A request that fails on the gateway's upstream path (a replica's error, a retry on another
replica, a streamed request's in-band error) leaves no frame in a reference cycle: its error's
traceback holds the frames it was raised through, so no frame may hold that error, in a local
or through the future that failed with it, or the request's bytes stay alive until the next
collection (tests/support/cycles.py; docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from gateway.routing.table import pick_pinned
from gateway.upstream import traced
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop, wire
from meshserve.protocol.errors import Code, InferError
from meshserve.telemetry import tracing
from tests.support.cycles import collector_off, cyclic_frames
from tests.support.net import refused_address
from tests.unit.gateway.support import stream_service
from tests.unit.gateway.test_upstream import _upstream, unavailable

__all__ = ["unavailable"]  # (the fixture)


async def _failed(upstream: Upstream, endpoint: str) -> tuple[Code, str]:
    """Send a request pinned to ``endpoint`` first: its error's code and message (the error itself
    is not kept: pytest.raises' ExceptionInfo in a frame would be a cycle of the test's own)."""
    key = next(k for n in range(1000) if pick_pinned(upstream.replicas, k := f"i:{n}").endpoint == endpoint)
    try:
        await upstream.send(pb.ModelInferRequest(model_name="m", id="r1"), None, 5, key)
    except InferError as exc:
        return exc.code, exc.message
    raise AssertionError("not refused")


async def test_a_refused_request_and_its_retry_leave_no_cycle(unavailable: str) -> None:
    refused = refused_address()
    async with _upstream(refused, unavailable) as upstream:
        await _failed(upstream, refused)  # (connects, and fails to: asyncio.wait_for's own cycle, not a request's)
        with collector_off():
            for _ in range(3):  # NotSent there, then the in-band error of the other replica
                assert await _failed(upstream, refused) == (Code.UNAVAILABLE, "model 'm' is not ready")
            for _ in range(3):
                assert await _failed(upstream, unavailable) == (Code.UNAVAILABLE, "model 'm' is not ready")
            assert cyclic_frames() == []


@pytest.fixture
async def fails_midway() -> AsyncIterator[str]:
    """A service whose ModelStreamInfer answers a streamed request: one response, then an error."""

    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:
            rid = pb.ModelInferRequest.FromString(raw).id
            first = pb.ModelInferResponse(id=rid)
            first.parameters[wire.FINAL_RESPONSE_PARAMETER].bool_param = False
            yield pb.ModelStreamInferResponse(infer_response=first).SerializeToString()
            failed = pb.ModelInferResponse(id=rid)
            failed.parameters[hop.ERROR_CODE].string_param = Code.INVALID_ARG.value
            yield pb.ModelStreamInferResponse(error_message="no", infer_response=failed).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        yield endpoint


async def test_a_streamed_request_failing_midway_leaves_no_cycle(fails_midway: str) -> None:
    async with _upstream(fails_midway) as upstream:
        async def one() -> str:
            answers = upstream.stream(pb.ModelInferRequest(model_name="m", id="s"), None, 5)
            try:
                async for _ in answers:
                    pass
            except InferError as exc:
                return exc.message  # (as _failed: the error itself is not kept)
            raise AssertionError("not failed")

        await one()  # (connects)
        with collector_off():
            for _ in range(3):
                assert await one() == "no"
            assert cyclic_frames() == []


async def test_a_traced_request_that_fails_leaves_no_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced variant keeps the error for its span (gateway/upstream/traced.py:_forward_under)."""
    monkeypatch.setattr(tracing, "defer", lambda job, *args: None)  # (its span is not what is tested)

    async def refused(body: bytes, client_id: str, timeout: float | None, affinity: str | None) -> None:
        raise InferError(Code.UNAVAILABLE, "model 'm' is not ready")

    replica = SimpleNamespace(streams=SimpleNamespace(infer=refused), endpoint="127.0.0.1:1")

    async def one() -> str:
        try:
            await traced._forward_under([], 0, pb.ModelInferRequest(model_name="m"), replica,  # type: ignore[arg-type]
                                        b"body", None, None)
        except InferError as exc:
            return exc.message
        raise AssertionError("not failed")

    with collector_off():
        for _ in range(3):
            assert await one() == "model 'm' is not ready"
        assert cyclic_frames() == []
