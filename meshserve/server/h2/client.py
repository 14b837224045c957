"""Long-lived gRPC streaming calls over our own HTTP/2 client connection.

The gateway → service hop keeps a few ModelStreamInfer calls open per replica and writes one
message per request. With grpc.aio each message cost a queue hop, an async generator step and
the channel's poller thread; here a message is one DATA frame appended to the connection's
write buffer, and a response message is handed to a callback straight from the frame loop.
Framing, flow control and HPACK decoding are shared with the server (connection.H2Endpoint).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import ssl
import struct
import urllib.parse
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from meshserve.server.deadlines import DeadlineTimer
from meshserve.server.h2.connection import H2Endpoint
from meshserve.server.h2.frames import (
    ACK,
    DATA,
    END_DATA,
    END_HEADERS,
    END_STREAM,
    FRAME_HEADER,
    HEADERS,
    LOCAL_STREAM_WINDOW,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    U32,
    ErrorCode,
    H2ConnectionError,
    Status,
    frame,
    literal,
    md_value,
)
from meshserve.server.limits import READ_BURST
from meshserve.server.tls import Reader

log = logging.getLogger("meshserve.grpc.h2client")

_HTTP_TO_GRPC = {400: Status.INTERNAL, 401: Status.UNAUTHENTICATED, 403: Status.PERMISSION_DENIED,
                 404: Status.UNIMPLEMENTED, 429: Status.UNAVAILABLE, 502: Status.UNAVAILABLE,
                 503: Status.UNAVAILABLE, 504: Status.UNAVAILABLE}


def _percent_decode(value: bytes) -> str:
    return urllib.parse.unquote_to_bytes(value).decode("utf-8", "replace")


def _parse_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> tuple[Any, ...]:
    """(HTTP status, grpc-status or None, grpc-message, grpc-encoding) of a response block."""
    status = code = encoding = None
    message = ""
    for k, v in headers:
        if k == b":status":
            status = int(v) if v.isdigit() else 0
        elif k == b"grpc-status":
            code = int(v) if v.isdigit() else Status.UNKNOWN
        elif k == b"grpc-message":
            message = _percent_decode(v)
        elif k == b"grpc-encoding":
            encoding = v
    return status, code, message, encoding


class GrpcError(Exception):
    """A call ended with a non-OK status."""

    def __init__(self, code: int, details: str):
        super().__init__(f"gRPC status {code}: {details}")
        self.code = code
        self.details = details


@functools.lru_cache(maxsize=256)  # (a client's calls mostly ask the same timeout)
def grpc_timeout(seconds: float) -> str:
    """A `grpc-timeout` value (at most 8 digits) for a deadline `seconds` from now."""
    for unit, scale in (("u", 1e6), ("m", 1e3), ("S", 1.0)):
        value = int(seconds * scale)
        if value < 100_000_000:
            return f"{max(value, 1)}{unit}"
    return "99999999S"


MAX_BLOCKS = 64  # request header blocks a connection keeps (H2ClientConnection.blocks)
MIN_MAX_FRAME = 16384  # the smallest SETTINGS_MAX_FRAME_SIZE a peer may set: a block this small is one frame
# a DATA frame's header and a message's prefix, in one struct call
_MESSAGE_HEAD = struct.Struct(">BHBBIBI")
SMALL_MESSAGE = 1 << 14  # a request message up to this size goes out joined to its frame header

OnMessage = Callable[[bytes], None]
OnClose = Callable[[int, str], None]  # (grpc status code, details); 0 = OK


class ClientStream:
    """One streaming call: `send` writes a request message, responses go to `on_message`,
    the end (trailers, reset, lost connection) to `on_close` exactly once."""

    __slots__ = ("conn", "sid", "send_window", "out", "closed", "recv_unacked", "buf", "on_message",
                 "on_close", "header_block", "header_flags", "got_headers", "encoding", "waiter", "due")

    def __init__(self, conn: H2ClientConnection, sid: int, on_message: OnMessage, on_close: OnClose):
        self.conn = conn
        self.sid = sid
        self.send_window = conn.peer_initial_window
        self.out: collections.deque[tuple[int, Any]] = collections.deque()
        self.closed = False
        self.recv_unacked = 0
        self.buf = bytearray()
        self.on_message = on_message
        self.on_close = on_close
        self.header_block: bytearray | None = None
        self.header_flags = 0
        self.got_headers = False
        self.encoding: bytes | None = None
        self.waiter: asyncio.Future[None] | None = None  # unused: sends are not awaited
        self.due: float | None = None  # a unary call's deadline in loop time (H2Endpoint._on_deadlines)

    def send(self, payload: bytes, end_stream: bool = False, headers: bytes = b"") -> None:
        """Write one message; `end_stream` half-closes the call after it (unary requests);
        `headers`: the call's HEADERS frames, written just before it (one buffer with it)."""
        if self.closed:
            raise ConnectionError("stream closed")
        conn = self.conn
        n = len(payload)
        if not self.out and n + 5 <= conn.send_window and n + 5 <= self.send_window \
                and n + 5 <= conn.peer_max_frame:
            conn.send_window -= n + 5
            self.send_window -= n + 5
            head = headers + _MESSAGE_HEAD.pack((n + 5) >> 16, (n + 5) & 0xFFFF, DATA, END_STREAM if end_stream else 0,
                                                self.sid, 0, n)
            if n <= SMALL_MESSAGE:  # one buffer, one write() (a large payload is not copied)
                head += payload
            else:
                conn.wbuf.append(head)
                head = payload
            if conn.sent_since_read:  # others may follow in this pass: written at its end, together
                conn._write(head)
            else:  # the first message since the connection last read (at concurrency 1, the only one): now
                conn.sent_since_read = True
                conn._send_now(head)
            return
        if headers:
            conn._write(headers)
        header = b"\x00" + n.to_bytes(4, "big")
        self.out.append((DATA, header))
        conn.queued_out += n + 5
        if payload:
            self.out.append((DATA, memoryview(payload)))
        if end_stream:
            self.out.append((END_DATA, b""))
        conn._drain(self)

    def cancel(self) -> None:
        """RST_STREAM(ErrorCode.CANCEL); on_close is not called."""
        if not self.closed:
            self.closed = True
            self.conn.streams.pop(self.sid, None)
            self.conn.blocked.discard(self)
            self.conn._discard_out(self)
            self.conn._write(frame(RST_STREAM, 0, self.sid, U32.pack(ErrorCode.CANCEL)))
            if self.conn.slot_waiters:
                self.conn._free_slots(1)


