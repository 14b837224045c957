"""A compact gRPC server over HTTP/2 on asyncio: the front door of the gateway and services.

Why not grpc.aio: on this project's 2-core target a grpc.aio unary call costs 200-370 µs of
server CPU (call objects, a poller thread handing every completion to the loop across the
GIL), more than all of Triton spends on an inference. A frame loop written for unary and
streaming gRPC on an asyncio Protocol costs 60-90 µs per call for the same work (see
load/results and docs/gateway.md "gRPC ingress"). grpc.aio stays available
(`MESHSERVE_GRPC_SERVER=aio`) and the gRPC *clients* (gateway → service) are unchanged.

Scope (what gRPC clients need, RFC 9113 + the gRPC HTTP/2 mapping):
- prior-knowledge HTTP/2 (no TLS, no h2c upgrade), SETTINGS/PING/GOAWAY/RST_STREAM,
  HEADERS + CONTINUATION, padding, flow control in both directions (large messages are
  split by the peer's MAX_FRAME_SIZE and windows; sends wait for WINDOW_UPDATE);
- HPACK decoding with the `hpack` package (dynamic table, Huffman); responses are encoded as
  literals without indexing, so there is no encoder state to keep in step with the peer;
- gRPC: length-prefixed messages, `grpc-timeout` (deadline enforced: DEADLINE_EXCEEDED and the
  handler cancelled), `grpc-encoding` gzip/deflate on requests (responses go uncompressed),
  `-bin` metadata, trailers-only errors, percent-encoded `grpc-message`;
- handlers are the same `grpc.RpcMethodHandler` objects grpc.aio takes (all four call shapes,
  async functions / async generators), with a context offering what grpc.aio's does for
  them: metadata, time_remaining, set_code/set_details, abort, trailing metadata, peer.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import functools
import inspect
import logging
import struct
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NamedTuple

import grpc
import hpack

log = logging.getLogger("meshserve.grpc.h2")
logging.getLogger("hpack").setLevel(logging.WARNING)  # it logs every header it decodes at DEBUG

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
END_DATA = -1  # in a stream's send queue: an empty DATA frame with END_STREAM (client half-close)
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 6, 7, 8, 9

# Our receive side: big windows (replenished as data arrives) and frames up to 1 MiB, so a
# large tensor arrives in few frames; the peer's limits govern what we send.
LOCAL_STREAM_WINDOW = 1 << 24
STREAM_BACKLOG = LOCAL_STREAM_WINDOW // 2  # request streaming: messages a handler may leave unread
# ... and at most this many of them (a flood of empty messages is bytes-cheap, each one not)
STREAM_MAX_QUEUED = 4096
LOCAL_CONN_WINDOW = 1 << 30
LOCAL_MAX_FRAME = 1 << 20
LOCAL_HEADER_TABLE = 4096
MAX_HEADER_BLOCK = 1 << 20
DEFAULT_WINDOW = 65535

_FH = struct.Struct(">BHBBI")  # 24-bit length as (hi byte, lo short), type, flags, stream id
_U32 = struct.Struct(">I")
_MSG = struct.Struct(">BI")


def _frame(typ: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FH.pack(n >> 16, n & 0xFFFF, typ, flags, sid) + payload


def _frame_header(typ: int, flags: int, sid: int, n: int) -> bytes:
    return _FH.pack(n >> 16, n & 0xFFFF, typ, flags, sid)


def _hpack_int(n: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes((n,))
    out = bytearray((limit,))
    n -= limit
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


_STATIC = hpack.table.HeaderTable.STATIC_TABLE  # RFC 7541 Appendix A, index 1..61


def _read_int(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer (RFC 7541 5.1) starting at block[i]: (value, next offset)."""
    limit = (1 << prefix_bits) - 1
    n = block[i] & limit
    i += 1
    if n < limit:
        return n, i
    shift = 0
    while True:
        b = block[i]  # IndexError on a truncated block: the caller falls back to hpack
        i += 1
        n += (b & 127) << shift
        if b < 128:
            return n, i
        shift += 7
        if shift > 28:
            raise IndexError("HPACK integer too long")


def _plain_decode(block: bytes) -> list[tuple[bytes, bytes]] | None:
    """Decode a header block made only of representations that leave the dynamic table alone
    and need no Huffman table: static-table indexes and literals without indexing / never
    indexed with plain strings (what meshserve itself sends, e.g. trailers carrying a
    traceparent). None for anything else, which the hpack decoder then handles: a block
    like that is usually unique, so it would miss the cache and cost a pure-Python decode."""
    out = []
    i = 0
    end = len(block)
    size = 0
    try:
        while i < end:
            b = block[i]
            if b & 0x80:  # indexed field
                index, i = _read_int(block, i, 7)
                if not 0 < index <= 61:
                    return None
                field = _STATIC[index - 1]
            elif b & 0xE0 == 0:  # literal without indexing (0000) or never indexed (0001)
                index, i = _read_int(block, i, 4)
                if index:
                    if index > 61:
                        return None
                    name = _STATIC[index - 1][0]
                else:
                    if block[i] & 0x80:
                        return None  # Huffman-coded name
                    n, i = _read_int(block, i, 7)
                    name = block[i:i + n]
                    i += n
                if block[i] & 0x80:
                    return None  # Huffman-coded value
                n, i = _read_int(block, i, 7)
                field = (name, block[i:i + n])
                i += n
                if i > end:
                    return None
            else:  # incremental indexing or a table size update: changes the dynamic table
                return None
            size += len(field[0]) + len(field[1]) + 32
            if size > MAX_HEADER_BLOCK:
                return None
            out.append(field)
    except IndexError:
        return None
    return out


