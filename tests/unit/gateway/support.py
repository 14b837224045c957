"""Helpers of the gateway's unit tests."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from meshserve.server import h2
from tests.support.h2 import inference_service

StreamInfer = Callable[[AsyncIterator[bytes], object], AsyncIterator[bytes]]


@asynccontextmanager
async def stream_service(stream_infer: StreamInfer) -> AsyncIterator[str]:
    """An H2GrpcServer on 127.0.0.1 port 0 whose ModelStreamInfer is ``stream_infer``; its endpoint."""
    async with inference_service({"ModelStreamInfer": h2.stream_stream(stream_infer)}) as endpoint:
        yield endpoint
