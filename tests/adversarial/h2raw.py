"""A raw HTTP/2 attacker: hand-built frames over a plain socket, plus a frame reader that
records what the server did to the connection (SETTINGS it advertised, RST_STREAM codes,
GOAWAY, EOF). The `h2` package is a strict state machine that refuses to misbehave (and is
too slow for 50k streams), so floods are written as bytes here; hpack encodes the header
blocks (never-indexed literals: one block is valid for every stream, no table state).

Every loop in here is bounded by a count and a deadline; nothing connects anywhere but the
address it is given (127.0.0.1 in the suite).
"""
from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import hpack
from hpack import NeverIndexedHeaderTuple

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
# error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, CANCEL, REFUSED_STREAM, ENHANCE_YOUR_CALM = 0x0, 0x1, 0x8, 0x7, 0xB
# settings
HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x1, 0x3, 0x4, 0x5

INFER = "/inference.GRPCInferenceService/ModelInfer"
MiB = 1 << 20


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((ftype, flags)) + struct.pack(">I", sid) + payload


def settings(values: dict[int, int] | None = None, ack: bool = False) -> bytes:
    body = b"".join(struct.pack(">HI", k, v) for k, v in (values or {}).items())
    return frame(SETTINGS, ACK if ack else 0, 0, body)


def rst(sid: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, sid, struct.pack(">I", code))


def window_update(sid: int, inc: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", inc))


def grpc_headers(authority: str, path: str = INFER, key: str | None = None,
                 extra: list[tuple[str, str]] | None = None) -> bytes:
    """One HPACK block for a gRPC request, reusable on any stream of any connection."""
    hdrs = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers")]
    if key:
        hdrs.append(("x-api-key", key))
    hdrs += extra or []
    return hpack.Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in hdrs])


def header_frames(sid: int, block: bytes, size: int = 16000) -> bytes:
    """A header block (ending the stream) as HEADERS + CONTINUATION frames of `size` bytes."""
    parts = [block[i:i + size] for i in range(0, len(block), size)] or [b""]
    data = frame(HEADERS, END_STREAM | (END_HEADERS if len(parts) == 1 else 0), sid, parts[0])
    for i, part in enumerate(parts[1:], 1):
        data += frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, sid, part)
    return data


