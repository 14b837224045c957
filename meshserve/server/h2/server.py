"""A compact gRPC server over HTTP/2 on asyncio: the front door of the gateway and services.

Why not grpc.aio: on this project's 2-core target a grpc.aio unary call costs 200-370 µs of
server CPU (call objects, a poller thread handing every completion to the loop across the
GIL), more than all of Triton spends on an inference. A frame loop written for unary and
streaming gRPC on an asyncio Protocol costs 60-90 µs per call for the same work (docs/grpc.md,
"Why"; load/h2cpu.py measures it). It is the only gRPC server meshserve runs; the gateway's
calls to its services use this package's client (client.py).

Scope (what gRPC clients need, RFC 9113 + the gRPC HTTP/2 mapping):
- prior-knowledge HTTP/2 (no h2c upgrade; TLS, when on, is meshserve/server/tls.py's), SETTINGS/PING/GOAWAY/RST_STREAM,
  HEADERS + CONTINUATION, padding, flow control in both directions (large messages are
  split by the peer's MAX_FRAME_SIZE and windows; sends wait for WINDOW_UPDATE);
- HPACK decoding with the `hpack` package (dynamic table, Huffman); responses are encoded as
  literals without indexing, so there is no encoder state to keep in step with the peer;
- gRPC: length-prefixed messages, `grpc-timeout` (deadline enforced: DEADLINE_EXCEEDED and the
  handler cancelled), `grpc-encoding` gzip/deflate on requests (responses go uncompressed),
  `-bin` metadata, trailers-only errors, percent-encoded `grpc-message`;
- handlers are meshserve's own (meshserve/server/h2/call.py): a `Method` per path (all four
  call shapes, async functions / async generators) called with a `ServerCall`, the `Call`
  protocol: metadata, deadline, status, trailing metadata, peer and its TLS certificate,
  cancellation.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import functools
import inspect
import logging
import ssl
import struct
import time
import types
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NoReturn

from meshserve.protocol.errors import internal_error
from meshserve.server import connections, inflate, tls
from meshserve.server.body_worker import release_memory, release_memory_soon
from meshserve.server.deadlines import DeadlineTimer
from meshserve.server.h2 import requests
from meshserve.server.h2.call import Abort, Method
from meshserve.server.h2.connection import H2Endpoint
from meshserve.server.h2.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    FRAME_HEADER,
    GOAWAY,
    HEADERS,
    LOCAL_MAX_FRAME,
    LOCAL_STREAM_WINDOW,
    MAX_HEADER_LIST,
    MESSAGE_PREFIX,
    PADDED,
    PING,
    PRIORITY_FLAG,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    TRAILERS_OK,
    U32,
    WINDOW_UPDATE,
    ErrorCode,
    H2ConnectionError,
    Status,
    frame,
    literal,
    md_value,
    parse_timeout,
    percent_encode,
)
from meshserve.server.limits import LISTEN, READ_BURST, ServerLimits

log = logging.getLogger("meshserve.grpc.h2")

STREAM_BACKLOG = LOCAL_STREAM_WINDOW // 2  # request streaming: messages a handler may leave unread
# ... and at most this many of them (a flood of empty messages is bytes-cheap, each one not)
STREAM_MAX_QUEUED = 4096
# ... and at most this many bytes of them as the handler will hold them: a compressed message is
# charged its inflated size (a gzip bomb is small on the wire), and past this the rest waits raw.
# Uncompressed messages never reach it (the window stops the client at STREAM_BACKLOG + a window).
STREAM_MAX_HELD = STREAM_BACKLOG + LOCAL_STREAM_WINDOW
# response streaming: queued DATA items (2 per message) beyond which a handler waits for the peer's window;
# once the peer's window has stopped the stream, more than one message queued (2 items) is enough
# (a peer that never gives window back holds one waiting message of the handler's, whatever its size)
STREAM_SEND_QUEUE = 64
STREAM_WINDOW_UPDATE = LOCAL_STREAM_WINDOW // 2
# A unary answer's frames, built by one struct call each: HEADERS (RESPONSE_HEADERS), the DATA
# frame's header and the message's prefix; the trailers HEADERS of an OK status.
_REPLY_HEAD = struct.Struct(f">BHBBI{len(RESPONSE_HEADERS)}sBHBBIBI")
_TRAILERS_OK_FRAME = struct.Struct(f">BHBBI{len(TRAILERS_OK)}s")
_MESSAGE_HEAD = struct.Struct(">BHBBIBI")  # a DATA frame's header and the message's prefix
_HEAD_LEN, _TRAILERS_LEN = len(RESPONSE_HEADERS), len(TRAILERS_OK)
# ... and a small one whole (_reply's usual case): its three frames and the message from one struct
# call with the stream id thrice and the bytes that depend only on the message's size made once per
# size (one buffer made instead of three, no concatenation). Bounded: all dropped when full.
_REPLY_FRAMES: dict[int, tuple[struct.Struct, bytes, bytes]] = {}
_REPLY_FRAMES_KEPT = 256
_HEADERS_FRAME_HEAD = struct.pack(">BHBB", 0, _HEAD_LEN, HEADERS, END_HEADERS)  # (the stream id follows)
_TRAILERS_FRAME_HEAD = struct.pack(">BHBB", 0, _TRAILERS_LEN, HEADERS, END_STREAM | END_HEADERS)
SMALL_REPLY = 1 << 14  # a unary answer up to this size is joined into one buffer (one write, no writev)  # stream window credit is sent in steps this big
# The connection receive budget is full when less than this is left of it (a frame or so): the
# newest partly received message is then failed so that the others can complete.
RECEIVE_SLACK = 1 << 16
MAX_WINDOW = 2**31 - 1  # the largest HTTP/2 flow-control window
MAX_MESSAGE = 2**31 - 1  # gRPC's own ceiling (a 32-bit length prefix, as grpc's int limit)

_STATUS_NAMES = {c.value: c.name for c in Status}


RETRY_PUSHBACK = "grpc-retry-pushback-ms"  # (meshserve/protocol/wire.py: HTTP's Retry-After, as gRPC's pushback)


def _reply_frames(n: int) -> tuple[struct.Struct, bytes, bytes]:
    """(the struct, the response headers and the DATA frame's head before its stream id, the
    message's prefix) of a unary OK answer whose DATA frame carries ``n`` bytes (``_REPLY_FRAMES``)."""
    if len(_REPLY_FRAMES) >= _REPLY_FRAMES_KEPT:
        _REPLY_FRAMES.clear()
    data_head = RESPONSE_HEADERS + struct.pack(">BHBB", n >> 16, n & 0xFFFF, DATA, 0)
    found = _REPLY_FRAMES[n] = (struct.Struct(f">5sI{len(data_head)}sI5s{n - 5}s5sI{_TRAILERS_LEN}s"), data_head,
                                MESSAGE_PREFIX.pack(0, n - 5))
    return found


@functools.lru_cache(maxsize=1024)  # rejections repeat the same few messages
def _status_block(code: int, details: str | None) -> bytes:
    block = TRAILERS_OK if code == 0 else literal(b"grpc-status", str(code).encode())
    if code and not details:  # an error always says something: a client shows only this text
        details = f"{_STATUS_NAMES.get(code, f'gRPC status {code}')} (the server gave no details)"
    if details:
        block += literal(b"grpc-message", percent_encode(details[:4096]))
    return block


def _trailers_block(code: int, details: str | None, metadata: Iterable[tuple[str, Any]] = ()) -> bytes:
    block = _status_block(code, details)
    for k, v in metadata:
        block += literal(k.lower().encode(), md_value(k, v))
    return block


def _parse_request_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[Any, ...]:
    """(path, method, content-type, timeout s, grpc-encoding, metadata) of a request."""
    path = method = ctype = timeout = encoding = None
    metadata: list[tuple[str, Any]] = []
    for k, v in headers:
        if k[:1] == b":":
            if k == b":path":
                path = v
            elif k == b":method":
                method = v
        elif k == b"content-type":
            ctype = v
        elif k == b"grpc-timeout":
            timeout = parse_timeout(v)
        elif k == b"grpc-encoding":
            encoding = v
        elif k == b"te" or k == b"grpc-accept-encoding" or k == b"content-length":
            continue
        elif k.endswith(b"-bin"):
            try:
                metadata.append((k.decode(), base64.b64decode(v + b"=" * (-len(v) % 4))))
            except ValueError:
                continue
        else:
            metadata.append((k.decode("latin-1"), v.decode("latin-1")))
    return (path.decode("latin-1") if path else "", method, ctype, timeout, encoding, tuple(metadata))



_EOF = object()
_COROUTINE = types.CoroutineType
# A stream's receive buffer and send queue before it needs them: most unary calls need neither (the
# message arrives in one DATA frame; the answer goes out at once), and making both cost ~1,900
# instructions per call. Empty and immutable: ServerStream.hold / queue_out make the real ones.
_NO_BUF: Any = b""
_NO_OUT: Any = ()
# A call's Task, made as asyncio.Task(coro, loop=, name=): CPython 3.11 formats "Task-N" for every
# Task made without a name (~1,800 instructions), and uvloop's loop.create_task makes it without one
# and renames it after (name= there costs ~900 more, not less). Nothing reads the names.
_Task = asyncio.Task
TASK_NAME = "call"


class Compressed:
    """A request-streaming call's compressed message, queued as it arrived: inflated when its
    handler takes it (``ServerConnection._requests``, meshserve/server/inflate.py), so unread
    messages hold only their wire bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)


class Inbox:
    """A queue with one reader: asyncio.Queue's put_nowait / get / qsize without its putters,
    maxsize and getters' queue (per item that machinery was ~3% of a gateway's request's
    interpreted work in a service). A request-streaming call's received messages (and _EOF) for
    the handler's ``_requests``; a ModelStreamInfer call's answers for its writer
    (grpc_frontend.py)."""

    __slots__ = ("items", "waiter", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.items: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.loop = loop

    def qsize(self) -> int:
        return len(self.items)

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> Any:
        items = self.items
        while not items:
            self.waiter = waiter = self.loop.create_future()
            try:
                await waiter
            finally:
                self.waiter = None
        return items.popleft()


class ServerStream:
    __slots__ = ("sid", "path", "metadata", "deadline", "encoding", "buf", "queue", "task", "send_window",
                 "out", "remote_ended", "closed", "recv_unacked", "handler", "headers_sent", "due",
                 "header_block", "header_flags", "cancelled", "queued", "owed", "parked", "waiter", "held", "taken",
                 "partial_len", "partial_since", "inflated")

    def __init__(self, sid: int, send_window: int):
        self.sid = sid
        self.send_window = send_window
        self.path = ""
        self.metadata: tuple[tuple[str, Any], ...] = ()
        self.deadline: float | None = None
        self.encoding: bytes | None = None
        self.buf: Any = _NO_BUF  # (a bytearray from the first partial bytes on: hold)
        self.queue: Inbox | None = None
        self.task: asyncio.Task[None] | None = None
        self.out: collections.deque[tuple[int, Any]] = _NO_OUT  # (a deque from the first item on: queue_out)
        self.remote_ended = False
        self.closed = False
        self.recv_unacked = 0
        self.queued = 0  # request streaming: wire bytes of messages queued, not yet taken by the handler
        self.owed = 0  # request streaming: bytes received and not yet given back to the window
        self.parked = False  # request streaming: STREAM_MAX_QUEUED queued; what follows waits in buf
        self.handler: Method | None = None
        self.headers_sent = False
        self.due: float | None = None  # the deadline in loop time (H2Endpoint._on_deadlines)
        self.header_block: bytearray | None = None
        self.header_flags = 0
        self.cancelled = False  # ended by RST_STREAM, a lost connection or the deadline
        self.waiter: asyncio.Future[None] | None = None  # a handler waiting for room in `out`
        self.held = 0  # received message bytes not yet given back to the connection window
        self.taken = 0  # request streaming: bytes of messages the handler took, not yet released
        self.partial_len = 0  # a partly received message as the connection's timer last saw it ...
        self.partial_since = 0.0  # ... and since when (--body-timeout-s; ServerConnection._slow_messages)
        self.inflated: inflate.Inflation | None = None  # request streaming: the message just taken, inflated

    def queue_out(self) -> collections.deque[tuple[int, Any]]:
        """The stream's send queue, made when the first item waits in it."""
        out = self.out
        if out.__class__ is not collections.deque:
            self.out = out = collections.deque()
        return out

    def hold(self, data: memoryview) -> None:
        """Keep bytes of a partly received message (the buffer made when the first are kept)."""
        if self.buf:
            self.buf += data
        else:
            self.buf = bytearray(data)


