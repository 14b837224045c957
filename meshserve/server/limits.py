"""The limits every front door enforces (gateway and services alike), as one record.

Each field is a command-line flag of `meshserve gateway` and `meshserve service` (see
`add_arguments`); docs/security.md lists them with their defaults and what a client sees when
it crosses one. The defaults follow the hardened HTTP/2 stacks (grpc C-core, nghttp2, Go's
net/http2) where those have one, and are sized so that one request may still carry a real
tensor (a batch of 1024x1024 RGB FP32 images is 12 MiB per image).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from meshserve.server import tls as tls_flags

MiB = 1 << 20

# Bytes one connection's reads take before the loop serves the others: past them its reading
# pauses until the next loop pass (Connection._yield_reads). libuv reads a readable socket up to
# 32 times per poll (256 KiB each under uvloop) before the next connection's callback, so a
# client sending at loopback speed held the loop ~8 MiB at a time, and other clients' requests
# waited behind it (a chunk-extension flood: a good client's p99 157-292 ms on a slow 2-core
# box, tests/adversarial/test_buffers.py::test_chunk_extension_flood). A request of a few KiB
# never reaches it; a large body pauses once per READ_BURST bytes (one loop pass each). Taken by
# both front doors: meshserve/server/http1/server.py:Connection._yield_reads and
# meshserve/server/h2/connection.py:H2Endpoint._yield_reads (the server's connections), and by
# the hop client (meshserve/server/h2/client.py:H2ClientConnection): a service streaming 1 MiB
# answers held the gateway's loop the same way, 41-95 ms at a time (a good client's p99 72-312 ms
# during tests/adversarial/test_stream_backlog.py::test_sse_client_that_never_reads; 37-53 ms after).
READ_BURST = 512 << 10


@dataclass(frozen=True, slots=True)
class ServerLimits:
    # ---- one request -----------------------------------------------------------------
    # Largest gRPC message and largest HTTP body (after decompression) a client may send.
    max_request_bytes: int = 64 * MiB
    # ---- admission (the whole process) -------------------------------------------------
    # Inference requests admitted and not yet answered; beyond it: 429 + Retry-After /
    # RESOURCE_EXHAUSTED, at once. 0 = unbounded. Measured (docs/security.md, Bounded admission): add_sub
    # through gateway + service on the 2-core box at ~3x overload, a 100/s client's admitted
    # requests had p50 13 ms / p99 208 ms with 512, p50 3.4 ms / p99 27 ms with 128 (unloaded
    # p50 2.5 ms); 128 still leaves room for batching models that need many requests in flight.
    max_inflight: int = 128
    # Bytes of admitted, unanswered inference requests (their serialized size): four requests
    # of the largest size (max_request_bytes), so a flood of big tensors cannot hold GiBs.
    max_inflight_bytes: int = 256 * MiB
    # ---- HTTP/2 (gRPC) -----------------------------------------------------------------
    max_concurrent_streams: int = 1024  # SETTINGS_MAX_CONCURRENT_STREAMS; excess: REFUSED_STREAM
    # Rapid reset (CVE-2023-44487): client RST_STREAMs (and refused streams) as a token bucket;
    # an empty bucket ends the connection with GOAWAY(ENHANCE_YOUR_CALM). nghttp2's numbers.
    stream_reset_burst: int = 1000
    stream_reset_rate: float = 33.0  # per second
    # Received bytes a connection may hold that no handler has taken yet (window budget).
    conn_receive_buffer_bytes: int = 64 * MiB
    # Response bytes a connection may hold that the peer's flow-control window or the socket
    # has not taken yet; beyond it the connection is closed.
    conn_send_buffer_bytes: int = 64 * MiB
    # Control frames (PING/SETTINGS ACKs) queued while the peer does not read; beyond: GOAWAY.
    max_pending_control_frames: int = 1000
    # ---- timeouts (both protocols) -----------------------------------------------------
    header_timeout_s: float = 10.0  # a request's headers must arrive within this after it starts
    read_timeout_s: float = 60.0  # a started body/message must keep arriving: max silence
    idle_timeout_s: float = 300.0  # a connection with nothing in flight is closed after this
    keepalive_interval_s: float = 60.0  # HTTP/2: PING a silent connection this often ...
    keepalive_timeout_s: float = 20.0  # ... and close it if the ACK takes longer than this
    # A request body must arrive whole within this many seconds of its headers (a body sent a
    # byte at a time never falls silent long enough for read_timeout_s): 64 MiB at ~0.5 MiB/s.
    body_timeout_s: float = 120.0
    # ---- memory and descriptors, process-wide (docs/security.md, "Every buffer bounded") -------
    # Bytes of HTTP request bodies received and not yet answered, all connections together
    # (counted as they arrive, before decoding and admission); beyond it: 429 + Retry-After.
    max_receive_bytes: int = 256 * MiB
    # Bytes of one streamed request's answers waiting for a client that reads slower than the
    # model answers (a gateway's upstream stream, a ModelStreamInfer call's writer); beyond it
    # the model's answers wait (back-pressure) or, at a gateway, the request ends RESOURCE_EXHAUSTED.
    max_stream_backlog_bytes: int = 8 * MiB
    # Client connections (HTTP and gRPC together); 0: the soft NOFILE (raised to the hard limit
    # at start) minus a reserve (meshserve/server/connections.py:derived_cap).
    max_connections: int = 0
    # ---- shared memory (the system / CUDA shared-memory extensions; docs/shared-memory.md) ----
    # Regions registered at once in this process, all tenants together; 0 turns registration off.
    max_shm_regions: int = 256
    # Bytes of client shared memory registered at once (the sum of the regions' sizes).
    max_shm_bytes: int = 4096 * MiB
    # ---- TLS (meshserve/server/tls.py; docs/security.md, "TLS and mutual TLS") --------------------
    # A TLS handshake must end within this many seconds of the connection's arrival.
    tls_handshake_timeout_s: float = 10.0
    # TLS handshakes in progress per port; one more closes the oldest silent one (no byte yet),
    # else the oldest in progress (0 = unbounded).
    max_tls_handshakes: int = 256
    # Which ports serve TLS, and with which files: the --grpc-use-ssl / --http-use-ssl flags.
    tls: tls_flags.TlsSettings = field(default_factory=tls_flags.TlsSettings)



@dataclass(slots=True)
class Listening:
    """How this process's listening sockets bind (one object, LISTEN, read at bind time)."""

    # a gateway worker (meshserve/server/workers.py) joins its supervisor's ports: SO_REUSEPORT,
    # the kernel spreads the connections over the workers
    reuse_port: bool = False