_TRACE_FIELD = b"traceparent"  # a header field whose value is new on every request or response


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name (RFC 7541 6.2.2): stateless."""
    return b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value


_STATUS_200 = b"\x88"  # static table index 8 = ":status: 200"
RESPONSE_HEADERS = (_STATUS_200 + _literal(b"content-type", b"application/grpc")
                    + _literal(b"grpc-accept-encoding", b"identity,deflate,gzip"))
TRAILERS_OK = _literal(b"grpc-status", b"0")

_TIMEOUT_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6, ord("n"): 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """`grpc-timeout` ("100m", "5S", ...) in seconds; None when malformed."""
    if len(value) < 2 or len(value) > 9:
        return None
    unit = _TIMEOUT_UNITS.get(value[-1])
    digits = value[:-1]
    if unit is None or not digits.isdigit():
        return None
    return int(digits) * unit


def percent_encode(message: str) -> bytes:
    """grpc-message encoding: bytes outside printable ASCII, and '%', as %XX (of UTF-8)."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def _md_value(key: str, value: Any) -> bytes:
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else str(value).encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value if isinstance(value, bytes) else str(value).encode()


_STATUS_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


@functools.lru_cache(maxsize=1024)  # rejections repeat the same few messages
def _status_block(code: int, details: str | None) -> bytes:
    block = TRAILERS_OK if code == 0 else _literal(b"grpc-status", str(code).encode())
    if code and not details:  # an error always says something: a client shows only this text
        details = f"{_STATUS_NAMES.get(code, f'gRPC status {code}')} (the server gave no details)"
    if details:
        block += _literal(b"grpc-message", percent_encode(details[:4096]))
    return block


def _trailers_block(code: int, details: str | None, metadata: Iterable[tuple[str, Any]] = ()) -> bytes:
    block = _status_block(code, details)
    for k, v in metadata:
        block += _literal(k.lower().encode(), _md_value(k, v))
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


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, Any], ...]


_EOF = object()


class _Stream:
    __slots__ = ("sid", "path", "metadata", "deadline", "encoding", "buf", "queue", "task", "send_window",
                 "out", "remote_ended", "closed", "recv_unacked", "handler", "headers_sent", "timer",
                 "header_block", "header_flags", "cancelled", "queued", "owed", "parked")

    def __init__(self, sid: int, send_window: int):
        self.sid = sid
        self.send_window = send_window
        self.path = ""
        self.metadata: tuple[tuple[str, Any], ...] = ()
        self.deadline: float | None = None
        self.encoding: bytes | None = None
        self.buf = bytearray()
        self.queue: asyncio.Queue[Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self.out: collections.deque[tuple[int, Any]] = collections.deque()
        self.remote_ended = False
        self.closed = False
        self.recv_unacked = 0
        self.queued = 0  # request streaming: wire bytes of messages queued, not yet taken by the handler
        self.owed = 0  # request streaming: bytes received and not yet given back to the window
        self.parked = False  # request streaming: STREAM_MAX_QUEUED queued; what follows waits in buf
        self.handler: grpc.RpcMethodHandler | None = None
        self.headers_sent = False
        self.timer: asyncio.TimerHandle | None = None
        self.header_block: bytearray | None = None
        self.header_flags = 0
        self.cancelled = False  # ended by RST_STREAM, a lost connection or the deadline


class ServicerContext:
    """What our handlers (and most grpc.aio handlers) use of grpc.aio.ServicerContext."""

    __slots__ = ("_conn", "_st", "_code", "_details", "_trailing", "_initial", "_callbacks")

    def __init__(self, conn: _Connection, st: _Stream):
        self._conn = conn
        self._st = st
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None
        self._trailing: tuple[tuple[str, Any], ...] = ()
        self._initial: tuple[tuple[str, Any], ...] = ()
        self._callbacks: list[Callable[[Any], None]] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._st.metadata

    def time_remaining(self) -> float | None:
        d = self._st.deadline
        return None if d is None else max(0.0, d - time.monotonic())

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailing

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        if self._st.headers_sent:
            raise RuntimeError("initial metadata already sent")
        self._initial = tuple(metadata)
        self._conn._send_headers(self._st, self._initial)

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Iterable[tuple[str, Any]] = ()) -> None:
        if code == grpc.StatusCode.OK:
            raise ValueError("abort() needs a non-OK status code")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError(f"aborted: {code}")

    async def write(self, message: Any) -> None:
        handler = self._st.handler
        ser = handler.response_serializer if handler is not None else None
        self._conn._send_message(self._st, ser(message) if ser else message)

    def peer(self) -> str:
        peer = self._conn.peername
        if not isinstance(peer, tuple):
            return str(peer)
        return f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}"

    def cancelled(self) -> bool:
        return self._st.cancelled

    def done(self) -> bool:
        return self._st.closed

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)

    def auth_context(self) -> dict[str, Any]:
        return {}

    def set_compression(self, compression: Any) -> None:  # responses stay uncompressed
        pass

    def disable_next_message_compression(self) -> None:
        pass


