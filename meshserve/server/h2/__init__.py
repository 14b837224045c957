"""meshserve's own gRPC over HTTP/2 (prior knowledge; TLS by meshserve/server/tls.py): the front door of the gateway
and every service, and the gateway's client for its services (docs/grpc.md).

- `frames`: frame builders, HPACK helpers, the HTTP/2 error codes and gRPC status enums;
- `connection`: `H2Endpoint`, the frame loop and flow control both sides share;
- `call`: the `Call` protocol a handler sees and the `Method` a server registers;
- `server`: `H2GrpcServer`, its connections and `ServerCall` (a `Call`);
- `client`: `Channel` / `H2ClientConnection` / `ClientStream` for long-lived calls.
"""
from meshserve.server.h2.call import (
    Abort,
    Call,
    Method,
    stream_stream,
    stream_unary,
    unary_stream,
    unary_unary,
)
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
    Inbox,
    ServerCall,
    ServerConnection,
    ServerStream,
)

__all__ = [
    "STREAM_MAX_QUEUED", "Abort", "Call", "Channel", "Method", "ServerCall", "stream_stream", "stream_unary",
    "unary_stream", "unary_unary", "ClientStream", "ErrorCode", "GrpcError", "H2ClientConnection", "H2ConnectionError",
    "H2Endpoint", "H2GrpcServer", "Inbox", "ServerConnection", "ServerStream", "Status", "connect",
    "grpc_timeout",
]