class ServerCall:
    """`Call` (meshserve/server/h2/call.py) on this server: one per call, handed to its handler."""

    __slots__ = ("_conn", "_st", "_code", "_details", "_trailing", "_callbacks", "deadline")

    def __init__(self, conn: ServerConnection, st: ServerStream):
        self._conn = conn
        self._st = st
        # (the stream's, set at its headers before any call is made: an attribute, not a property,
        # read by every handler's context: grpc_frontend._context)
        self.deadline = st.deadline
        self._code = 0
        self._details = ""
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self._callbacks: list[Callable[[Any], None]] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._st.metadata

    def time_remaining(self) -> float | None:
        d = self.deadline
        return None if d is None else max(0.0, d - time.monotonic())

    def set_status(self, code: Status | int, details: str = "") -> None:
        self._code, self._details = int(code), details

    def status(self) -> tuple[int, str]:
        return self._code, self._details

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        if self._st.headers_sent:
            raise RuntimeError("initial metadata already sent")
        self._conn._send_headers(self._st, tuple(metadata))

    async def abort(self, code: Status | int, details: str = "",
                    trailing_metadata: Iterable[tuple[str, Any]] = ()) -> NoReturn:
        if not code:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = int(code), details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise Abort(f"aborted with gRPC status {int(code)}")

    async def write(self, message: Any) -> None:
        handler = self._st.handler
        ser = handler.response_serializer if handler is not None else None
        self._conn._send_message(self._st, ser(message) if ser else message)

    def peer(self) -> str:
        peer = self._conn.peername
        if not isinstance(peer, tuple):
            return str(peer)
        return f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}"

    def _ssl(self) -> ssl.SSLObject | None:
        transport = self._conn.transport
        return transport.get_extra_info("ssl_object") if transport is not None else None

    def secure(self) -> bool:
        return self._ssl() is not None

    def peer_certificate(self) -> dict[str, Any] | None:
        # getpeercert() is empty unless the context asked for and verified a client certificate
        # (tls.context: CERT_REQUIRED against the root CA only under --grpc-use-ssl-mutual)
        obj = self._ssl()
        cert = obj.getpeercert() if obj is not None else None
        return cert or None  # type: ignore[return-value]

    def peer_certificate_der(self) -> bytes | None:
        obj = self._ssl()
        return obj.getpeercert(binary_form=True) if obj is not None and obj.getpeercert() else None

    def keep_inflated(self) -> Callable[[], None] | None:
        st = self._st
        inflation = st.inflated
        if inflation is None:
            return None
        st.inflated = None
        return inflation.release

    def cancelled(self) -> bool:
        return self._st.cancelled

    def done(self) -> bool:
        return self._st.closed

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)


KEEPALIVE_PING = b"meshkeep"
WRITE_HIGH_WATER = 1 << 20  # socket write buffer bytes beyond which the transport pauses us


