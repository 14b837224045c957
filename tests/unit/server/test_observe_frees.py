"""A request that fails in ``observe`` is freed when its error is dropped, without the garbage
collector: its frame held the error in a local, and the error's traceback holds the frame (a
cycle only the collector frees, and a server runs it rarely: meshserve/server/process.py). A
flood of refused large requests kept every one of them alive that way (docs/security.md,
"Session 11: stream bytes")."""
from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server import observe
from meshserve.server.core import RequestContext


class _Refusing:
    """A core that refuses every request."""

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> None:
        raise InferError(Code.INVALID_ARG, "no")

    async def infer_stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncIterator[object]:
        raise InferError(Code.INVALID_ARG, "no")
        yield  # (an async generator)


async def _streamed(core: _Refusing) -> None:
    async for _ in observe.infer_stream(core, pb.ModelInferRequest(model_name="m"), RequestContext("grpc", {})):  # type: ignore[arg-type]
        pass


class _Late:
    """What ``_infer_late`` asks of a LateSpans."""

    def trace_id(self) -> str:
        return ""

    def finish(self, error: InferError | None) -> None:
        pass


async def _late(core: _Refusing) -> None:
    await observe._infer_late(core, pb.ModelInferRequest(model_name="m"), RequestContext("grpc", {}), _Late())  # type: ignore[arg-type]


@pytest.mark.parametrize("path", [_streamed, _late])
async def test_a_refused_request_is_freed_without_the_collector(path) -> None:  # type: ignore[no-untyped-def]
    gc.collect()
    gc.disable()
    try:
        core = _Refusing()
        marker = weakref.ref(core)  # (the failing frame holds its core as it holds its request)
        with pytest.raises(InferError):
            await path(core)
        del core
        assert marker() is None, "the failed request's frame is still alive (a cycle through its error)"
    finally:
        gc.enable()