LISTEN = Listening()


@dataclass(slots=True)
class StreamBuffers:
    """How many bytes of one streamed request's answers may wait for its client (one object,
    STREAMS, set by process.serve from ServerLimits.max_stream_backlog_bytes; read by the
    gateway's upstream streams and the gRPC front end's ModelStreamInfer writer)."""

    backlog_bytes: int = 8 * MiB


STREAMS = StreamBuffers()


_HELP = {
    "max_request_bytes": "largest gRPC message / HTTP body (decompressed) a client may send",
    "max_inflight": "inference requests in progress at once in this process; more get 429 / "
                    "RESOURCE_EXHAUSTED (0 = unbounded)",
    "max_inflight_bytes": "bytes of inference requests in progress at once (0 = unbounded)",
    "max_concurrent_streams": "HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; excess streams are refused",
    "stream_reset_burst": "HTTP/2 rapid-reset guard: resets a connection may make in a burst",
    "stream_reset_rate": "HTTP/2 rapid-reset guard: resets per second refilled",
    "conn_receive_buffer_bytes": "HTTP/2: received bytes one connection may hold unread by handlers",
    "conn_send_buffer_bytes": "HTTP/2: response bytes one connection may hold unsent; more closes it",
    "max_pending_control_frames": "HTTP/2: queued PING/SETTINGS replies before GOAWAY",
    "header_timeout_s": "seconds for a request's headers to arrive",
    "read_timeout_s": "seconds a started request body may stay silent",
    "idle_timeout_s": "seconds an idle connection is kept",
    "keepalive_interval_s": "HTTP/2: seconds of silence before the server PINGs",
    "keepalive_timeout_s": "HTTP/2: seconds to wait for the PING's ACK",
    "body_timeout_s": "seconds for a whole request body to arrive after its headers",
    "max_receive_bytes": "bytes of HTTP request bodies received and not yet answered, all connections "
                         "together, decoded bytes of compressed ones too; more get 429 (0 = unbounded); "
                         "also the bound on inflated gRPC messages held (RESOURCE_EXHAUSTED)",
    "max_stream_backlog_bytes": "bytes of one streamed request's answers waiting for a slow client",
    "max_connections": "client connections at once (HTTP and gRPC); 0 = the soft NOFILE minus a reserve",
    "max_shm_regions": "shared-memory regions registered at once (all tenants); 0 = registration off",
    "max_shm_bytes": "bytes of shared-memory regions registered at once (all tenants)",
    "tls_handshake_timeout_s": "seconds for a TLS handshake to end (0 = no limit)",
    "max_tls_handshakes": "TLS handshakes in progress per port; more close the oldest silent one, else the oldest "
                          "(0 = unbounded)",
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(ap: argparse.ArgumentParser, *, with_tls: bool = True) -> None:
    """One flag per ServerLimits field (e.g. --max-request-bytes), defaults from the record; the
    TLS flags too unless ``with_tls`` is false (`meshserve up` defines them itself)."""
    group = ap.add_argument_group("limits (docs/security.md)")
    for f in fields(ServerLimits):
        if f.name == "tls":
            if with_tls:
                tls_flags.add_arguments(ap)
            continue
        default = f.default
        group.add_argument(flag(f.name), dest=f"limit_{f.name}", type=type(default), default=default,
                           metavar="N", help=f"{_HELP[f.name]} (default {default})")


def from_args(args: argparse.Namespace) -> ServerLimits:
    values = {f.name: getattr(args, f"limit_{f.name}") for f in fields(ServerLimits) if f.name != "tls"}
    for name, value in values.items():
        if value < 0:
            raise SystemExit(f"{flag(name)}: must be >= 0, got {value}")
    return ServerLimits(**values, tls=tls_flags.from_args(args))


def passed_on(args: argparse.Namespace) -> list[str]:
    """The limit flags of ``args`` (add_arguments's, TLS aside) whose value is not the default, as
    a command line: `meshserve up` gives them to its gateway."""
    out: list[str] = []
    for f in fields(ServerLimits):
        if f.name != "tls" and getattr(args, f"limit_{f.name}") != f.default:
            out += [flag(f.name), str(getattr(args, f"limit_{f.name}"))]
    return out