# The largest response message the client takes (the services are a trusted hop, and outputs may
# be large, but one message must not grow a buffer without end).
MAX_RESPONSE_BYTES = 1 << 30


class H2ClientConnection(H2Endpoint):
    read_burst = READ_BURST  # (H2Endpoint._yield_reads: a service answering at loopback speed yields the loop past it)

    def __init__(self, authority: str, max_receive: int = MAX_RESPONSE_BYTES):
        super().__init__()
        self.authority = authority.encode()
        self.next_sid = 1
        self.max_receive = max_receive
        self.slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.settled: asyncio.Future[None] | None = None  # the server's first SETTINGS arrived
        # (path, metadata as given, timeout) -> its request header block: a client's unary calls
        # repeat a few (metadata given as a tuple: the same tuple, or one equal to it)
        self.blocks: dict[tuple[str, Any, float | None], bytes] = {}
        # the unary calls' deadlines: one timer for all, not one per call (meshserve/server/deadlines.py)
        self.deadlines = DeadlineTimer(self.loop, self._on_deadlines)

    @property
    def usable(self) -> bool:
        return (not self.closed and not self.going_away and not self.dead and self.next_sid < 2**31 - 2
                and (self.transport is None or not self.transport.is_closing()))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.settled = self.loop.create_future()
        self.transport = transport  # type: ignore[assignment]
        self.peername = transport.get_extra_info("peername")
        transport.write(PREFACE + self._preamble())  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.deadlines.cancel()
        reason = f"connection to {self.authority.decode()} lost" + (f": {exc}" if exc else "")
        for st in list(self.streams.values()):
            self._end(st, Status.UNAVAILABLE, reason)
        self.streams.clear()
        self.blocked.clear()
        self._free_slots(len(self.slot_waiters))
        if self.settled is not None and not self.settled.done():
            self.settled.set_result(None)  # connect() is waiting for SETTINGS that will never come: fail it now

    def _free_slots(self, n: int) -> None:
        while n > 0 and self.slot_waiters:
            waiter = self.slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n -= 1

    async def _stream_slot(self) -> None:
        """Wait while the server's SETTINGS_MAX_CONCURRENT_STREAMS are all in use: a stream
        over it would be refused, and refusals count against the server's rapid-reset budget."""
        while len(self.streams) >= self.peer_max_streams and self.usable:
            waiter = self.loop.create_future()
            self.slot_waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._free_slots(1)  # pass the slot on
                raise

    def _block(self, path: str, metadata: Iterable[tuple[str, Any]]) -> bytes:
        """A request's header block: literals without indexing, valid on any stream."""
        block = (literal(b":method", b"POST") + literal(b":scheme", b"http") + literal(b":path", path.encode())
                 + literal(b":authority", self.authority) + literal(b"content-type", b"application/grpc")
                 + literal(b"te", b"trailers"))
        for k, v in metadata:
            block += literal(k.lower().encode(), md_value(k, v))
        return block

    def open_stream(self, path: str, metadata: Iterable[tuple[str, Any]], on_message: OnMessage,
                    on_close: OnClose) -> ClientStream:
        """A new call's stream, its HEADERS written."""
        if not self.usable:
            raise ConnectionError(f"connection to {self.authority.decode()} is closing")
        block = self._block(path, metadata)  # (before the stream: bad metadata leaves no stream behind)
        st = self._stream(on_message, on_close)
        self._write(self._headers(st.sid, 0, block))  # split into CONTINUATION frames when large
        return st

    def _stream(self, on_message: OnMessage, on_close: OnClose) -> ClientStream:
        """A new call's stream, its HEADERS not written yet."""
        if not self.usable:
            raise ConnectionError(f"connection to {self.authority.decode()} is closing")
        sid = self.next_sid
        self.next_sid += 2
        st = self.streams[sid] = ClientStream(self, sid, on_message, on_close)
        return st

    async def unary(self, path: str, payload: bytes, metadata: Iterable[tuple[str, Any]] = (),
                    timeout: float | None = None) -> bytes:
        """One unary call: the response message, or GrpcError (4 = DEADLINE_EXCEEDED on timeout)."""
        fut: asyncio.Future[tuple[int, str]] = self.loop.create_future()
        messages: list[bytes] = []

        def on_close(code: int, details: str) -> None:
            if not fut.done():
                fut.set_result((code, details))

        if len(self.streams) >= self.peer_max_streams:
            started = self.loop.time()
            # Woken for a freed stream, this call resumes a loop step or two later (wait_for's
            # task), and a call arriving in between may have taken it: look again until a stream
            # is free now; the open below follows without a suspension.
            while len(self.streams) >= self.peer_max_streams and self.usable:
                left = None if timeout is None else timeout - (self.loop.time() - started)
                if left is not None and left <= 0:
                    raise GrpcError(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")
                try:
                    await asyncio.wait_for(self._stream_slot(), left)
                except TimeoutError:
                    raise GrpcError(Status.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            if timeout is not None:
                timeout = max(0.0, timeout - (self.loop.time() - started))
        key: tuple[str, Any, float | None] | None = (path, metadata, timeout)
        try:
            block = self.blocks.get(key)  # type: ignore[arg-type]
        except TypeError:  # (metadata that cannot be a key, a list: the block is made for this call)
            block = key = None
        if block is None:
            md = tuple(metadata)
            if timeout is not None:
                md += (("grpc-timeout", grpc_timeout(timeout)),)
            block = self._block(path, md)
            if key is not None:
                if len(self.blocks) >= MAX_BLOCKS:  # (metadata or timeouts that change per call: start afresh)
                    self.blocks.clear()
                self.blocks[key] = block
        st = self._stream(messages.append, on_close)
        if timeout is not None:  # (_on_deadlines ends the call with DEADLINE_EXCEEDED when it is due)
            st.due = due = self.loop.time() + timeout
            self.deadlines.add(due)
        n = len(block)
        # (HEADERS and DATA: one buffer; a block larger than a frame as _headers splits it)
        st.send(payload, True, FRAME_HEADER.pack(0, n, HEADERS, END_HEADERS, st.sid) + block
                if n <= MIN_MAX_FRAME else self._headers(st.sid, 0, block))
        try:
            code, details = await fut
        except asyncio.CancelledError:
            st.cancel()
            raise
        if code:
            raise GrpcError(code, details)
        if len(messages) != 1:
            raise GrpcError(Status.INTERNAL, f"a unary call answered {len(messages)} messages")
        return messages[0]

    def _expire(self, st: ClientStream) -> None:
        """A unary call past its deadline (H2Endpoint._on_deadlines): cancelled (RST_STREAM), it
        ends with DEADLINE_EXCEEDED."""
        st.cancel()
        st.on_close(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ---- frames from the server ------------------------------------------------------------
    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        super()._on_settings(flags, sid, payload)
        if not flags & ACK and self.settled is not None and not self.settled.done():
            self.settled.set_result(None)

    def _end(self, st: ClientStream, code: int, details: str) -> None:
        if st.closed:
            return
        st.closed = True
        self.streams.pop(st.sid, None)
        self.blocked.discard(st)
        self._discard_out(st)
        if self.slot_waiters:
            self._free_slots(1)
        try:
            st.on_close(code, details)
        except Exception:  # one stream's callback must not keep the others from ending
            log.exception("on_close callback failed")

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        st = self.streams.get(sid)
        block = self._fragment(flags, payload) if flags & (PADDED | PRIORITY_FLAG) else payload
        if st is None:  # a stream we cancelled: keep the HPACK table in step
            if sid % 2 == 0 or sid >= self.next_sid:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on unknown stream {sid}")
            st = ClientStream(self, sid, lambda m: None, lambda c, d: None)
            st.closed = True
        if flags & END_HEADERS:  # (the common case of _header_block, inlined)
            self._headers_complete(st, flags, block)
        else:
            self._header_block(st, flags, block)

    def _headers_complete(self, st: ClientStream, flags: int, block: bytes) -> None:
        parsed = self.hcache.get(block) or self._decode(block, _parse_response_headers)
        if st.closed:
            return
        status, code, message, encoding = parsed
        if not st.got_headers:
            st.got_headers = True
            st.encoding = encoding
            if status != 200:
                self._end(st, _HTTP_TO_GRPC.get(status or 0, Status.UNKNOWN), f"HTTP status {status} from the server")
                return
        if code is not None or flags & END_STREAM:
            if code is None:
                code, message = Status.INTERNAL, "stream ended without grpc-status"
            self._end(st, code, message)

    def _on_data(self, flags: int, sid: int, data: bytes, start: int, end: int) -> None:
        st = self.streams.get(sid)
        if st is None or st.closed:
            self._replenish(None, end - start, True)
            return
        # (_replenish and _unpad inline: one response frame per request at concurrency 1)
        length = end - start
        self._release(length)
        st.recv_unacked += length
        if st.recv_unacked >= LOCAL_STREAM_WINDOW // 2 and not flags & END_STREAM:
            self._credit_stream(st, 0, False)  # (the stream's window update, as _replenish gives it)
        if flags & PADDED:
            start, end = self._unpad(flags, data, start, end)
        buf = st.buf
        if not buf and end - start >= 5 and int.from_bytes(data[start + 1:start + 5], "big") == end - start - 5 \
                and not data[start]:
            st.on_message(data[start + 5:end])  # one whole message in the frame: no buffering
        elif start < end:
            buf += memoryview(data)[start:end]
            pos = 0
            while len(buf) - pos >= 5:
                size = int.from_bytes(buf[pos + 1:pos + 5], "big")
                if size > self.max_receive:
                    self._end(st, Status.RESOURCE_EXHAUSTED,
                              f"response message larger than max ({size} vs. {self.max_receive})")
                    self._write(frame(RST_STREAM, 0, st.sid, U32.pack(ErrorCode.CANCEL)))
                    st.buf = bytearray()
                    return
                if len(buf) - pos - 5 < size:
                    break
                msg = bytes(buf[pos + 5:pos + 5 + size])
                if buf[pos]:
                    try:
                        msg = zlib.decompress(msg, 16 + zlib.MAX_WBITS if st.encoding == b"gzip" else zlib.MAX_WBITS)
                    except zlib.error as exc:
                        self._end(st, Status.INTERNAL, f"cannot decompress a response: {exc}")
                        self._write(frame(RST_STREAM, 0, st.sid, U32.pack(ErrorCode.CANCEL)))
                        return
                pos += 5 + size
                st.on_message(msg)
                if st.closed:
                    return
            if pos:
                del buf[:pos]
        if flags & END_STREAM and not st.closed:
            self._end(st, Status.INTERNAL, "stream ended without trailers")

    def _on_reset(self, sid: int, code: int) -> None:
        st = self.streams.get(sid)
        if st is not None:
            what = "refused the stream" if code == ErrorCode.REFUSED_STREAM else f"reset the stream (HTTP/2 error {code})"
            self._end(st, Status.UNAVAILABLE, f"{self.authority.decode()} {what}")

    def _on_goaway(self, last_sid: int, code: int) -> None:
        self.going_away = True
        for sid, st in list(self.streams.items()):
            if sid > last_sid:
                self._end(st, Status.UNAVAILABLE, f"{self.authority.decode()} is going away (stream not processed)")

    def _closed(self, st: Any) -> None:  # we never send END_STREAM HEADERS from the client
        pass


async def connect(endpoint: str, timeout: float = 5.0, ssl_context: ssl.SSLContext | None = None
                  ) -> H2ClientConnection:
    """Open an HTTP/2 connection to `host:port`: prior knowledge, or over TLS with `ssl_context`
    (ALPN h2; the certificate checked against `host`)."""
    endpoint = endpoint.removeprefix("dns:///")  # also the :authority, which must not carry it
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    loop = asyncio.get_running_loop()
    tls: dict[str, Any] = {} if ssl_context is None else {
        "ssl": ssl_context, "server_hostname": host or "127.0.0.1", "ssl_handshake_timeout": timeout}
    proto = H2ClientConnection(endpoint)
    # (over TLS a buffered protocol in front: no 256 KiB allocation per read, meshserve/server/tls.py:Reader)
    factory = (lambda: proto) if ssl_context is None else (lambda: Reader(proto))
    try:
        await asyncio.wait_for(loop.create_connection(factory, host or "127.0.0.1", int(port), **tls), timeout)
    except (OSError, TimeoutError) as exc:
        # (its traceback holds asyncio.wait_for's frame, whose future holds the error: a cycle
        # only the collector frees, keeping this frame and the connection's protocol alive per
        # failed connect to a replica that is down; the caller reports the error, not where it came from)
        exc.__traceback__ = None
        raise
    proto.join_writes = ssl_context is not None  # (one TLS record per flush: H2Endpoint.join_writes)
    # Streams wait for the server's SETTINGS (its MAX_CONCURRENT_STREAMS above all): a burst of
    # calls on a new connection would otherwise be refused past that limit.
    if proto.settled is not None:
        try:
            await asyncio.wait_for(asyncio.shield(proto.settled), timeout)
        except TimeoutError:
            proto.close()
            raise ConnectionError(f"{endpoint} sent no HTTP/2 SETTINGS within {timeout} s") from None
        if proto.closed:  # (a server that died between the TCP handshake and its SETTINGS)
            raise ConnectionError(f"{endpoint} closed the connection before its HTTP/2 SETTINGS")
    return proto


class Channel:
    """A lazily connected, reconnected-when-broken client connection to one endpoint."""

    def __init__(self, endpoint: str, connect_timeout: float = 5.0, ssl_context: ssl.SSLContext | None = None):
        self.endpoint = endpoint
        self.connect_timeout = connect_timeout
        self.ssl_context = ssl_context  # TLS (meshserve/server/tls.py:UpstreamTls), else prior knowledge
        self._conn: H2ClientConnection | None = None
        self._lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        """Whether the connection is up (no connection attempt is made)."""
        return self._conn is not None and self._conn.usable

    async def get(self) -> H2ClientConnection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        async with self._lock:
            conn = self._conn
            if conn is None or not conn.usable:
                tls = () if self.ssl_context is None else (self.ssl_context,)
                conn = self._conn = await connect(self.endpoint, self.connect_timeout, *tls)
            return conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
