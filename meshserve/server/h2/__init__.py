"""meshserve's own gRPC over HTTP/2 (prior knowledge, plaintext): the front door of the gateway
and every service, and the gateway's client for its services (docs/grpc.md).

- `frames`: frame builders, HPACK helpers, the HTTP/2 error codes and gRPC status enums;
- `connection`: `H2Endpoint`, the frame loop and flow control both sides share;
- `server`: `H2GrpcServer` (what grpc.aio.Server offers meshserve) and its connections;
- `client`: `Channel` / `H2ClientConnection` / `ClientStream` for long-lived calls.
"""
from meshserve.server.h2.client import (
    Channel,
    ClientStream,
    GrpcError,
    H2ClientConnection,
    connect,
    grpc_timeout,
)
from meshserve.server.h2.connection import H2Endpoint
from meshserve.server.h2.frames import ErrorCode, H2ConnectionError, Status
from meshserve.server.h2.server import (
    STREAM_MAX_QUEUED,
    H2GrpcServer,
    ServerConnection,
    ServerStream,
    ServicerContext,
)

__all__ = [
    "STREAM_MAX_QUEUED", "Channel", "ClientStream", "ErrorCode", "GrpcError", "H2ClientConnection", "H2ConnectionError",
    "H2Endpoint", "H2GrpcServer", "ServerConnection", "ServerStream", "ServicerContext", "Status", "connect",
    "grpc_timeout",
]