def grpc_message(payload: bytes, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message; `length` lies about its size when given."""
    return b"\x00" + struct.pack(">I", len(payload) if length is None else length) + payload


@dataclass
class Seen:
    """What the server did to one connection."""

    goaway: int | None = None  # error code of the first GOAWAY
    rst: collections.Counter[int] = field(default_factory=collections.Counter)  # RST_STREAM codes
    eof: bool = False  # the server closed (EOF or reset)
    settings: dict[int, int] = field(default_factory=dict)  # what the server advertised
    statuses: dict[int, str] = field(default_factory=dict)  # stream -> grpc-status (trailers)
    answered: set[int] = field(default_factory=set)  # streams whose response HEADERS arrived
    data_bytes: int = 0

    def closed_or_refused(self) -> bool:
        return self.eof or self.goaway is not None or self.rst[REFUSED_STREAM] > 0

    def __str__(self) -> str:
        return (f"goaway={self.goaway} rst={dict(self.rst)} eof={self.eof} settings={self.settings} "
                f"grpc-status={collections.Counter(self.statuses.values())} data={self.data_bytes}")


class RawH2:
    """One prior-knowledge HTTP/2 connection driven by hand.

    With `read=True` a reader thread parses the server's frames into `seen` (and ACKs its
    SETTINGS/PINGs, and gives window back for DATA when `give_window`); with `read=False` nothing is read
    until `wait_closed` (the zero-window and flood attacks: a peer that never reads)."""

    def __init__(self, hostport: str, *, client_settings: dict[int, int] | None = None, read: bool = True,
                 give_window: bool = True, send_timeout: float = 5.0, preface: bool = True):
        host, port = hostport.rsplit(":", 1)
        self.authority = hostport
        self.sock = socket.create_connection((host, int(port)), timeout=send_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.seen = Seen()
        self.give_window = give_window
        self.decoder = hpack.Decoder()
        self.lock = threading.Condition()
        self.conn_window = 65535  # what the server lets us send
        self.stream_windows: dict[int, int] = {}
        self.initial_window = 65535
        self.blocked = False  # a send timed out: the server stopped reading (backpressure)
        self._buf = bytearray()
        self._send_lock = threading.Lock()
        self._replies: list[bytes] = []  # ACKs and window updates the reader owes, sent outside `lock`
        self._closing = False
        self._reader: threading.Thread | None = None
        if preface:
            self.send(PREFACE + settings(client_settings or {}))
        if read:
            self._reader = threading.Thread(target=self._read_loop, daemon=True)
            self._reader.start()

    # ---- sending -------------------------------------------------------------------------
    def send(self, data: bytes) -> bool:
        """Write; False once the server has closed or stopped reading (nothing more is sent)."""
        if self.seen.eof or self.blocked:
            return False
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except TimeoutError:
            self.blocked = True
        except OSError:
            self._mark_eof()
        return False

    def take_window(self, sid: int, want: int, timeout: float) -> int:
        """Wait (bounded) until the server's windows allow sending; returns how many bytes."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                n = min(want, self.conn_window, self.stream_windows.get(sid, self.initial_window))
                if n > 0 or self.seen.eof or self.seen.goaway is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return 0
                self.lock.wait(left)
            n = max(0, n)
            self.conn_window -= n
            self.stream_windows[sid] = self.stream_windows.get(sid, self.initial_window) - n
            return n

    # ---- reading -------------------------------------------------------------------------
    def _mark_eof(self) -> None:
        with self.lock:
            self.seen.eof = True
            self.lock.notify_all()

    def _read_loop(self) -> None:
        try:
            while not self._closing:
                try:
                    chunk = self.sock.recv(1 << 16)
                except TimeoutError:  # the socket's timeout bounds sends; reading just goes on
                    continue
                if not chunk:
                    break
                self._feed(chunk)
                replies, self._replies = self._replies, []
                if replies:
                    self.send(b"".join(replies))
        except OSError:
            pass
        self._mark_eof()

    def _feed(self, chunk: bytes) -> None:
        buf = self._buf
        buf += chunk
        pos = 0
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            ftype, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            self._frame(ftype, flags, sid, bytes(buf[pos + 9:pos + 9 + length]))
            pos += 9 + length
        del buf[:pos]

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        seen = self.seen
        with self.lock:
            if ftype == SETTINGS and not flags & ACK:
                for i in range(0, len(payload) - 5, 6):
                    k, v = struct.unpack_from(">HI", payload, i)
                    seen.settings[k] = v
                    if k == INITIAL_WINDOW_SIZE:
                        delta = v - self.initial_window
                        self.initial_window = v
                        for s in self.stream_windows:
                            self.stream_windows[s] += delta
                self._replies.append(settings(ack=True))
            elif ftype == PING and not flags & ACK:
                self._replies.append(frame(PING, ACK, 0, payload))
            elif ftype == WINDOW_UPDATE and len(payload) == 4:
                inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.conn_window += inc
                else:
                    self.stream_windows[sid] = self.stream_windows.get(sid, self.initial_window) + inc
            elif ftype == RST_STREAM and len(payload) == 4:
                seen.rst[struct.unpack(">I", payload)[0]] += 1
            elif ftype == GOAWAY and len(payload) >= 8:
                if seen.goaway is None:
                    seen.goaway = struct.unpack_from(">I", payload, 4)[0]
            elif ftype == HEADERS:
                seen.answered.add(sid)
                try:
                    for k, v in self.decoder.decode(payload):
                        if k in ("grpc-status", b"grpc-status"):
                            seen.statuses[sid] = v if isinstance(v, str) else v.decode()
                except Exception:  # a header block we cannot decode: not our concern here
                    pass
            elif ftype == DATA:
                seen.data_bytes += len(payload)
                if self.give_window and payload:
                    self._replies.append(window_update(0, len(payload)) + window_update(sid, len(payload)))
            self.lock.notify_all()

    def wait_answered(self, sid: int, timeout: float) -> bool:
        """Bounded wait for the server's response HEADERS on `sid` (or the connection's end)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while sid not in self.seen.answered and not self.seen.eof and self.seen.goaway is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
            return sid in self.seen.answered

    def wait(self, cond: str, timeout: float) -> bool:
        """Bounded wait for `closed` (EOF or GOAWAY) or `refused` (closed_or_refused)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                if cond == "closed" and (self.seen.eof or self.seen.goaway is not None):
                    return True
                if cond == "refused" and self.seen.closed_or_refused():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)

    def wait_closed_unread(self, timeout: float) -> None:
        """For a connection nobody reads: read everything now (bounded) and parse it, until
        EOF or `timeout`. What the server wrote meanwhile (GOAWAY, RST_STREAM) is recorded."""
        deadline = time.monotonic() + timeout
        while not self.seen.eof and time.monotonic() < deadline:
            self.sock.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                self._mark_eof()
                break
            if not chunk:
                self._mark_eof()
                break
            self._feed(chunk)

    def close(self) -> None:
        self._closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._reader is not None:
            self._reader.join(5)