class H2Endpoint(asyncio.Protocol):
    """HTTP/2 framing shared by our server and client connections: the frame loop, SETTINGS,
    PING, flow control both ways, CONTINUATION, write batching. Subclasses handle HEADERS,
    DATA, RST_STREAM and GOAWAY for their side of the streams."""

    expect_preface = False

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peername: Any = None
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_BLOCK)
        self.decoder.max_allowed_table_size = LOCAL_HEADER_TABLE
        self.streams: dict[int, Any] = {}
        self.preface = not self.expect_preface
        self.chunks: list[bytes] = []
        self.chunks_len = 0
        self.need = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16384
        self.send_window = DEFAULT_WINDOW
        self.recv_unacked = 0
        self.last_sid = 0
        self.wbuf: list[bytes] = []
        self.flush_scheduled = False
        self.blocked: set[Any] = set()
        self.going_away = False
        self.continuation: Any = None
        self.closed = False
        self.hcache: dict[bytes, tuple[Any, ...]] = {}

    def _preamble(self) -> bytes:
        """Our SETTINGS and a connection window big enough for large tensors."""
        settings = b"".join(struct.pack(">HI", k, v) for k, v in (
            (0x1, LOCAL_HEADER_TABLE), (0x2, 0), (0x4, LOCAL_STREAM_WINDOW), (0x5, LOCAL_MAX_FRAME)))
        return (_frame(SETTINGS, 0, 0, settings)
                + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(LOCAL_CONN_WINDOW - DEFAULT_WINDOW)))

    # hooks for the two sides
    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        raise NotImplementedError

    def _headers_complete(self, st: Any, flags: int, block: bytes) -> None:
        raise NotImplementedError

    def _on_data(self, flags: int, sid: int, data: bytes, start: int, end: int) -> None:
        raise NotImplementedError

    def _on_reset(self, sid: int, code: int) -> None:
        raise NotImplementedError

    def _on_goaway(self, last_sid: int, code: int) -> None:
        self.going_away = True

    def _closed(self, st: Any) -> None:
        """The stream's final frame (END_STREAM HEADERS) was written."""
        raise NotImplementedError

    def _replenish(self, st: Any, length: int, ended: bool) -> None:
        """Receive-side flow control: give back what a DATA frame used, in big increments."""
        self.recv_unacked += length
        if self.recv_unacked >= LOCAL_CONN_WINDOW // 2:
            self.wbuf.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_unacked = 0
        if st is not None:
            self._credit_stream(st, length, ended)

    def _credit_stream(self, st: Any, length: int, ended: bool) -> None:
        """Give ``length`` bytes back to a stream's window, in big increments (none once ended)."""
        st.recv_unacked += length
        if not ended and st.recv_unacked >= LOCAL_STREAM_WINDOW // 2:
            self._write(_frame(WINDOW_UPDATE, 0, st.sid, _U32.pack(st.recv_unacked)))
            st.recv_unacked = 0

    def _fragment(self, flags: int, payload: bytes) -> bytes:
        """The header block fragment of a HEADERS frame: without padding and priority fields."""
        start, end = self._unpad(flags, payload, 0, len(payload))
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        return payload[start:end]

    @staticmethod
    def _unpad(flags: int, data: bytes, start: int, end: int) -> tuple[int, int]:
        if flags & PADDED:
            if end == start or data[start] >= end - start:
                raise _ConnectionError(PROTOCOL_ERROR, "padding exceeds the frame")
            return start + 1, end - data[start]
        return start, end

    # ---- reading ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.chunks:
            self.chunks.append(data)
            self.chunks_len += len(data)
            if self.chunks_len < self.need:
                return
            data = b"".join(self.chunks)
            self.chunks.clear()
            self.chunks_len = 0
        try:
            pos = 0
            if not self.preface:
                if len(data) < 24:
                    if not PREFACE.startswith(data):
                        raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge connection")
                    self._keep(data, 24)
                    return
                if data[:24] != PREFACE:
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge connection")
                self.preface = True
                pos = 24
            n = len(data)
            while n - pos >= 9:
                hi, lo, typ, flags, sid = _FH.unpack_from(data, pos)
                length = hi << 16 | lo
                end = pos + 9 + length
                if length > LOCAL_MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {LOCAL_MAX_FRAME}")
                if end > n:
                    break
                sid &= 0x7FFFFFFF
                if self.continuation is not None and typ != CONTINUATION:
                    raise _ConnectionError(PROTOCOL_ERROR, "expected CONTINUATION")
                if typ == DATA:
                    self._on_data(flags, sid, data, pos + 9, end)
                elif typ == HEADERS:
                    self._on_headers(flags, sid, data[pos + 9:end])
                elif typ == CONTINUATION:
                    self._on_continuation(flags, sid, data[pos + 9:end])
                elif typ == SETTINGS:
                    self._on_settings(flags, sid, data[pos + 9:end])
                elif typ == WINDOW_UPDATE:
                    self._on_window_update(sid, data[pos + 9:end])
                elif typ == PING:
                    if length != 8:
                        raise _ConnectionError(FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
                    if not flags & ACK:
                        self.wbuf.append(_frame(PING, ACK, 0, data[pos + 9:end]))
                elif typ == RST_STREAM:
                    if length != 4:
                        raise _ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
                    self._on_reset(sid, _U32.unpack_from(data, pos + 9)[0])
                elif typ == GOAWAY:
                    if length < 8:
                        raise _ConnectionError(FRAME_SIZE_ERROR, "GOAWAY payload too short")
                    self._on_goaway(_U32.unpack_from(data, pos + 9)[0] & 0x7FFFFFFF,
                                    _U32.unpack_from(data, pos + 13)[0])
                elif typ == PUSH_PROMISE:
                    raise _ConnectionError(PROTOCOL_ERROR, "clients must not push")
                # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)
                pos = end
            if pos < n:
                rest = data[pos:]
                need = 9
                if len(rest) >= 9:
                    hi, lo = rest[0], int.from_bytes(rest[1:3], "big")
                    need = 9 + (hi << 16 | lo)
                self._keep(rest, need)
        except _ConnectionError as exc:
            self._fatal(exc.code, str(exc))
            return
        except Exception as exc:  # never let one connection's bug take the loop down
            log.exception("HTTP/2 connection error")
            self._fatal(INTERNAL_ERROR, f"internal error: {exc}")
            return
        self._flush()

    def _keep(self, data: bytes, need: int) -> None:
        self.chunks = [data]
        self.chunks_len = len(data)
        self.need = need

    def _fatal(self, code: int, message: str) -> None:
        log.debug("closing HTTP/2 connection from %s: %s", self.peername, message)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(code)
                                        + message.encode()[:256]))
            self.transport.close()

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        grown = False
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x4:
                if value > 0x7FFFFFFF:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for st in self.streams.values():
                    st.send_window += delta
                grown = grown or delta > 0
            elif key == 0x5:
                if not 16384 <= value <= 16777215:
                    raise _ConnectionError(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
        # The ACK goes out before any DATA the new settings allow: grpc core (and h2) count a
        # larger INITIAL_WINDOW_SIZE only once it is acknowledged, and grpc fails the stream
        # ("frame of size N overflows local window") on DATA that arrives before the ACK.
        self.wbuf.append(_frame(SETTINGS, ACK, 0))
        if grown:
            self._unblock_all()

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0 or self.send_window + inc > 0x7FFFFFFF:
                raise _ConnectionError(PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR,
                                       "invalid connection WINDOW_UPDATE")
            self.send_window += inc
            self._unblock_all()
            return
        st = self.streams.get(sid)
        if st is not None:
            st.send_window += inc
            if st in self.blocked:
                self.blocked.discard(st)
                self._drain(st)

    def _unblock_all(self) -> None:
        if self.blocked:
            waiting = list(self.blocked)
            self.blocked.clear()
            for st in waiting:
                self._drain(st)

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        st = self.continuation
        if st is None or st.sid != sid or st.header_block is None:
            raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION")
        st.header_block += payload
        if len(st.header_block) > MAX_HEADER_BLOCK:
            raise _ConnectionError(PROTOCOL_ERROR, "header block too large")
        if flags & END_HEADERS:
            self.continuation = None
            block, st.header_block = bytes(st.header_block), None
            self._headers_complete(st, st.header_flags, block)

    def _header_block(self, st: Any, flags: int, block: bytes) -> None:
        """A HEADERS frame's fragment: complete, or the start of a CONTINUATION sequence."""
        if not flags & END_HEADERS:
            st.header_block = bytearray(block)
            st.header_flags = flags
            self.continuation = st
            return
        self._headers_complete(st, flags, block)

    def _decode(self, block: bytes, parse: Callable[[Any], tuple[Any, ...]]
                ) -> tuple[Any, ...]:
        """HPACK-decode a header block and `parse` it. A block that leaves the dynamic table as
        it was (a repeat request whose fields are all indexed: every gRPC call after the first
        on a connection) is cached, and the cache is dropped whenever a block changes the
        table, since indexes then shift."""
        plain = _plain_decode(block)
        if plain is not None:  # the table is untouched: no need for the hpack decoder
            parsed = parse(plain)
            self._cache(block, parsed)
            return parsed
        table = self.decoder.header_table.dynamic_entries
        before = (len(table), table[0] if table else None)
        try:
            headers = self.decoder.decode(block, raw=True)
        except Exception as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"HPACK: {exc}") from None
        parsed = parse(headers)
        if len(table) != before[0] or (table[0] if table else None) is not before[1]:
            self.hcache.clear()
        else:
            self._cache(block, parsed)
        return parsed

    def _cache(self, block: bytes, parsed: tuple[Any, ...]) -> None:
        if _TRACE_FIELD in block:  # a trace id each (a sampled response's trailers): never repeats
            return
        if len(self.hcache) >= 256:  # other one-off blocks: start afresh
            self.hcache.clear()
        self.hcache[block] = parsed

    # ---- writing (flow-controlled) ---------------------------------------------------------
    def _headers(self, sid: int, flags: int, block: bytes) -> bytes:
        """A header block as HEADERS (+ CONTINUATION) frames no larger than the peer's
        MAX_FRAME_SIZE (RFC 9113 4.2, 6.10). `flags` may hold END_STREAM; END_HEADERS goes on
        the last frame. The frames must be written together (nothing may come between them)."""
        limit = self.peer_max_frame
        if len(block) <= limit:
            return _frame(HEADERS, flags | END_HEADERS, sid, block)
        last = (len(block) - 1) // limit * limit  # offset of the final piece
        return b"".join([_frame(HEADERS, flags & ~END_HEADERS, sid, block[:limit])]
                        + [_frame(CONTINUATION, END_HEADERS if i == last else 0, sid, block[i:i + limit])
                           for i in range(limit, len(block), limit)])

    def _drain(self, st: Any) -> None:
        out = st.out
        while out:
            kind, item = out[0]
            if kind == HEADERS:
                out.popleft()
                self._write(self._headers(st.sid, END_STREAM, item))
                self._closed(st)
                return
            if kind == END_DATA:
                out.popleft()
                self._write(_frame(DATA, END_STREAM, st.sid))
                continue
            size = len(item)
            while size:
                n = min(size, self.send_window, st.send_window, self.peer_max_frame)
                if n <= 0:
                    self.blocked.add(st)
                    self._schedule_flush()
                    return
                self.send_window -= n
                st.send_window -= n
                self._write(_frame_header(DATA, 0, st.sid, n))
                if n == size:
                    self._write(item)
                    size = 0
                else:
                    mv = memoryview(item)
                    self._write(mv[:n])
                    item = mv[n:]
                    size -= n
                    out[0] = (DATA, item)
            out.popleft()

    def _write(self, data: bytes | memoryview) -> None:
        self.wbuf.append(data)  # type: ignore[arg-type]
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if self.wbuf:
            buf, self.wbuf = self.wbuf, []
            if self.transport is not None and not self.transport.is_closing():
                self.transport.writelines(buf)


