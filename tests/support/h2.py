"""An in-process gRPC server for unit tests: meshserve's own HTTP/2 server on 127.0.0.1 port 0."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from meshserve.server.h2 import H2GrpcServer, Method

SERVICE = "inference.GRPCInferenceService"


@asynccontextmanager
async def inference_service(methods: dict[str, Method]) -> AsyncIterator[str]:
    """An H2GrpcServer whose GRPCInferenceService has ``methods`` (name -> handler), started on
    127.0.0.1 port 0; yields its endpoint ``127.0.0.1:PORT`` and stops the server after."""
    server = H2GrpcServer()
    server.add_methods(SERVICE, methods)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