class ServerConnection(H2Endpoint):
    """The server side of one client connection, with the limits of ServerLimits (docs/grpc.md
    "Limits"): concurrent streams, a rapid-reset budget, a receive budget (the connection window
    comes back only as handlers take what arrived), a send budget, a cap on control-frame
    replies the peer does not read, and header / idle / keepalive timeouts on one timer."""

    expect_preface = True
    two_frames = True  # (_at_once)
    read_burst = READ_BURST  # (H2Endpoint._yield_reads: a client's reads yield the loop past it)
    header_list_max = MAX_HEADER_LIST  # (advertised in _settings; over it the block is a COMPRESSION_ERROR)

    def __init__(self, server: H2GrpcServer):
        self.conn_window = server.conn_window  # before H2Endpoint sizes the receive window by it
        super().__init__()
        self.server = server
        limits = server.limits
        self.max_streams = limits.max_concurrent_streams
        self.reset_burst = limits.stream_reset_burst
        self.reset_rate = limits.stream_reset_rate
        self.reset_tokens = float(self.reset_burst)
        self.pass_taken = 0  # streamed messages its handlers took without waiting in this pass (requests.taken)
        self.reset_at = 0.0
        self.send_budget = limits.conn_send_buffer_bytes
        # answer bytes put in the write buffer since its last flush (_reply, _send_message): the
        # budget holds within one read or loop pass too, before the socket can back up (at-once
        # hits make one answer per request of a read; Tasks up to a stream cap's worth per pass)
        self.unflushed = 0
        self.unflushed_cap = self.send_budget or MAX_MESSAGE << 8
        self.max_control = limits.max_pending_control_frames
        self.control_backlog = 0
        self.control_unflushed = 0  # PING/SETTINGS ACKs queued since the last write (_control_reply)
        self.held = 0  # bytes of request messages received and not yet taken by handlers
        self.held_limit = self.conn_window - RECEIVE_SLACK  # beyond it: _receive_budget_full
        self.timer: asyncio.TimerHandle | None = None
        self.deadlines = DeadlineTimer(self.loop, self._on_deadlines)  # the calls' grpc-timeout
        self.started_at = 0.0
        self.idle_since: float | None = None
        self.idle_sid = -1
        self.silent_since = 0.0
        self.ping_sent: float | None = None
        self.partial: tuple[bytes, float] | None = None  # an incomplete frame seen by the timer
        self.counted = True  # in connections.TABLE (connection_made)
        # counted for its tenant, or nothing to count (no tenants): no more asking (connections.TABLE.claim)
        self.named = inflate.tenant_of is None
        self.at_once = server.at_once  # (the dict itself: hooks installed later are seen)
        self.marked = False  # made the newest idle connection in this read (_at_once; _flush clears it)

    def _settings(self) -> tuple[tuple[int, int], ...]:
        settings = super()._settings() + ((SETTINGS_MAX_HEADER_LIST_SIZE, self.header_list_max),)
        if self.max_streams:
            settings += ((SETTINGS_MAX_CONCURRENT_STREAMS, self.max_streams),)
        return settings

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self.peername = transport.get_extra_info("peername")
        if not connections.TABLE.opened(self):  # at --max-connections, nothing idle to close: refused at once
            self.counted = False
            transport.close()
            return
        self.server._conns.add(self)
        # Backpressure starts once this much waits in the socket's buffer (asyncio's default of
        # 64 KiB paused busy streaming connections every few hundred messages: measured -12%).
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        transport.write(self._preamble())  # type: ignore[attr-defined]
        self.started_at = self.silent_since = self.reset_at = self.loop.time()
        if self.server.tick:
            self.timer = self.loop.call_later(self.server.tick, self._on_tick)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.counted:
            self.counted = False
            connections.TABLE.closed(self)
        if self.paused or self.blocked:  # a peer that stopped reading: what it held goes back to the OS
            release_memory_soon(self.loop)
        self.server._conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.deadlines.cancel()
        for st in list(self.streams.values()):
            self._abandon(st)
        self.streams.clear()
        self.blocked.clear()
        self.wbuf.clear()
        self.chunks.clear()
        self.queued_out = 0

    # ---- limits --------------------------------------------------------------------------------
    def _charge_reset(self) -> None:
        """Rapid reset (CVE-2023-44487): each client RST_STREAM and each refused stream takes a
        token; the bucket holds stream_reset_burst and refills at stream_reset_rate per second.
        Empty: GOAWAY(ENHANCE_YOUR_CALM) and close."""
        burst = self.reset_burst
        if not burst:
            return
        now = self.loop.time()
        tokens = min(float(burst), self.reset_tokens + (now - self.reset_at) * self.reset_rate) - 1.0
        self.reset_at = now
        self.reset_tokens = tokens
        if tokens < 0:
            raise H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM,
                                    f"too many stream resets (more than {burst} at once, "
                                    f"--stream-reset-burst / --stream-reset-rate {self.reset_rate:g}/s)")

    def _control_reply(self) -> None:
        """PING and SETTINGS ACKs queued while the peer does not read (the socket's buffer is
        over its high-water mark), or queued by one read before anything is written (nghttp2
        counts its outbound queue the same way): more than max_pending_control_frames is a flood.
        Counting only the first kind let one read of ~17k SETTINGS frames (a 256 KiB socket read)
        hold the event loop ~50 ms before the backlog could even be seen, and a good client's
        request, which takes several loop passes, waited behind a few such reads (p99 150-175 ms
        under a SETTINGS flood on an idle machine, over the adversarial limit of 250 ms under load)."""
        if self.max_control:
            self.control_unflushed += 1
            if self.paused:
                self.control_backlog += 1
            if self.control_backlog > self.max_control or self.control_unflushed > self.max_control:
                raise H2ConnectionError(ErrorCode.ENHANCE_YOUR_CALM,
                                        f"more than {self.max_control} PING/SETTINGS replies queued that the "
                                        f"peer does not read (--max-pending-control-frames)")

    def _flush(self) -> None:
        self.control_unflushed = self.unflushed = 0
        self.marked = False
        super()._flush()

    def _on_ping_ack(self, payload: bytes) -> None:
        if payload == KEEPALIVE_PING:
            self.ping_sent = None

    def resume_writing(self) -> None:
        self.paused = False
        self.control_backlog = 0
        for st in list(self.streams.values()):
            if st.waiter is not None:
                self._wake(st)

    def _over_send_budget(self) -> bool:
        """Close the connection when what it holds unsent (in streams' queues for the peer's
        windows, and in the socket's buffer) exceeds conn_send_buffer_bytes; True when closed.
        Checked before a new message is queued, so one message larger than the budget still
        goes to a peer that reads."""
        budget = self.send_budget
        if not budget or self.transport is None:
            return False
        pending = self.queued_out + self.transport.get_write_buffer_size() + self.unflushed
        if pending <= budget:
            return False
        log.info("closing HTTP/2 connection from %s: %d response bytes unsent, over --conn-send-buffer-bytes %d",
                 self.peername, pending, budget)
        self.paused = True  # do not wait for the peer: drop what it has not taken (abort)
        self.going_away = True  # (the rest of this read's streams are refused, not answered into a dead buffer)
        self.unflushed = 0
        self._fatal(ErrorCode.ENHANCE_YOUR_CALM,
                    f"{pending} response bytes unsent, over the connection's send budget of {budget} bytes")
        for st in list(self.streams.values()):
            self._abandon(st)
        self.streams.clear()
        self.blocked.clear()
        self.queued_out = 0
        # the held responses are freed as their handlers unwind; then glibc may give the heap back
        loop = self.loop
        loop.call_later(0.5, lambda: loop.run_in_executor(None, release_memory))
        return True

    def _unhold(self, st: ServerStream, n: int) -> None:
        """`n` received bytes of `st` were taken by its handler (or dropped): the connection
        window gets them back."""
        st.held -= n
        self.held -= n
        self._release(n)

    def _receive_budget_full(self) -> None:
        """The connection window is (nearly) all held by messages that have not yet arrived
        whole, so nothing can complete: fail the newest stream that holds a partial message
        (RESOURCE_EXHAUSTED) so the others can go on."""
        partial = [st for st in self.streams.values() if st.buf and st.held]
        if not partial:
            return  # held by complete messages that handlers will take: flow control waits for them
        st = max(partial, key=lambda s: s.sid)
        self._fail(st, Status.RESOURCE_EXHAUSTED,
                   f"connection receive buffer full: {self.held} bytes of partly received messages held "
                   f"(--conn-receive-buffer-bytes {self.conn_window}); send large messages one at a time "
                   f"or on separate connections")

    def _on_tick(self) -> None:
        """One timer per connection, every `tick` seconds: header, idle and keepalive timeouts.
        Nothing on the request path but a flag (`heard`) set in data_received."""
        self.timer = None
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        limits = self.server.limits
        now = self.loop.time()
        header_timeout = limits.header_timeout_s
        if header_timeout:
            if not self.preface and now - self.started_at >= header_timeout:
                self._fatal(ErrorCode.PROTOCOL_ERROR, f"no HTTP/2 preface within {header_timeout:g} s "
                                                      f"(--header-timeout-s)")
                return
            if self.continuation is not None and now - self.continuation_since >= header_timeout:
                self._fatal(ErrorCode.PROTOCOL_ERROR, f"header block not completed within {header_timeout:g} s "
                                                      f"(--header-timeout-s)")
                return
        if self.chunks:  # an incomplete frame: headers must complete in header_timeout, DATA keep coming
            first = self.chunks[0]
            if self.partial is None or self.partial[0] is not first:
                self.partial = (first, now)
            else:
                typ = first[3] if len(first) > 3 else HEADERS
                limit = header_timeout if typ != DATA else limits.read_timeout_s
                if limit and now - self.partial[1] >= limit:
                    self._fatal(ErrorCode.PROTOCOL_ERROR, f"a frame not completed within {limit:g} s "
                                                          f"(--header-timeout-s / --read-timeout-s)")
                    return
        else:
            self.partial = None
        if self.streams and limits.body_timeout_s:  # (nothing to look at without a call in progress)
            self._slow_messages(now, limits.body_timeout_s)
        idle = limits.idle_timeout_s
        if idle:
            if self.streams:
                self.idle_since = None
            elif self.idle_since is None or self.idle_sid != self.last_sid:
                self.idle_since, self.idle_sid = now, self.last_sid
            elif now - self.idle_since >= idle:
                self._fatal(ErrorCode.NO_ERROR, f"idle for {idle:g} s (--idle-timeout-s)")
                return
        interval = limits.keepalive_interval_s
        if interval:
            if self.heard:
                self.heard = False
                self.silent_since = now
                self.ping_sent = None
            elif self.ping_sent is not None:
                if now - self.ping_sent >= limits.keepalive_timeout_s:
                    log.debug("closing HTTP/2 connection from %s: keepalive PING not answered", self.peername)
                    self.paused = True  # a silent peer: abort, do not wait for it to read
                    self._fatal(ErrorCode.NO_ERROR, "keepalive PING not answered (--keepalive-timeout-s)")
                    return
            elif now - self.silent_since >= interval:
                self.ping_sent = now
                self._write(frame(PING, 0, 0, KEEPALIVE_PING))
        self.timer = self.loop.call_later(self.server.tick, self._on_tick)

    def _slow_messages(self, now: float, limit: float) -> None:
        """Fail a stream whose request message has been arriving for longer than `limit`
        (--body-timeout-s: a message trickled in 1-byte DATA frames is never silent long enough for
        the read timeout). A message is seen as the same one while its partial bytes do not shrink.
        A unary call's one message is awaited from its HEADERS on, its first byte or not: a call
        opened without END_STREAM whose DATA never comes would otherwise hold its stream, and keep
        its connection from the idle timeout, for ever (tests/adversarial/test_unary_without_message.py)."""
        for st in list(self.streams.values()):
            n = len(st.buf)
            # (a unary call has no Task until its message is whole; a request-streaming one has its queue)
            awaited = st.task is None and st.queue is None and st.handler is not None and not st.closed
            if n < st.partial_len or not (n or awaited):  # a message completed since the last look, or none due
                st.partial_len, st.partial_since = n, (now if n else 0.0)
                continue
            st.partial_len = n
            if not st.partial_since:
                st.partial_since = now
            elif now - st.partial_since >= limit:
                self._fail(st, Status.RESOURCE_EXHAUSTED, f"request message not complete after {limit:g} s "
                                                          f"(--body-timeout-s)")
        self._flush()

    def _after_end(self, st: ServerStream) -> None:
        """DATA or HEADERS on a stream the client has ended (half-closed remote): a stream error,
        STREAM_CLOSED (RFC 9113 5.1), the stream's work stopped as a client's reset stops it, and
        the reset charged as one (MadeYouReset, CVE-2025-8671: resets the server is made to send
        must cost the client what its own cost; docs/security.md)."""
        self.wbuf.append(frame(RST_STREAM, 0, st.sid, U32.pack(ErrorCode.STREAM_CLOSED)))
        self._on_reset(st.sid, ErrorCode.STREAM_CLOSED)  # (as the client's own reset: abandoned, charged)

    def _fail(self, st: ServerStream, code: int, details: str) -> None:
        """The server ends a stream on its own (a limit, the client's protocol error, the deadline):
        its status goes out and its work stops, as a client's RST_STREAM stops it (_abandon). A call
        whose client has its answer never runs on, and never outlives the stream's place under
        MAX_CONCURRENT_STREAMS (MadeYouReset, CVE-2025-8671). Also from the stream's own Task
        (requests.taken): the cancel then lands at its next await."""
        if st.closed:
            return
        st.cancelled = True
        self._finish(st, code, details)
        task = st.task
        if task is not None and not task.done():
            task.cancel()

    def _abandon(self, st: ServerStream) -> None:
        """The peer is gone or reset the stream: stop its work, send nothing more."""
        if st.closed:
            return
        st.closed = st.cancelled = True
        if st.task is not None and not st.task.done():
            st.task.cancel()
        if st.queue is not None:
            st.queue.put_nowait(_EOF)
        self.blocked.discard(st)
        self._wake(st)
        self._discard_out(st)
        if st.held:
            self._unhold(st, st.held)
        if st.handler is not None:
            self.server._stream_done()

    def _on_reset(self, sid: int, code: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self._abandon(st)
        self._charge_reset()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        block = self._fragment(flags, payload) if flags & (PADDED | PRIORITY_FLAG) else payload
        st = self.streams.get(sid)
        if st is None:
            if sid <= self.last_sid:
                # a late frame for a stream we already finished: trailers from a client are
                # not expected in gRPC; decode to keep the HPACK table in step, then ignore
                if flags & END_HEADERS:
                    self._decode(bytes(block), _parse_request_headers)
                    return
                st = ServerStream(sid, 0)
                st.closed = True
            elif self.max_streams and len(self.streams) >= self.max_streams:
                # over SETTINGS_MAX_CONCURRENT_STREAMS: refused (its block is still decoded, to
                # keep the HPACK table in step); refusals count as resets (rapid reset)
                self.last_sid = sid
                st = ServerStream(sid, 0)
                st.closed = True
                self.wbuf.append(frame(RST_STREAM, 0, sid, U32.pack(ErrorCode.REFUSED_STREAM)))
                self._charge_reset()
            else:
                self.last_sid = sid
                st = ServerStream(sid, self.peer_initial_window)
                self.streams[sid] = st
                if self.counted and len(self.streams) == 1:  # busy again: the last to be closed near the cap
                    connections.TABLE.idle_now(self)
        if flags & END_HEADERS:  # (the common case of _header_block, inlined)
            self._headers_complete(st, flags, block)
        else:
            self._header_block(st, flags, block)

    def _headers_complete(self, st: ServerStream, flags: int, block: bytes) -> None:
        parsed = self.hcache.get(block) or self._decode(block, _parse_request_headers)
        if st.closed:
            return
        if st.handler is not None or st.path:  # trailers from the client: end of its stream
            if st.remote_ended:  # a second end of a stream the client already ended
                self._after_end(st)
            elif flags & END_STREAM:
                self._remote_end(st)
            return
        path, method, ctype, timeout, st.encoding, st.metadata = parsed
        if flags & END_STREAM:  # no request body: an immediate answer closes the stream both ways
            st.remote_ended = True
        if timeout is not None:
            st.deadline = time.monotonic() + timeout
        if self.going_away or self.server._stopping:
            self.streams.pop(st.sid, None)
            st.closed = True
            self.wbuf.append(frame(RST_STREAM, 0, st.sid, U32.pack(ErrorCode.REFUSED_STREAM)))
            return
        if method != b"POST" or ctype is None or not ctype.startswith(b"application/grpc"):
            self._finish_http(st, b"415" if method == b"POST" else b"405")
            return
        st.path = path
        handler = self.server._methods.get(path)
        if handler is None:
            self._finish(st, Status.UNIMPLEMENTED, f"Method not found: {st.path}")
            return
        if st.encoding not in (None, b"identity", b"gzip", b"deflate"):
            self._finish(st, Status.UNIMPLEMENTED,
                         f"compression {st.encoding.decode('latin-1')} is not supported (identity, gzip, deflate)")
            return
        check = self.server.check_headers
        if check is not None and (refused := check(path, st.metadata)) is not None:
            self._finish(st, *refused)  # (before a byte of its message is taken: issue 29, keys before bodies)
            return
        if not self.named and self._claim(st, handler.request_streaming):
            return
        st.handler = handler
        self.server._active += 1  # a call in progress (H2GrpcServer.stop waits for them)
        if timeout is not None:
            st.due = due = self.loop.time() + timeout
            self.deadlines.add(due)
        if handler.request_streaming:
            st.queue = Inbox(self.loop)
            st.task = _Task(self._run(st, b""), loop=self.loop, name=TASK_NAME)
        if flags & END_STREAM:
            self._remote_end(st)

    def _on_data(self, flags: int, sid: int, data: bytes, start: int, end: int) -> None:
        if sid == 0:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        length = end - start
        st = self.streams.get(sid)
        if st is None or st.closed or st.handler is None:  # refused or already answered: drop
            self._release(length)
            return
        if st.remote_ended:  # DATA after the client's END_STREAM
            self._release(length)
            self._after_end(st)
            return
        # The stream's window: a unary call's comes back as data arrives (its one message is
        # bounded by max_receive from its length prefix on); a request-streaming call's as its
        # handler keeps up (_settle). The connection's comes back only as handlers take the
        # messages (_unhold): what a connection holds stays within conn_receive_buffer_bytes.
        if st.queue is not None:
            st.owed += length
        elif not flags & END_STREAM:  # (an ended stream's window is never needed again)
            self._credit_stream(st, length, False)
        if flags & PADDED:
            start, end = self._unpad(flags, data, start, end)
        if (flags & END_STREAM and st.queue is None and not st.buf and end - start >= 5
                and U32.unpack_from(data, start + 1)[0] == end - start - 5):
            # the common unary case: the whole message in one frame; one copy, no buffering
            self.recv_unacked += length  # _release(length), inlined on the hot path
            if self.recv_unacked >= self.window_update_at or self.recv_window < self.window_update_at:
                self._release(0)
            st.remote_ended = True
            if end - start - 5 > self.server.max_receive:
                self._fail_too_large(st, end - start - 5)
                return
            self._start_unary(st, data[start + 5:end], data[start])
            return
        if length != end - start:  # padding: nothing to hold
            self._release(length - (end - start))
        if start < end:
            st.held += end - start
            self.held += end - start
            if st.queue is not None and not st.buf:  # request streaming, nothing partial: straight from the frame
                if not self._messages(st, data, start, end):
                    return
            else:
                st.hold(memoryview(data)[start:end])
                if not self._messages(st):
                    return
            if self.held > self.held_limit:
                self._receive_budget_full()
                if st.closed:
                    return
        # (what the handler took is settled as it takes it, in _requests: here only what it left
        # unsettled, and a stream window update that is due)
        if st.queue is not None and (st.taken or st.owed + st.recv_unacked >= STREAM_WINDOW_UPDATE):
            self._settle(st)
        if flags & END_STREAM:
            self._remote_end(st)

    def _messages(self, st: ServerStream, frame_data: bytes | None = None, pos: int = 0, end: int = 0) -> bool:
        """Move complete messages out of the stream buffer (into its queue, for request-streaming
        calls). False when the stream was failed (a message too large; a compressed message is
        inflated only when its handler takes it: ``_requests``).
        With ``frame_data`` (a request-streaming stream whose buffer is empty): the messages are
        taken from ``frame_data[pos:end]`` (a DATA frame's payload) itself, one copy each instead
        of three (into the buffer, a bytearray slice, bytes), and only what is left (a partial
        message, or what waits while parked) goes into the buffer."""
        buf = st.buf
        if st.queue is None:  # unary request: only the size checks, the message is taken at the end
            if len(buf) >= 5:
                size = U32.unpack_from(buf, 1)[0]
                if size > self.server.max_receive:
                    self._fail_too_large(st, size)
                    return False
                if len(buf) > 5 + size:
                    self._fail(st, Status.INVALID_ARGUMENT, "a unary call needs exactly one request message")
                    return False
            return True
        if frame_data is not None:
            src: bytes | bytearray = frame_data
        else:
            src, end = buf, len(buf)
        queue = st.queue
        st.parked = False
        while end - pos >= 5:
            if queue.qsize() >= STREAM_MAX_QUEUED or st.queued > STREAM_MAX_HELD:  # the rest stays raw until the handler reads on
                st.parked = True
                break
            compressed, size = MESSAGE_PREFIX.unpack_from(src, pos)
            if size > self.server.max_receive:
                self._fail_too_large(st, size)
                return False
            if end - pos - 5 < size:
                break
            # (a bytes frame: one copy; the buffer: a bytearray slice, then bytes)
            msg = frame_data[pos + 5:pos + 5 + size] if frame_data is not None else bytes(src[pos + 5:pos + 5 + size])
            pos += 5 + size
            # (compressed: inflated when the handler takes it, _requests, not here)
            queue.put_nowait((Compressed(msg) if compressed else msg, 5 + size))
            st.queued += 5 + size
        if frame_data is not None:
            if pos < end:  # a partial message, or what waits while parked
                st.hold(memoryview(frame_data)[pos:end])
        elif pos:
            del buf[:pos]
        return True

    def _settle(self, st: ServerStream) -> None:
        """Give a request-streaming call's received bytes back to its window (in big increments),
        unless its handler has more than STREAM_BACKLOG bytes, or STREAM_MAX_QUEUED messages,
        not yet taken: then the client is stopped once its window is spent, and goes on as the
        handler catches up. A message larger than the window still arrives: its partial bytes
        are no backlog."""
        if (st.owed or st.taken) and not st.parked and st.queued <= STREAM_BACKLOG:
            # one step per message on the streaming hot path, so _credit_stream and _unhold
            # are inlined here (measured: the two calls cost ~10% of a streamed message)
            owed, st.owed = st.owed, 0
            recv = st.recv_unacked + owed
            if recv >= STREAM_WINDOW_UPDATE and not (st.remote_ended or st.closed):
                self._write(frame(WINDOW_UPDATE, 0, st.sid, U32.pack(recv)))
                recv = 0
            st.recv_unacked = recv
            taken = st.taken
            if taken:  # messages the handler took: their bytes go back to the connection window
                st.taken = 0
                if taken > st.held:
                    taken = st.held
                st.held -= taken
                self.held -= taken
                self.recv_unacked += taken
                if self.recv_unacked >= self.window_update_at or self.recv_window < self.window_update_at:
                    self._release(0)

    def _fail_too_large(self, st: ServerStream, size: int) -> None:
        self._fail(st, Status.RESOURCE_EXHAUSTED,
                   f"Received message larger than max ({size} vs. {self.server.max_receive})")

    def _remote_end(self, st: ServerStream) -> None:
        st.remote_ended = True
        if st.closed or st.handler is None:
            return
        if st.queue is not None:
            if st.parked:
                return  # messages still wait in buf: _requests ends the stream once they are queued
            if st.buf:
                self._fail(st, Status.INVALID_ARGUMENT, "incomplete message at end of stream")
                return
            st.queue.put_nowait(_EOF)
            return
        buf = st.buf
        if len(buf) < 5 or len(buf) != 5 + U32.unpack_from(buf, 1)[0]:
            self._fail(st, Status.INVALID_ARGUMENT,
                       "a unary call needs exactly one request message")
            return
        st.buf = _NO_BUF
        if st.held:
            self._unhold(st, st.held)
        self._start_unary(st, bytes(memoryview(buf)[5:]), buf[0])

    def _at_once(self, sid: int, data: bytes, start: int, end: int) -> int:
        """A unary call answered from its two frames, before any stream is made: its HEADERS
        (``data[start:end]``, END_HEADERS only, a block this connection has decoded before: the
        HPACK table stays as it is) followed in the same read by its whole message in one DATA
        frame with END_STREAM (uncompressed, no padding), to a path whose at-once hook wants no
        call (H2GrpcServer.at_once). The hook's answer goes out as ``_reply`` writes it (HEADERS,
        the message and the OK trailers in one buffer) and the call leaves nothing behind but the
        windows' counts and the last stream id. When the hook declines, raises or answers more
        than the windows or the peer's frame size allow, the stream is opened from what the
        checks here decoded (``_open``: no second pass over the headers, no second header check)
        and the call goes on as ``_start_unary`` would (its Task, UNKNOWN, or ``_reply``'s queue).
        A path without a hook is taken as one whose hook declines (its Task at once: the gateway's
        every ModelInfer without the cache), but only on a connection with nothing left to count
        for a tenant (``named``: with tenants, ``_headers_complete``'s ``_claim`` names it first).
        Anything the usual path would refuse or treat apart (a stream id
        not above the last, a full connection, a non-POST or non-gRPC request, an encoding, the
        header check's refusal, a message over the limit, the receive window, going away, a
        paused transport) is left to it. A WINDOW_UPDATE of the stream between the two frames
        (grpc's C++ client, perf_analyzer's, writes one there) is taken with them: the stream, if
        opened, starts with its increment, as the usual path would give it. Returns the offset
        after the DATA frame, or 0: not taken, the frames go the usual way."""
        if len(data) - end < 14 or self.paused or self.unflushed > self.unflushed_cap:  # (over: _reply's check)
            return 0
        d = end  # the DATA frame
        hi, lo, typ, flags, dsid = FRAME_HEADER.unpack_from(data, d)
        inc = 0
        if typ == WINDOW_UPDATE and dsid == sid and hi == 0 and lo == 4 and len(data) - d >= 27:
            inc = U32.unpack_from(data, d + 9)[0] & 0x7FFFFFFF  # (as _read takes a stream's: no check)
            d += 13
            hi, lo, typ, flags, dsid = FRAME_HEADER.unpack_from(data, d)
        length = hi << 16 | lo
        after = d + 9 + length
        if (typ != DATA or flags != END_STREAM or dsid != sid or after > len(data) or length < 5 or data[d + 9]
                or U32.unpack_from(data, d + 10)[0] != length - 5 or sid <= self.last_sid or not sid & 1):
            return 0
        block = data[start:end]
        parsed = self.hcache.get(block)
        if parsed is None:
            return 0
        path, method, ctype, _, encoding, metadata = parsed
        found = self.at_once.get(path)
        server = self.server
        if ((found[1] if found is not None else not self.named) or method != b"POST" or encoding is not None or ctype is None
                or not ctype.startswith(b"application/grpc") or length - 5 > server.max_receive
                or self.recv_window < length or self.going_away or server._stopping
                or (self.max_streams and len(self.streams) >= self.max_streams)):
            return 0
        handler = server._methods.get(path)
        check = server.check_headers
        if handler is None or handler.request_streaming or (check is not None and check(path, metadata) is not None):
            return 0
        self.recv_window -= length  # (the DATA frame, as _read counts it, given back at once as _on_data does)
        self.recv_unacked += length
        if self.recv_unacked >= self.window_update_at or self.recv_window < self.window_update_at:
            self._release(0)
        if not self.marked and self.counted and not self.streams:  # (busy again, as _on_headers marks it)
            self.marked = True
            connections.TABLE.idle_now(self)
        msg = data[d + 14:after]
        if found is None:  # (no hook for the path: its Task, as _start_unary makes it)
            st = self._open(sid, parsed, handler, inc)
            st.task = _Task(self._run(st, msg), loop=self.loop, name=TASK_NAME)
            return after
        try:
            answer = found[0](msg, None)
        except Exception as exc:
            log.exception("error in gRPC at-once hook for %s", path)
            self._finish(self._open(sid, parsed, handler, inc), Status.UNKNOWN, internal_error(exc).message)
            return after
        if answer is None:  # declined (a cache miss): the call's Task, as _start_unary makes it
            st = self._open(sid, parsed, handler, inc)
            st.task = _Task(self._run(st, msg), loop=self.loop, name=TASK_NAME)
            return after
        n = len(answer) + 5
        if n > self.send_window or n > self.peer_initial_window + inc or n > self.peer_max_frame:
            self._reply(self._open(sid, parsed, handler, inc), answer, None)
            return after
        self.last_sid = sid
        self.send_window -= n
        self.unflushed += n  # (the send budget counts it as _reply does)
        self.wbuf.append(_REPLY_HEAD.pack(0, _HEAD_LEN, HEADERS, END_HEADERS, sid, RESPONSE_HEADERS,
                                          n >> 16, n & 0xFFFF, DATA, 0, sid, 0, n - 5)
                         + answer + _TRAILERS_OK_FRAME.pack(0, _TRAILERS_LEN, HEADERS, END_STREAM | END_HEADERS,
                                                            sid, TRAILERS_OK))
        return after

    def _open(self, sid: int, parsed: tuple[Any, ...], handler: Method, inc: int = 0) -> ServerStream:
        """The stream of a call ``_at_once`` took and did not answer, its message received whole:
        opened as ``_on_headers`` and ``_headers_complete`` open a call they accept, from the
        block ``_at_once`` looked up (``parsed``) and the method it found, without their second
        pass (every check that would refuse the call was ``_at_once``'s, in this read; it marked
        the connection busy as ``_on_headers`` does); ``inc``: the stream's WINDOW_UPDATE taken
        with its frames."""
        self.last_sid = sid
        st = self.streams[sid] = ServerStream(sid, self.peer_initial_window + inc)
        st.path, _, _, timeout, _, st.metadata = parsed
        st.handler = handler
        st.remote_ended = True
        self.server._active += 1  # (a call in progress: H2GrpcServer.stop waits for it)
        if timeout is not None:
            st.deadline = time.monotonic() + timeout
            st.due = due = self.loop.time() + timeout
            self.deadlines.add(due)
        return st

    def _claim(self, st: ServerStream, holds: bool) -> bool:
        """With tenants, until the connection is named: count it for the tenant this call's
        metadata names (connections.TABLE.claim; `holds`: a request-streaming call, which counts as
        anonymous callers' without a tenant's key). True: refused, the tenant holds its share of
        --max-connections; the call ends RESOURCE_EXHAUSTED and the connection goes away.
        (Never on the at-once path: with tenants its hook wants the call, and that path is not taken.)"""
        if not self.counted:
            return False
        refusal = connections.TABLE.claim(self, dict(st.metadata), self.transport, tls.cert_names_grpc, holds)
        if refusal is None:
            return False
        self.named = True
        if not refusal:
            return False
        self._finish(st, Status.RESOURCE_EXHAUSTED, refusal, ((RETRY_PUSHBACK, "1000"),))
        self.goaway()
        return True

    def _start_unary(self, st: ServerStream, msg: bytes, compressed: int) -> None:
        """Run a unary-request call on its (size-checked) message: answered here, without a Task,
        when its path's ``H2GrpcServer.at_once`` hook answers it (see there), else in a Task."""
        if compressed:  # inflated in slices within the process's budget, then run (meshserve/server/inflate.py)
            st.task = _Task(self._inflated(st, msg), loop=self.loop, name=TASK_NAME)
            return
        hooks = self.server.at_once
        if hooks and (found := hooks.get(st.path)) is not None:
            hook, wants_call = found
            ctx = ServerCall(self, st) if wants_call else None
            try:
                answer = hook(msg, ctx)
            except Exception as exc:
                log.exception("error in gRPC at-once hook for %s", st.path)
                self._finish(st, Status.UNKNOWN, internal_error(exc).message)
                return
            if answer is not None:  # (as _run ends a unary call: the hook's answer, or its status)
                if ctx is None:
                    self._reply(st, answer, None)
                elif ctx._code:
                    self._end(st, ctx)
                else:
                    self._reply(st, answer, ctx)
                return
        st.task = _Task(self._run(st, msg), loop=self.loop, name=TASK_NAME)

    async def _inflated(self, st: ServerStream, msg: bytes) -> None:
        """A compressed unary message: inflated (``inflate.Inflation``: in slices, charged to the
        process's budget of decompressed bytes, held until the call ends), then started as an
        uncompressed one (its at-once hook, else its own Task)."""
        inflation = inflate.Inflation(st.metadata, self.transport)  # (the metadata name the tenant)
        try:
            msg = await inflation.run(st.encoding, msg, self.server.max_receive)
        except inflate.Refused as exc:  # (what it held is given back)
            self._finish(st, Status[exc.code], exc.message)
            return
        me = st.task
        if not st.closed:
            self._start_unary(st, msg, 0)
        if st.task is not me and st.task is not None and not st.task.done():
            st.task.add_done_callback(lambda _: inflation.release())
        else:
            inflation.release()

    # ---- calling handlers ------------------------------------------------------------------
    def _next_pass(self) -> None:
        """The loop's next pass: this connection's handlers may take MESSAGES_PER_PASS more."""
        self.pass_taken = 0

    def _requests(self, st: ServerStream) -> AsyncIterator[Any]:
        """A request-streaming handler's requests (meshserve/server/h2/requests.py: an async
        generator, which mypyc does not compile: docs/perf/native.md)."""
        return requests.taken(self, st, _EOF, Compressed)

    async def _run(self, st: ServerStream, message: bytes) -> None:  # (b"": request streaming)
        handler = st.handler
        assert handler is not None
        ctx = ServerCall(self, st)
        try:
            if handler.request_streaming:
                request: Any = self._requests(st)
            else:
                try:
                    request = handler.request_deserializer(message) if handler.request_deserializer else message
                except Exception as exc:
                    self._finish(st, Status.INVALID_ARGUMENT, f"Exception deserializing request: {exc}")
                    return
            result = handler.fn(request, ctx)
            ser = handler.response_serializer
            if handler.response_streaming:
                if hasattr(result, "__aiter__"):
                    # (in requests.py: its ``finally`` awaits, which mypyc gets wrong: docs/perf/native.md)
                    if await requests.answered(self, st, result, ser, STREAM_SEND_QUEUE):
                        return
                elif result is not None and not inspect.isawaitable(result):
                    for item in result:
                        self._send_message(st, ser(item) if ser else item)
                elif result is not None:
                    await result
                self._end(st, ctx)
                return
            if result.__class__ is _COROUTINE or inspect.isawaitable(result):  # (an async def's: no call)
                result = await result
            if st.closed:
                return
            if not ctx._code:
                if result is None:
                    self._finish(st, Status.INTERNAL, "handler returned no response")
                    return
                payload = ser(result) if ser else result
                self._reply(st, payload, ctx)
            else:
                self._end(st, ctx)
        except Abort:
            self._end(st, ctx)
        except asyncio.CancelledError:
            if not st.closed:
                self._finish(st, Status.CANCELLED, "call cancelled")
            raise
        except Exception as exc:
            log.exception("error in gRPC handler for %s", st.path)
            self._finish(st, Status.UNKNOWN, internal_error(exc).message)  # its text: in the log only
        finally:
            if ctx._callbacks:
                for cb in ctx._callbacks:
                    try:
                        cb(ctx)
                    except Exception:  # a callback must not break the stream
                        log.exception("done callback failed")

    async def _writable(self, st: ServerStream) -> None:
        """Wait until the stream's unsent messages fit again (the peer's WINDOW_UPDATE let
        _drain write them) or the stream or connection ends: a future, woken by _wake."""
        while ((len(st.out) > STREAM_SEND_QUEUE or self.paused or (st in self.blocked and len(st.out) > 2))
               and not st.closed and not self.closed):
            st.waiter = self.loop.create_future()
            try:
                await st.waiter
            finally:
                st.waiter = None

    def _expire(self, st: ServerStream) -> None:
        """Its `grpc-timeout` is up (H2Endpoint._on_deadlines)."""
        if st.closed:
            return
        self._fail(st, Status.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # ---- writing ---------------------------------------------------------------------------
    def _send_headers(self, st: ServerStream, metadata: Iterable[tuple[str, Any]] = ()) -> None:
        block = RESPONSE_HEADERS
        for k, v in metadata:
            block += literal(k.lower().encode(), md_value(k, v))
        st.headers_sent = True
        self._write(self._headers(st.sid, 0, block))

    def _reply(self, st: ServerStream, payload: bytes, ctx: ServerCall | None) -> None:
        """Unary success: HEADERS, one message, trailers — one write when the windows allow.
        ``ctx`` None: an at-once hook's answer made without a call (H2GrpcServer.at_once): OK, no
        trailing metadata."""
        n = len(payload) + 5
        if (self.paused or self.unflushed > self.unflushed_cap) and self._over_send_budget():
            return
        trailers = _trailers_block(0, None, ctx._trailing) if ctx is not None and ctx._trailing else TRAILERS_OK
        if (not st.headers_sent and not st.out and n <= self.send_window and n <= st.send_window
                and n <= self.peer_max_frame):
            self.send_window -= n
            st.send_window -= n
            self.unflushed += n
            st.headers_sent = True
            sid = st.sid
            if trailers is TRAILERS_OK and n <= SMALL_REPLY and payload.__class__ is bytes:  # (the usual answer)
                frames = _REPLY_FRAMES.get(n) or _reply_frames(n)
                end = frames[0].pack(_HEADERS_FRAME_HEAD, sid, frames[1], sid, frames[2], payload,
                                     _TRAILERS_FRAME_HEAD, sid, TRAILERS_OK)
            else:
                head = _REPLY_HEAD.pack(0, _HEAD_LEN, HEADERS, END_HEADERS, sid, RESPONSE_HEADERS,
                                        n >> 16, n & 0xFFFF, DATA, 0, sid, 0, n - 5)
                end = _TRAILERS_OK_FRAME.pack(0, _TRAILERS_LEN, HEADERS, END_STREAM | END_HEADERS, sid, TRAILERS_OK) \
                    if trailers is TRAILERS_OK else self._headers(sid, END_STREAM, trailers)
                if n <= SMALL_REPLY:  # one buffer, one write() (a large payload is not copied)
                    end = head + payload + end
                else:
                    self.wbuf.append(head)
                    self.wbuf.append(payload)
            if len(self.streams) > 1:  # other calls of this connection may answer in this pass: one write at its end
                self._write(end)
            else:  # nothing else of this connection can write in this pass: now
                self._send_now(end)
            self._closed(st)
            return
        self._send_message(st, payload)
        st.queue_out().append((HEADERS, trailers))
        self._drain(st)

    def _send_message(self, st: ServerStream, payload: bytes | list[bytes]) -> None:
        """One message of a stream (a list: its pieces, written one after another, not joined)."""
        if st.closed or ((self.paused or self.queued_out or self.unflushed > self.unflushed_cap)
                         and self._over_send_budget()):
            return
        if not st.headers_sent:
            self._send_headers(st)
        pieces: list[bytes] | None = payload if payload.__class__ is list else None  # type: ignore[assignment]
        size = sum(map(len, pieces)) if pieces is not None else len(payload)
        n = size + 5
        if not st.out and n <= self.send_window and n <= st.send_window and n <= self.peer_max_frame:
            # the common case (as _reply's): the message as one DATA frame now (its header and
            # prefix one buffer), without the stream's queue (_drain)
            self.send_window -= n
            st.send_window -= n
            self.unflushed += n
            self._write(_MESSAGE_HEAD.pack(n >> 16, n & 0xFFFF, DATA, 0, st.sid, 0, size))
            if pieces is None:
                self._write(payload)  # type: ignore[arg-type]
            else:
                for piece in pieces:
                    self._write(piece)
            if st.waiter is not None:
                self._wake(st)
            return
        self.queued_out += n
        out = st.queue_out()
        out.append((DATA, MESSAGE_PREFIX.pack(0, size)))
        for piece in pieces if pieces is not None else (payload,):  # type: ignore[assignment]
            if piece:
                out.append((DATA, memoryview(piece)))
        self._drain(st)

    def _end(self, st: ServerStream, ctx: ServerCall) -> None:
        if st.closed:  # (its status is out: a refused message's, _requests; nothing more on it)
            return
        value = ctx._code
        details = ctx._details if value else None
        if value and not st.headers_sent:
            self._finish(st, value, details, ctx._trailing)
            return
        if not st.headers_sent:
            self._send_headers(st)
        st.queue_out().append((HEADERS, _trailers_block(value, details, ctx._trailing)))
        self._drain(st)

    def _finish(self, st: ServerStream, code: int, details: str | None,
                metadata: Iterable[tuple[str, Any]] = ()) -> None:
        """Trailers-only response (an error before any message)."""
        if st.closed:
            return
        if st.headers_sent:
            st.queue_out().append((HEADERS, _trailers_block(code, details, metadata)))
            self._drain(st)
            return
        st.headers_sent = True
        block = self._headers(st.sid, END_STREAM, RESPONSE_HEADERS + _trailers_block(code, details, metadata))
        if len(self.streams) > 1:  # as in _reply: alone on the connection, written now
            self._write(block)
        else:
            self._send_now(block)
        self._closed(st)

    def _finish_http(self, st: ServerStream, status: bytes) -> None:
        block = literal(b":status", status) + literal(b"content-type", b"text/plain")
        self._write(frame(HEADERS, END_HEADERS | END_STREAM, st.sid, block))
        st.headers_sent = True
        self._closed(st)

    def _closed(self, st: ServerStream) -> None:
        """Our side of the stream is finished (END_STREAM written)."""
        was_open = not st.closed
        st.closed = True
        self.streams.pop(st.sid, None)
        if self.blocked:
            self.blocked.discard(st)
        if st.waiter is not None:
            self._wake(st)
        if st.held:
            self._unhold(st, st.held)
        if not st.remote_ended:
            # the client is still sending (e.g. an early error): tell it to stop
            self._write(frame(RST_STREAM, 0, st.sid, U32.pack(ErrorCode.NO_ERROR)))
            if st.queue is not None:
                st.queue.put_nowait(_EOF)
        if was_open and st.handler is not None:  # (H2GrpcServer._stream_done, inlined: every call's end)
            server = self.server
            server._active -= 1
            if server._active <= 0 and server._idle is not None:
                server._idle.set()
        if self.going_away and not self.streams and self.transport is not None:
            self._flush()
            self.transport.close()

    def evict(self) -> bool:
        """Closed to make room for a new connection when no call is open (connections.TABLE)."""
        if self.streams or self.transport is None or self.transport.is_closing():
            return False
        log.debug("closing idle HTTP/2 connection from %s: near --max-connections", self.peername)
        self.going_away = True
        self._write(frame(GOAWAY, 0, 0, U32.pack(self.last_sid) + U32.pack(ErrorCode.NO_ERROR)))
        self._flush()
        self.transport.close()
        return True

    def drop(self) -> None:
        """Closed at once, a call in progress or not: a connection that names no tenant yet, past
        their share (connections.TABLE.unnamed)."""
        if self.transport is not None:
            log.debug("closing HTTP/2 connection from %s: unnamed connections past their share", self.peername)
            self.transport.abort()

    def goaway(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self._write(frame(GOAWAY, 0, 0, U32.pack(self.last_sid) + U32.pack(ErrorCode.NO_ERROR)))
        self._flush()
        if not self.streams:
            self.transport.close()


class H2GrpcServer:
    """meshserve's gRPC server: methods registered by path (`add_methods`), each connection a
    ServerConnection, each call a ServerCall handed to its method's handler."""

    def __init__(self, max_receive_message_length: int | None = None, limits: ServerLimits | None = None):
        """`limits` (default: ServerLimits()'s defaults) bound every connection;
        `max_receive_message_length`, when given, overrides limits.max_request_bytes."""
        self.limits = limits = limits or ServerLimits()
        if max_receive_message_length is None:
            max_receive_message_length = limits.max_request_bytes or MAX_MESSAGE
        self.max_receive = min(max_receive_message_length, MAX_MESSAGE)
        inflate.INFLATING.limit = limits.max_receive_bytes  # (process-wide, as the HTTP ports' budget)
        # The receive budget is the connection window; it always fits one largest message.
        self.conn_window = min(MAX_WINDOW, max(limits.conn_receive_buffer_bytes or MAX_WINDOW,
                                               self.max_receive + 5 + 2 * LOCAL_MAX_FRAME + RECEIVE_SLACK))
        timeouts = [t for t in (limits.header_timeout_s, limits.read_timeout_s, limits.idle_timeout_s,
                                limits.keepalive_interval_s, limits.keepalive_timeout_s) if t > 0]
        # the connection timer's period: a quarter of the shortest timeout, within [10 ms, 1 s]
        self.tick = min(1.0, max(0.01, min(timeouts) / 4)) if timeouts else 0.0
        self._methods: dict[str, Method] = {}
        self._conns: set[ServerConnection] = set()
        # (path, metadata) -> None, or (gRPC status, details) to refuse the call at its headers,
        # before its message is received (the front end's key check: grpc_frontend.start_grpc_server)
        self.check_headers: Callable[[str, tuple[tuple[str, Any], ...]], tuple[int, str] | None] | None = None
        # path -> (hook, wants_call): a hook that answers a unary call at once, before any Task
        # is made (the gateway's cache hits: grpc_frontend.register): hook(message bytes, call)
        # -> the answer's bytes (or anything, with a non-OK status set on the call: the call ends
        # with it), or None: the call goes on in a Task as any other. Without wants_call the
        # hook gets None for the call (no ServerCall made: ~2,400 instructions) and answers
        # with OK and no trailing metadata. A hook never waits, adds no done callback and
        # leaves no state behind when it answers None; the reply goes out as a Task's would
        # (flow control and send budget: _reply)
        self.at_once: dict[str, tuple[Callable[[bytes, ServerCall | None], bytes | None], bool]] = {}
        self._servers: list[asyncio.Server] = []
        self.tls: tls.Acceptor | None = None  # set before bind: TLS on this port (--grpc-use-ssl)
        self._stopping = False
        self._active = 0
        self._idle: asyncio.Event | None = None

    def add_methods(self, service: str, methods: dict[str, Method]) -> None:
        """Serve `methods` (name -> Method) as /`service`/name."""
        for name, m in methods.items():
            self._methods[f"/{service}/{name}"] = m

    def paths(self) -> list[str]:
        """Every method path this server serves (/service/method)."""
        return list(self._methods)

    def _stream_done(self) -> None:
        self._active -= 1
        if self._active <= 0 and self._idle is not None:
            self._idle.set()

    async def bind(self, host: str, port: int) -> int:
        """Listen on host:port (0 = a free port, the same on every address of host)."""
        loop = asyncio.get_running_loop()
        factory: Callable[[], asyncio.Protocol] = lambda: ServerConnection(self)  # noqa: E731
        if self.tls is not None:  # --grpc-use-ssl: each connection's handshake first (meshserve/server/tls.py)
            factory = self.tls.factory(factory)
        srv = await loop.create_server(factory, host or None, port, reuse_address=True,
                                       reuse_port=LISTEN.reuse_port, backlog=1024)
        held: Any = srv  # (its sockets: a list under uvloop, a tuple in typeshed, which mypyc would check)
        sockets = held.sockets
        ports = {s.getsockname()[1] for s in sockets}
        if port == 0 and len(ports) > 1:
            srv.close()
            chosen = sockets[0].getsockname()[1]
            srv = await loop.create_server(factory, host or None, chosen, reuse_address=True,
                                           reuse_port=LISTEN.reuse_port, backlog=1024)
            ports = {chosen}
        self._servers.append(srv)
        return ports.pop()

    async def start(self) -> None:
        for s in self._servers:
            await s.start_serving()

    async def stop(self, grace: float | None) -> None:
        """Stop accepting, GOAWAY every connection, let calls in flight finish for `grace`
        seconds, then cancel what is left and close."""
        self._stopping = True
        for s in self._servers:
            s.close()
        for c in list(self._conns):
            c.goaway()
        if grace and self._active > 0:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                pass
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.close()
        for s in self._servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except TimeoutError:
                pass