class _Connection(H2Endpoint):
    """The server side of one client connection."""

    expect_preface = True

    def __init__(self, server: H2GrpcServer):
        super().__init__()
        self.server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self.peername = transport.get_extra_info("peername")
        self.server._conns.add(self)
        transport.write(self._preamble())  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server._conns.discard(self)
        for st in list(self.streams.values()):
            self._abandon(st)
        self.streams.clear()
        self.blocked.clear()

    def _abandon(self, st: _Stream) -> None:
        """The peer is gone or reset the stream: stop its work, send nothing more."""
        if st.closed:
            return
        st.closed = st.cancelled = True
        if st.timer is not None:
            st.timer.cancel()
        if st.task is not None and not st.task.done():
            st.task.cancel()
        if st.queue is not None:
            st.queue.put_nowait(_EOF)
        self.blocked.discard(st)
        if st.handler is not None:
            self.server._stream_done()

    def _on_reset(self, sid: int, code: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            self._abandon(st)

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        block = self._fragment(flags, payload)
        st = self.streams.get(sid)
        if st is None:
            if sid <= self.last_sid:
                # a late frame for a stream we already finished: trailers from a client are
                # not expected in gRPC; decode to keep the HPACK table in step, then ignore
                if flags & END_HEADERS:
                    self._decode(bytes(block), _parse_request_headers)
                    return
                st = _Stream(sid, 0)
                st.closed = True
            else:
                self.last_sid = sid
                st = _Stream(sid, self.peer_initial_window)
                self.streams[sid] = st
        self._header_block(st, flags, block)

    def _headers_complete(self, st: _Stream, flags: int, block: bytes) -> None:
        parsed = self.hcache.get(block) or self._decode(block, _parse_request_headers)
        if st.closed:
            return
        if st.handler is not None or st.path:  # trailers from the client: end of its stream
            if flags & END_STREAM:
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
            self.wbuf.append(_frame(RST_STREAM, 0, st.sid, _U32.pack(REFUSED_STREAM)))
            return
        if method != b"POST" or ctype is None or not ctype.startswith(b"application/grpc"):
            self._finish_http(st, b"415" if method == b"POST" else b"405")
            return
        st.path = path
        handler = self.server._lookup(path, st.metadata)
        if handler is None:
            self._finish(st, grpc.StatusCode.UNIMPLEMENTED.value[0], f"Method not found: {st.path}")
            return
        if st.encoding not in (None, b"identity", b"gzip", b"deflate"):
            self._finish(st, grpc.StatusCode.UNIMPLEMENTED.value[0],
                         f"compression {st.encoding.decode('latin-1')} is not supported (identity, gzip, deflate)")
            return
        st.handler = handler
        self.server._stream_started()
        if st.deadline is not None:
            st.timer = self.loop.call_at(self.loop.time() + max(0.0, st.deadline - time.monotonic()),
                                         self._expire, st)
        if handler.request_streaming:
            st.queue = asyncio.Queue()
            st.task = self.loop.create_task(self._run(st, None))
        if flags & END_STREAM:
            self._remote_end(st)

    def _on_data(self, flags: int, sid: int, data: bytes, start: int, end: int) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        st = self.streams.get(sid)
        if st is None or st.closed or st.handler is None:  # refused or already answered: drop
            self._replenish(None, end - start, True)
            return
        if st.queue is None:  # unary: the whole message is taken at the end, give the window back now
            self._replenish(st, end - start, bool(flags & END_STREAM))
        else:  # request streaming: the stream's window comes back unless its handler lags (_settle)
            self._replenish(None, end - start, True)
            st.owed += end - start
        start, end = self._unpad(flags, data, start, end)
        if (flags & END_STREAM and st.queue is None and not st.buf and end - start >= 5
                and _U32.unpack_from(data, start + 1)[0] == end - start - 5):
            # the common unary case: the whole message in one frame; one copy, no buffering
            st.remote_ended = True
            if end - start - 5 > self.server.max_receive:
                self._fail_too_large(st, end - start - 5)
                return
            self._start_unary(st, data[start + 5:end], data[start])
            return
        if start < end:
            st.buf += memoryview(data)[start:end]
            if not self._messages(st):
                return
        if st.queue is not None:
            self._settle(st)
        if flags & END_STREAM:
            self._remote_end(st)

    def _messages(self, st: _Stream) -> bool:
        """Move complete messages out of the stream buffer (into its queue, for request-streaming
        calls). False when the stream was failed (message too large, bad compression)."""
        buf = st.buf
        if st.queue is None:  # unary request: only the size check, the message is taken at the end
            if len(buf) >= 5:
                size = _U32.unpack_from(buf, 1)[0]
                if size > self.server.max_receive:
                    self._fail_too_large(st, size)
                    return False
            return True
        pos = 0
        queue = st.queue
        st.parked = False
        while len(buf) - pos >= 5:
            if queue.qsize() >= STREAM_MAX_QUEUED:  # the rest stays raw until the handler reads on
                st.parked = True
                break
            compressed, size = _MSG.unpack_from(buf, pos)
            if size > self.server.max_receive:
                self._fail_too_large(st, size)
                return False
            if len(buf) - pos - 5 < size:
                break
            msg = bytes(buf[pos + 5:pos + 5 + size])
            pos += 5 + size
            if compressed:
                plain = self._decompress(st, msg)
                if plain is None:
                    return False
                msg = plain
            queue.put_nowait((msg, 5 + size))
            st.queued += 5 + size
        if pos:
            del buf[:pos]
        return True

    def _settle(self, st: _Stream) -> None:
        """Give a request-streaming call's received bytes back to its window (in big increments),
        unless its handler has more than STREAM_BACKLOG bytes, or STREAM_MAX_QUEUED messages,
        not yet taken: then the client is stopped once its window is spent, and goes on as the
        handler catches up. A message larger than the window still arrives: its partial bytes
        are no backlog."""
        if st.owed and not st.parked and st.queued <= STREAM_BACKLOG:
            owed, st.owed = st.owed, 0
            self._credit_stream(st, owed, st.remote_ended or st.closed)

    def _fail_too_large(self, st: _Stream, size: int) -> None:
        self._finish(st, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                     f"Received message larger than max ({size} vs. {self.server.max_receive})")

    def _decompress(self, st: _Stream, msg: bytes) -> bytes | None:
        """The decompressed message, bounded by max_receive_message_length like grpc's (never
        inflate more than the limit: a small gzip bomb must not reach the handler)."""
        limit = self.server.max_receive
        try:
            if st.encoding == b"gzip":
                d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif st.encoding == b"deflate":
                d = zlib.decompressobj()
            else:
                raise ValueError("compressed flag set without a grpc-encoding")
            plain = d.decompress(msg, limit + 1)
            if len(plain) > limit:
                self._finish(st, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                             f"Received message larger than max (decompressed over {limit} vs. {limit})")
                return None
            if not d.eof:
                raise zlib.error("incomplete or truncated stream")
            return plain
        except (zlib.error, ValueError) as exc:
            self._finish(st, grpc.StatusCode.INTERNAL.value[0], f"cannot decompress the request: {exc}")
            return None

    def _remote_end(self, st: _Stream) -> None:
        st.remote_ended = True
        if st.closed or st.handler is None:
            return
        if st.queue is not None:
            if st.parked:
                return  # messages still wait in buf: _requests ends the stream once they are queued
            if st.buf:
                self._finish(st, grpc.StatusCode.INTERNAL.value[0], "incomplete message at end of stream")
                return
            st.queue.put_nowait(_EOF)
            return
        buf = st.buf
        if len(buf) < 5 or len(buf) != 5 + _U32.unpack_from(buf, 1)[0]:
            self._finish(st, grpc.StatusCode.INTERNAL.value[0],
                         "a unary call needs exactly one request message")
            return
        st.buf = bytearray()
        self._start_unary(st, bytes(memoryview(buf)[5:]), buf[0])

    def _start_unary(self, st: _Stream, msg: bytes, compressed: int) -> None:
        """Run a unary-request call on its (size-checked) message."""
        if compressed:
            plain = self._decompress(st, msg)
            if plain is None:
                return
            msg = plain
        st.task = self.loop.create_task(self._run(st, msg))

    # ---- calling handlers ------------------------------------------------------------------
    async def _requests(self, st: _Stream) -> AsyncIterator[Any]:
        assert st.queue is not None and st.handler is not None
        deser = st.handler.request_deserializer
        while True:
            item = await st.queue.get()
            if item is _EOF:
                return
            msg, size = item
            st.queued -= size
            if st.parked and not st.closed:  # room in the queue: take messages still waiting in buf
                unparked = self._messages(st) and not st.parked
                if unparked and st.remote_ended:
                    self._remote_end(st)  # the last parked messages are queued: now the end of the stream
            self._settle(st)
            yield deser(msg) if deser else msg

    async def _run(self, st: _Stream, message: bytes | None) -> None:
        handler = st.handler
        assert handler is not None
        ctx = ServicerContext(self, st)
        try:
            if handler.request_streaming:
                request: Any = self._requests(st)
            else:
                try:
                    request = handler.request_deserializer(message) if handler.request_deserializer else message
                except Exception as exc:
                    self._finish(st, grpc.StatusCode.INTERNAL.value[0], f"Exception deserializing request: {exc}")
                    return
            fn = (handler.unary_unary or handler.stream_unary) if not handler.response_streaming else \
                (handler.unary_stream or handler.stream_stream)
            result = fn(request, ctx)
            ser = handler.response_serializer
            if handler.response_streaming:
                if hasattr(result, "__aiter__"):
                    try:
                        async for item in result:
                            if st.closed:
                                return
                            self._send_message(st, ser(item) if ser else item)
                            if len(st.out) > 64:  # the peer is not reading: wait for its window
                                await self._writable(st)
                    finally:
                        if hasattr(result, "aclose"):
                            await result.aclose()
                elif result is not None and not inspect.isawaitable(result):
                    for item in result:
                        self._send_message(st, ser(item) if ser else item)
                elif result is not None:
                    await result
                self._end(st, ctx)
                return
            if inspect.isawaitable(result):
                result = await result
            if st.closed:
                return
            code = ctx._code
            if code is None or code is grpc.StatusCode.OK:
                if result is None:
                    self._finish(st, grpc.StatusCode.INTERNAL.value[0], "handler returned no response")
                    return
                payload = ser(result) if ser else result
                self._reply(st, payload, ctx)
            else:
                self._end(st, ctx)
        except grpc.aio.AbortError:
            self._end(st, ctx)
        except asyncio.CancelledError:
            if not st.closed:
                self._finish(st, grpc.StatusCode.CANCELLED.value[0], "call cancelled")
            raise
        except Exception as exc:
            log.exception("error in gRPC handler for %s", st.path)
            self._finish(st, grpc.StatusCode.UNKNOWN.value[0], f"Unexpected {type(exc)}: {exc}")
        finally:
            if ctx._callbacks:
                for cb in ctx._callbacks:
                    try:
                        cb(ctx)
                    except Exception:  # noqa: BLE001 - a callback must not break the stream
                        log.exception("done callback failed")

    async def _writable(self, st: _Stream) -> None:
        while len(st.out) > 64 and not st.closed and not self.closed:
            await asyncio.sleep(0.005)

    def _expire(self, st: _Stream) -> None:
        st.timer = None
        if st.closed:
            return
        st.cancelled = True
        self._finish(st, grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")
        if st.task is not None and not st.task.done():
            st.task.cancel()
        self._flush()

    # ---- writing ---------------------------------------------------------------------------
    def _send_headers(self, st: _Stream, metadata: Iterable[tuple[str, Any]] = ()) -> None:
        block = RESPONSE_HEADERS
        for k, v in metadata:
            block += _literal(k.lower().encode(), _md_value(k, v))
        st.headers_sent = True
        self._write(self._headers(st.sid, 0, block))

    def _reply(self, st: _Stream, payload: bytes, ctx: ServicerContext) -> None:
        """Unary success: HEADERS, one message, trailers — one write when the windows allow."""
        n = len(payload) + 5
        trailers = _trailers_block(0, None, ctx._trailing) if ctx._trailing else TRAILERS_OK
        if (not st.headers_sent and not st.out and n <= self.send_window and n <= st.send_window
                and n <= self.peer_max_frame):
            self.send_window -= n
            st.send_window -= n
            st.headers_sent = True
            self._write(_frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS)
                        + _frame_header(DATA, 0, st.sid, n) + _MSG.pack(0, n - 5))
            self._write(payload)
            self._write(self._headers(st.sid, END_STREAM, trailers))
            self._closed(st)
            return
        self._send_message(st, payload)
        st.out.append((HEADERS, trailers))
        self._drain(st)

    def _send_message(self, st: _Stream, payload: bytes) -> None:
        if st.closed:
            return
        if not st.headers_sent:
            self._send_headers(st)
        st.out.append((DATA, _MSG.pack(0, len(payload))))
        if payload:
            st.out.append((DATA, memoryview(payload)))
        self._drain(st)

    def _end(self, st: _Stream, ctx: ServicerContext) -> None:
        code = ctx._code
        value = 0 if code is None else code.value[0]
        details = ctx._details if value else None
        if value and not st.headers_sent:
            self._finish(st, value, details, ctx._trailing)
            return
        if not st.headers_sent:
            self._send_headers(st)
        st.out.append((HEADERS, _trailers_block(value, details, ctx._trailing)))
        self._drain(st)

    def _finish(self, st: _Stream, code: int, details: str | None,
                metadata: Iterable[tuple[str, Any]] = ()) -> None:
        """Trailers-only response (an error before any message)."""
        if st.closed:
            return
        if st.headers_sent:
            st.out.append((HEADERS, _trailers_block(code, details, metadata)))
            self._drain(st)
            return
        st.headers_sent = True
        block = RESPONSE_HEADERS + _trailers_block(code, details, metadata)
        self._write(self._headers(st.sid, END_STREAM, block))
        self._closed(st)

    def _finish_http(self, st: _Stream, status: bytes) -> None:
        block = _literal(b":status", status) + _literal(b"content-type", b"text/plain")
        self._write(_frame(HEADERS, END_HEADERS | END_STREAM, st.sid, block))
        st.headers_sent = True
        self._closed(st)

    def _closed(self, st: _Stream) -> None:
        """Our side of the stream is finished (END_STREAM written)."""
        was_open = not st.closed
        st.closed = True
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        self.streams.pop(st.sid, None)
        self.blocked.discard(st)
        if not st.remote_ended:
            # the client is still sending (e.g. an early error): tell it to stop
            self._write(_frame(RST_STREAM, 0, st.sid, _U32.pack(NO_ERROR)))
            if st.queue is not None:
                st.queue.put_nowait(_EOF)
        if was_open and st.handler is not None:
            self.server._stream_done()
        if self.going_away and not self.streams and self.transport is not None:
            self._flush()
            self.transport.close()

    def goaway(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self._write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(NO_ERROR)))
        self._flush()
        if not self.streams:
            self.transport.close()


