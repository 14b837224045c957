"""Helpers of the gateway's unit tests."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc

from meshserve.server.h2 import H2GrpcServer

StreamInfer = Callable[[AsyncIterator[bytes], object], AsyncIterator[bytes]]


@asynccontextmanager
async def stream_service(stream_infer: StreamInfer) -> AsyncIterator[str]:
    """An H2GrpcServer on 127.0.0.1 port 0 whose ModelStreamInfer is ``stream_infer``; its endpoint."""
    server = H2GrpcServer()
    server.add_registered_method_handlers(
        "inference.GRPCInferenceService", {"ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream_infer)})
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
