"""HTTP/2 frames, HPACK helpers and the gRPC wire constants shared by our server and client.

Everything here is stateless: frame builders, the table-neutral HPACK fast path, header
block literals, `grpc-timeout` parsing and the two code enums (HTTP/2 error codes, gRPC status
codes) that replace bare integers elsewhere in the package.
"""
from __future__ import annotations

import base64
import enum
import struct
from typing import Any

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
END_DATA = -1  # in a stream's send queue: an empty DATA frame with END_STREAM (client half-close)
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20


class ErrorCode(enum.IntEnum):
    """HTTP/2 error codes (RFC 9113 section 7), for RST_STREAM and GOAWAY."""

    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    CONNECT_ERROR = 10
    ENHANCE_YOUR_CALM = 11
    INADEQUATE_SECURITY = 12
    HTTP_1_1_REQUIRED = 13


class Status(enum.IntEnum):
    """gRPC status codes (the numbers of grpc.StatusCode, as plain ints on the wire)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# Our receive side: big windows (replenished as data arrives) and frames up to 1 MiB, so a
# large tensor arrives in few frames; the peer's limits govern what we send.
LOCAL_STREAM_WINDOW = 1 << 24
LOCAL_CONN_WINDOW = 1 << 30
LOCAL_MAX_FRAME = 1 << 20
LOCAL_HEADER_TABLE = 4096
MAX_HEADER_BLOCK = 1 << 20
# A server's bound on one request's header list (RFC 9113's SETTINGS_MAX_HEADER_LIST_SIZE, which
# it advertises: names and values plus 32 bytes a field). Each field costs ~3 us of pure-Python
# HPACK decoding and parsing here; under MAX_HEADER_BLOCK a block of 1-byte references to one
# table entry held 29,000 fields (~85 ms of the loop from 29 KB on the wire; 40 of them stalled
# a good client 3.4 s). 64 KiB is at most ~2,000 fields; grpc-core's own hard limit on metadata
# (Triton's gRPC server) is 16 KiB, Envoy's default 60 KiB. The hop client keeps MAX_HEADER_BLOCK.
MAX_HEADER_LIST = 64 << 10
DEFAULT_WINDOW = 65535

FRAME_HEADER = struct.Struct(">BHBBI")  # 24-bit length as (hi byte, lo short), type, flags, stream id
U32 = struct.Struct(">I")
MESSAGE_PREFIX = struct.Struct(">BI")


def frame(typ: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME_HEADER.pack(n >> 16, n & 0xFFFF, typ, flags, sid) + payload


def frame_header(typ: int, flags: int, sid: int, n: int) -> bytes:
    return FRAME_HEADER.pack(n >> 16, n & 0xFFFF, typ, flags, sid)


def hpack_int(n: int, prefix_bits: int = 7) -> bytes:
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


def plain_decode(block: bytes, limit: int = MAX_HEADER_BLOCK) -> list[tuple[bytes, bytes]] | None:
    """Decode a header block made only of representations that leave the dynamic table alone
    and need no Huffman table: static-table indexes and literals without indexing / never
    indexed with plain strings (what meshserve itself sends, e.g. trailers carrying a
    traceparent). None for anything else, which the hpack decoder then handles: a block
    like that is usually unique, so it would miss the cache and cost a pure-Python decode.
    Also None past ``limit`` bytes of header list (the decoder then refuses it)."""
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
            if size > limit:
                return None
            out.append(field)
    except IndexError:
        return None
    return out



TRACE_FIELD = b"traceparent"  # a header field whose value is new on every request or response


def literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name (RFC 7541 6.2.2): stateless."""
    return b"\x00" + hpack_int(len(name)) + name + hpack_int(len(value)) + value


_STATUS_200 = b"\x88"  # static table index 8 = ":status: 200"
RESPONSE_HEADERS = (_STATUS_200 + literal(b"content-type", b"application/grpc")
                    + literal(b"grpc-accept-encoding", b"identity,deflate,gzip"))
TRAILERS_OK = literal(b"grpc-status", b"0")

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


def md_value(key: str, value: Any) -> bytes:
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else str(value).encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value if isinstance(value, bytes) else str(value).encode()



class H2ConnectionError(Exception):
    """A connection-level protocol error: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