class H2GrpcServer:
    """Drop-in for the parts of grpc.aio.Server meshserve uses."""

    def __init__(self, max_receive_message_length: int = 2**31 - 1):
        self.max_receive = max_receive_message_length
        self._methods: dict[str, grpc.RpcMethodHandler | None] = {}
        self._generic: list[grpc.GenericRpcHandler] = []
        self._conns: set[_Connection] = set()
        self._servers: list[asyncio.Server] = []
        self._stopping = False
        self._active = 0
        self._idle: asyncio.Event | None = None

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, h in handlers.items():
            self._methods[f"/{service}/{name}"] = h

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)
        self._methods = {k: v for k, v in self._methods.items() if v is not None}

    def _lookup(self, path: str, metadata: tuple[tuple[str, Any], ...]) -> grpc.RpcMethodHandler | None:
        try:
            return self._methods[path]
        except KeyError:
            pass
        found = None
        for g in self._generic:
            found = g.service(_CallDetails(path, metadata))  # type: ignore[arg-type]
            if found is not None:
                break
        if len(self._methods) < 4096:  # bounded: unknown paths come from clients
            self._methods[path] = found
        return found

    def _stream_started(self) -> None:
        self._active += 1

    def _stream_done(self) -> None:
        self._active -= 1
        if self._active <= 0 and self._idle is not None:
            self._idle.set()

    async def bind(self, host: str, port: int) -> int:
        """Listen on host:port (0 = a free port, the same on every address of host)."""
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(lambda: _Connection(self), host or None, port, reuse_address=True,
                                       backlog=1024)
        ports = {s.getsockname()[1] for s in srv.sockets}
        if port == 0 and len(ports) > 1:
            srv.close()
            chosen = srv.sockets[0].getsockname()[1]
            srv = await loop.create_server(lambda: _Connection(self), host or None, chosen, reuse_address=True,
                                           backlog=1024)
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
