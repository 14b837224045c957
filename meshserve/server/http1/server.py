"""An HTTP/1.1 server on llhttp (httptools): one asyncio Protocol per connection.

`Connection` feeds the socket's bytes to `httptools.HttpRequestParser`, hands each request to
the handler (`HttpFrontend.answer`) as a `request.Request` (meshserve's own type), and writes
the `request.Answer` it returns as one buffer (`request.render`); a `request.Stream` the
handler starts itself (server-sent events) is written as it goes, chunked.

What a connection guarantees (docs/security.md, "The HTTP/1.1 front door"):
- keep-alive (HTTP/1.1 by default, HTTP/1.0 with `Connection: keep-alive`), `Connection: close`;
  pipelining: requests run one after the other, answers in order;
- bodies with Content-Length or chunked, `Expect: 100-continue` (answered when the handler reads
  the body: `request.Request.read_body`, which also holds the body to --max-request-bytes after
  decoding and to the process's --max-receive-bytes);
- an upgrade asked for (Upgrade: h2c, websocket) is not offered: the request and its body are
  read and answered, and the connection goes on in HTTP/1.1 (a CONNECT is answered, then closed);
- a malformed request: 400 and close (after the answers to the requests before it); a request
  line or header field over MAX_FIELD_BYTES, more than MAX_HEADERS fields, or a head over
  MAX_HEAD_BYTES: 400 and close; so is a request of a version other than HTTP/1.1 and HTTP/1.0,
  and an HTTP/1.0 request with Transfer-Encoding (RFC 9112 6.1: SERVED_VERSIONS);
- backpressure both ways: reading stops while more than BODY_HIGH_WATER bytes of request
  bodies wait for a handler, while more than PIPELINE_MAX requests (or PIPELINE_MAX_BYTES of
  their heads) wait for their answers (the rest of that read waits, unparsed, until they drain),
  and while the transport cannot take more response bytes;
- a request body's raw bytes on the wire (chunk framing and extensions included) are bounded by
  --max-request-bytes (413), its chunks past BODY_PIECES_FREE must average BODY_PIECE_MIN bytes
  (400), and the whole body must arrive within --body-timeout-s;
- connections are counted process-wide (meshserve/server/connections.py): near the cap the
  longest idle one is closed; at the cap a new one gets 503 and is closed;
- with tenants, a connection counts for the tenant of its first request named (`_claim`:
  connections.TABLE.claim); past the tenant's share of the cap, that request gets 429 +
  Retry-After and the connection is closed after the answers before it;
- ServerLimits' header, read and idle timeouts, enforced by one sweep per server (`Http1Server._sweep`):
  nothing on the request path but a counter per data arrival;
- a request that received more than body_worker.TRIM_AFTER_BYTES returns the heap to the OS
  once its answer is written (and so does a connection that received that much);
- a response sent before its request's body was read to the end closes the connection;
- graceful shutdown: stop listening, close idle connections, let in-flight requests finish.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httptools

from meshserve.protocol.errors import InferError
from meshserve.server import body_worker, connections, inflate, tls
from meshserve.server.http1.request import RECEIVING, Answer, BodyError, Request, Stream, render, text_headers
from meshserve.server.limits import LISTEN, READ_BURST, ServerLimits

log = logging.getLogger("meshserve.http")

Handler = Callable[[Request], Awaitable[Answer | Stream]]

MAX_FIELD_BYTES = 8190  # request line (target) and each header field: aiohttp's limits
MAX_HEADERS = 128
MAX_HEAD_BYTES = 1 << 20  # a request head that has not ended after this many bytes: 400
BODY_HIGH_WATER = 1 << 20  # request body bytes buffered for handlers before reading pauses
BODY_LOW_WATER = 1 << 18  # ... and resumes
LINGER_S = 2.0  # a connection closed after its answer reads and drops the client's bytes this long ...
LINGER_BYTES = 64 << 20  # ... or this many (see Connection._linger)
# Pipelining: requests parsed and not yet answered on one connection. Beyond either bound the
# rest of the read waits unparsed (`backlog`) and reading pauses until they drain to PIPELINE_LOW.
PIPELINE_MAX = 64
PIPELINE_MAX_BYTES = 1 << 20  # their heads' bytes (request target and header fields)
PIPELINE_LOW = 16
# A request's Task, made as asyncio.Task(coro, loop=, name=): CPython 3.11 formats "Task-N" for
# every Task made without a name (~1,840 instructions), and uvloop's loop.create_task makes it
# without one and renames it after (name= there costs ~900 more; meshserve/server/h2/server.py:TASK_NAME).
# Nothing reads the names.
TASK_NAME = "request"
PIPELINE_SLICE = 16 << 10  # a read larger than this is parsed a slice at a time (to stop at the bound)
# A body's bytes on the wire (chunk framing and extensions included) past FRAMING_FREE may be at
# most FRAMING_RATIO times its data (1-byte chunks, "1\r\nX\r\n", are 6) and --max-request-bytes.
FRAMING_FREE = 1 << 20
FRAMING_RATIO = 16
# ... and past BODY_PIECES_FREE pieces (the parser hands a body over one piece per chunk, or per
# part of a chunk in a read: one Python call and one buffered bytes object each), its pieces
# may average no less than BODY_PIECE_MIN bytes. 1-byte chunks are 6 bytes of wire each, within
# FRAMING_RATIO: a 64 MiB request of them was 11 million calls (~5 us each: a minute of a core)
# and 11 million 1-byte objects (~45 bytes each held: 0.5 GB) (docs/security.md, "Session 22: a
# body of tiny chunks"). Clients' chunks are KiBs (curl: 64 KiB), and a read of a body sent with
# Content-Length is at least a TCP segment's worth.
BODY_PIECES_FREE = 4096
BODY_PIECE_MIN = 256


INTERNAL_ERROR = Answer(b'{"error":"internal error"}', {"Content-Type": "application/json"}, 500)


class _Refused(Exception):
    """A request head over a size limit (raised from a parser callback)."""


class _OverShare(Exception):
    """A request naming a tenant that holds its share of --max-connections (connections.TABLE.claim;
    raised from on_headers_complete: nothing after it is parsed): 429 and close."""


# The request versions served. llhttp also takes "0.9" (a request line without a version, and
# "HTTP/0.9") and "2.0" as a request line; the answer would echo them ("HTTP/2.0 200 OK" on an
# HTTP/1 connection). They are 400 and close.
SERVED_VERSIONS = frozenset(("1.1", "1.0"))


def _version_refusal(version: str) -> str:
    """Why a request head of this version is refused (on_headers_complete)."""
    if version in SERVED_VERSIONS:
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing. llhttp reads
        # it chunked (and keeps the connection for Connection: keep-alive), where an HTTP/1.0
        # intermediary may not: the bytes after the chunks would be a request of the client's
        # making that the proxy never saw (request smuggling).
        return "malformed HTTP request: Transfer-Encoding in an HTTP/1.0 request (RFC 9112 6.1)"
    return f"malformed HTTP request: HTTP/{version} is not served here (HTTP/1.1 or HTTP/1.0)"


# The heads _upgrade gives a fresh parser for an upgrade request's body: its Content-Length, or
# chunked (llhttp checked that chunked is the last coding).
UPGRADE_HEADS = (b"PUT / HTTP/1.1\r\nContent-Length: %d\r\n\r\n", b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")


def _error_bytes(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


# A client sends the same request head again and again (perf_analyzer, a tritonclient loop: the
# same target, fields and Content-Length; only the body's bytes differ). A connection keeps the
# head of its last plain request read whole in one piece (Connection._learn) with what the
# parser made of it; a read that is that head again and a body of its length is taken as that
# request (Connection._replay) without llhttp's pass and the parser's callbacks. One per
# connection, at most KNOWN_HEAD_MAX bytes of head (and its decoded fields).
KNOWN_HEAD_MAX = 2048
_PLAIN = frozenset(("transfer-encoding", "expect", "upgrade", "content-encoding"))  # (none in a known head)


class _Known:
    """A known request head (see KNOWN_HEAD_MAX): its bytes, the read's size with its body,
    and the request's method, target, fields and head size as the parser gave them."""

    __slots__ = ("head", "size", "method", "raw_path", "fields", "lower", "head_size")

    def __init__(self, head: bytes, size: int, request: Request) -> None:
        self.head = head
        self.size = size
        self.method = request.method
        self.raw_path = request.raw_path
        self.fields = list(request.fields)
        self.lower = dict(request.lower)
        self.head_size = request.head_size


class Connection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    __slots__ = ("server", "loop", "parser", "transport", "peername", "queue", "task", "url", "fields",
                 "head_bytes", "in_head", "body_of", "buffered", "header_since", "idle_since", "rx",
                 "rx_seen", "quiet_since", "read_paused", "write_paused", "drainers", "last", "stopped",
                 "error", "lost", "lingering", "eof", "closing", "counted", "backlog", "head_size",
                 "queued_bytes", "body_wire", "body_pieces", "body_seen", "body_since", "rx_bytes",
                 "join_writes", "lower", "named", "known", "burst_mark", "burst_paused", "splice")

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peername: Any = None
        self.queue: deque[Request] = deque()  # parsed, unanswered requests; the first one runs
        self.task: asyncio.Task[None] | None = None
        self.url: list[bytes] = []
        self.fields: list[tuple[str, str]] = []
        self.lower: dict[str, str] = {}  # the pending head's fields by lower-case name (the last of a repeated one)
        self.head_bytes = 0
        self.in_head = False  # a request head is being received
        self.body_of: Request | None = None  # the request whose body is being received
        self.buffered = 0  # body bytes received and not yet read by a handler
        self.header_since = 0.0  # when the pending head started (a new connection: when it came)
        self.idle_since = 0.0
        self.rx = self.rx_seen = 0  # data arrivals so far / when the sweep last looked
        self.quiet_since = 0.0
        self.read_paused = False
        self.write_paused = False
        self.drainers: list[asyncio.Future[None]] = []
        self.last = False  # no request after the ones queued (close, HTTP/1.0, an upgrade, an error)
        self.stopped = False  # ... and the last one has been read: later bytes are dropped (_stop)
        self.error: bytes | None = None  # the 400 to send once the queued requests are answered
        self.lost: asyncio.Future[None] | None = None  # resolved when the connection is lost (on demand)
        self.lingering = 0  # stopped: bytes still to read and drop (_stop)
        self.closing = False  # the last answer is sent: the connection closes (_linger)
        self.eof = False  # the client has closed its side
        self.counted = False  # in connections.TABLE
        # counted for its tenant, or nothing to count (no tenants): no more asking (connections.TABLE.claim)
        self.named = inflate.tenant_of is None
        self.backlog = b""  # received, not yet parsed: the pipelining bound was reached (_feed)
        self.head_size = 0  # the pending head's target and field bytes
        self.queued_bytes = 0  # head bytes of the queued requests
        self.body_wire = 0  # raw bytes received during the pending body (framing included)
        self.body_pieces = 0  # ... and the pieces the parser handed it over in (on_body calls)
        self.burst_mark = READ_BURST  # rx_bytes past which this connection yields the loop (_yield_reads)
        self.burst_paused = False  # ... and reading waits for the loop's next pass
        self.body_seen: Request | None = None  # the pending body the sweep first saw ...
        self.body_since = 0.0  # ... and when (--body-timeout-s: nothing on the request path)
        self.rx_bytes = 0  # bytes received (for the heap trim after a connection that received much)
        self.join_writes = False  # TLS: an answer's buffers joined, one TLS record (set by meshserve/server/tls.py)
        self.known: _Known | None = None  # the last whole request read in one piece (_learn, _replay)
        self.splice = False  # the parser is reading the head made up for an upgrade request's body (_upgrade)

    # ---- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass of it)
        self.peername = transport.get_extra_info("peername")
        self.header_since = self.quiet_since = self.idle_since = self.loop.time()
        if not connections.TABLE.opened(self):  # at the cap: refused at once, not left to starve others
            transport.write(_error_bytes(503, "Service Unavailable", "too many connections (--max-connections)",
                                         "Retry-After: 1\r\n"))
            transport.close()
            return
        self.counted = True
        self.server.connections.add(self)
        if self.server.closing:
            transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.counted:
            self.counted = False
            connections.TABLE.closed(self)
        self.server.connections.discard(self)
        self.transport = None
        self.backlog = b""
        if self.rx_bytes > body_worker.TRIM_AFTER_BYTES or self.write_paused:
            # a flood, or a client that stopped reading: their buffers go back to the OS once freed
            body_worker.release_memory_soon(self.loop)
        body = self.body_of
        if body is not None:
            body.body.fail(BodyError("the connection was lost before the request body ended"))
        for waiter in self.drainers:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("the connection was lost"))
        self.drainers.clear()
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)
        if self.task is None:
            self.queue.clear()
        elif self.queue and self.queue[0].cancel_on_loss:  # (set by the infer route while the core has it)
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.rx += 1
        rx_bytes = self.rx_bytes = self.rx_bytes + len(data)
        if rx_bytes > self.burst_mark:
            self._yield_reads()
        if self.stopped:  # nothing more is parsed on this connection: dropped, within a budget
            self.lingering -= min(len(data), self.lingering)
            if not self.lingering and self.transport is not None:
                if self.closing:
                    self.transport.close()
                else:
                    self._update_reading()
            return
        body = self.body_of
        if body is not None:
            wire = self.body_wire = self.body_wire + len(data)
            if wire > FRAMING_FREE and (wire > self.server.limits.max_request_bytes > 0
                                        or wire > FRAMING_RATIO * body.body.received):
                self._refuse_body(wire)
                return
        if self.in_head:
            self.head_bytes += len(data)
        if len(data) > PIPELINE_SLICE or self.backlog:
            self._feed(data)
            return
        if body is not None or self.in_head:
            self._parse(data)
            return
        known = self.known
        if known is not None and len(data) == known.size and data.startswith(known.head) and self.named:
            self._replay(known, data)
            return
        queued = len(self.queue)
        self._parse(data)
        if len(self.queue) == queued + 1 and self.body_of is None and not self.in_head and not self.stopped:
            self._learn(data)

    def _parse(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgrade(data, exc.args[0])
        except httptools.HttpParserError as exc:
            self._malformed(exc)
            return
        if self.in_head and self.head_bytes > MAX_HEAD_BYTES:
            self._malformed(_Refused(f"request head over {MAX_HEAD_BYTES} bytes"))

    def _upgrade(self, data: bytes | memoryview, at: int) -> None:
        """llhttp stopped at `at` in `data` after a request head asking for an upgrade (Upgrade and
        Connection: upgrade; curl --http2 on http:// sends "Upgrade: h2c") or a CONNECT.

        No upgrade is offered (RFC 9110 7.8: a server may ignore Upgrade): the connection goes on
        in HTTP/1.1. httptools had llhttp skip such a request's body and end the request there
        (its empty body went to the handler: the request was answered 400 "failed to parse the
        request JSON", or run on no data, and the body's bytes were read as the next request). So
        the body's framing is given to a fresh parser as a head made up of it alone (UPGRADE_HEADS;
        on_headers_complete takes it as that request's, `splice`), and `data[at:]`, the body and
        what follows, is parsed on. A CONNECT's bytes after its head are a tunnel's: the CONNECT
        is answered (no route), and the connection ends."""
        request = self.queue[-1] if self.queue else None
        if request is None or request.method == "CONNECT":
            self.last = True
            self._stop()
            return
        lower = request.lower
        chunked = "transfer-encoding" in lower
        length = int(lower.get("content-length") or 0)  # (llhttp checked it is a number)
        if not (chunked or length) and self.stopped:
            return  # the last request (Connection: close), whole: nothing more is read
        self.parser = parser = httptools.HttpRequestParser(self)
        if chunked or length:
            request.body.reopen()
            self.body_of = request
            self.splice = True
            # on_message_complete stopped the connection after a last request: its body comes first
            self.stopped = False
            self.lingering = 0
            parser.feed_data(UPGRADE_HEADS[1] if chunked else UPGRADE_HEADS[0] % length)
        if at < len(data):
            self._parse(data[at:])

    def _learn(self, data: bytes) -> None:
        """`data`, read with the parser between requests, was one whole request and nothing more
        (the newest in the queue): where it is a plain one (HTTP/1.1 keep-alive, a Content-Length
        body received whole, no Transfer-Encoding, Expect, Upgrade or Content-Encoding, no field
        repeated, a head of at most KNOWN_HEAD_MAX bytes), its head is kept with what the parser
        made of it (_Known): the next read of the same head and length is that request again."""
        request = self.queue[-1]
        lower = request.lower
        length = lower.get("content-length")
        if length is None or not request.keep_alive or request.version != (1, 1):
            return
        size = int(length)  # (llhttp checked it is a number)
        head = len(data) - size
        if (head > KNOWN_HEAD_MAX or request.body.received != size or len(lower) != len(request.fields)
                or not _PLAIN.isdisjoint(lower) or not data.endswith(b"\r\n\r\n", 0, head)):
            return
        self.known = _Known(data[:head], len(data), request)

    def _replay(self, known: _Known, data: bytes) -> None:
        """The parser's callbacks for a read that is the known request's head again and a body
        of its length (data_received: the parser is between requests, the connection named):
        what on_message_begin .. on_message_complete make of those bytes, made without parsing
        them again (the same bytes, so the same request: every limit they passed holds)."""
        keep_alive = not self.server.closing
        request = Request(self, known.method, known.raw_path, "1.1", list(known.fields), keep_alive,
                          dict(known.lower))
        self._queued(request, known.head_size, keep_alive)
        body = data[len(known.head):]
        request.body.whole(body)  # (its on_body and on_message_complete)
        if body:
            self.buffered += len(body)
            if self.buffered > BODY_HIGH_WATER and not self.read_paused:
                self._update_reading()
        if self.last:
            self._stop()

    def _feed(self, data: bytes) -> None:
        """Parse a large read (or one behind a backlog) a slice at a time, stopping where the
        pipelining bound is reached: the rest waits in `backlog` and reading pauses."""
        if self.backlog:
            data = self.backlog + data
            self.backlog = b""
        view = memoryview(data)
        n = len(view)
        at = 0
        while at < n:
            if self._pipeline_full():
                self.backlog = bytes(view[at:])
                self._update_reading()
                return
            self._parse(view[at:at + PIPELINE_SLICE])
            at += PIPELINE_SLICE
            if self.stopped:  # an error, an upgrade or the last request: nothing more is parsed
                return

    def _pipeline_full(self) -> bool:
        return len(self.queue) > PIPELINE_MAX or self.queued_bytes > PIPELINE_MAX_BYTES

    def _refuse_body(self, wire: int) -> None:
        """The pending body passed --max-request-bytes on the wire (chunk framing and extensions
        count: 413), or its chunk framing is over FRAMING_RATIO times its data (400): its handler
        answers, nothing more is read from this connection."""
        request = self.body_of
        assert request is not None
        limit = self.server.limits.max_request_bytes
        request.body.fail(InferError.too_large(
            f"request body exceeds the {limit}-byte limit (--max-request-bytes; bytes on the wire, "
            f"chunk framing included)") if wire > limit > 0 else InferError.invalid(
            f"malformed request body: {wire} bytes on the wire for {request.body.received} bytes of body "
            f"(chunk sizes and extensions may be at most {FRAMING_RATIO} times the data)"))
        self.body_of = None
        self.last = True
        # nothing more is parsed, and nothing more read until the answer is out (then _linger
        # reads and drops what still comes): reading on at once would take the client's bytes at
        # loopback speed while the handler has not answered yet
        self.stopped = True
        self.lingering = 0
        self._update_reading()

    def eof_received(self) -> bool | None:
        self.eof = True
        body = self.body_of
        if body is not None:
            body.body.fail(BodyError("the client closed the connection before the request body ended"))
        self.last = self.stopped = True
        return False  # closed: a request in progress loses its answer; `lost` resolves

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        drainers, self.drainers = self.drainers, []
        for waiter in drainers:
            if not waiter.done():
                waiter.set_result(None)
        self._update_reading()

    # ---- parser callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_head = True
        self.head_bytes = self.head_size = 0
        self.url = []
        self.fields = []
        self.lower = {}
        if self.header_since == 0.0:
            self.header_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url.append(url)
        if len(self.url) > 1 and sum(map(len, self.url)) > MAX_FIELD_BYTES or len(url) > MAX_FIELD_BYTES:
            raise _Refused(f"request target over {MAX_FIELD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        if size > MAX_FIELD_BYTES:
            raise _Refused(f"header field over {MAX_FIELD_BYTES} bytes")
        self.head_size += size
        fields = self.fields
        if len(fields) >= MAX_HEADERS:
            raise _Refused(f"more than {MAX_HEADERS} header fields")
        # (aiohttp's decoding: bytes that are not UTF-8 become lone surrogates)
        key = name.decode("utf-8", "surrogateescape")
        text = self.lower[key.lower()] = value.decode("utf-8", "surrogateescape")
        fields.append((key, text))

    def on_headers_complete(self) -> None:
        if self.splice:  # the head made up for an upgrade request's body: the body is that request's (_upgrade)
            self.splice = self.in_head = False
            self.header_since = 0.0
            return
        if not self.named and self.counted:
            self._claim()
        parser = self.parser
        version = parser.get_http_version()
        if version not in SERVED_VERSIONS or version == "1.0" and "transfer-encoding" in self.lower:
            raise _Refused(_version_refusal(version))
        url = self.url
        raw = (url[0] if len(url) == 1 else b"".join(url)).decode("utf-8", "surrogateescape")
        keep_alive = parser.should_keep_alive() and not self.server.closing
        request = Request(self, parser.get_method().decode("ascii", "replace"), raw,
                          parser.get_http_version(), self.fields, keep_alive, self.lower)
        self.in_head = False
        self.fields = []
        self.lower = {}
        self.body_of = request
        self._queued(request, self.head_size + len(raw), keep_alive)

    def _queued(self, request: Request, size: int, keep_alive: bool) -> None:
        """A request whose head is complete joins the queue (`size`: its head's bytes), and runs
        now when no other does."""
        self.header_since = 0.0
        self.body_wire = self.body_pieces = 0
        request.head_size = size
        self.queued_bytes += size
        self.queue.append(request)
        if not keep_alive:
            self.last = True
        if self.task is None:
            connections.TABLE.busy(self)
            self._start()

    def _claim(self) -> None:
        """With tenants, until the connection is named: count it for the tenant this request's
        headers name (connections.TABLE.claim); past the tenant's share, _OverShare (429, closed)."""
        refusal = connections.TABLE.claim(self, text_headers(self.lower), self.transport, tls.cert_names_http)
        if refusal is not None:
            self.named = True
            if refusal:
                raise _OverShare(refusal)

    def on_body(self, body: bytes) -> None:
        request = self.body_of
        if request is not None:
            pieces = self.body_pieces = self.body_pieces + 1
            if pieces > BODY_PIECES_FREE and pieces * BODY_PIECE_MIN > request.body.received + len(body):
                raise _Refused(  # (the parse stops here: _malformed, 400 from the body's handler)
                    f"malformed request body: {pieces} chunks for {request.body.received + len(body)} bytes of "
                    f"body (past {BODY_PIECES_FREE} chunks, they may average no less than {BODY_PIECE_MIN} bytes)")
            request.body.feed(body)
            self.buffered += len(body)
            if self.buffered > BODY_HIGH_WATER and not self.read_paused:
                self._update_reading()

    def on_message_complete(self) -> None:
        request = self.body_of
        if request is not None:
            request.body.feed_eof()
            self.body_of = None
        if self.last:
            self._stop()  # llhttp would call further bytes an error: they are not read

    # ---- requests ------------------------------------------------------------------------------

    def _start(self) -> None:
        self.task = asyncio.Task(self._serve(self.queue[0]), loop=self.loop, name=TASK_NAME)

    async def _serve(self, request: Request) -> None:
        server = self.server
        try:
            answer = await server.handler(request)
        except asyncio.CancelledError:
            self.task = None
            if self.transport is not None:  # the handler gave up on this request: so does the connection
                self.transport.close()
            return
        except Exception:
            log.exception("internal error serving %s %s", request.method, request.raw_path)
            if request.streamed is not None:  # its head is out: the answer ends unfinished, with the connection
                self.task = None
                if self.transport is not None:
                    self.transport.close()
                return
            answer = INTERNAL_ERROR
        finally:
            if request.held:
                RECEIVING.release(request)
        try:
            transport = self.transport
            if transport is None:
                self.task = None
                return
            if type(answer) is Answer:
                body = request.body
                keep = (request.keep_alive and not answer.close and not server.closing and body.eof
                        and body.error is None)
                buffer = render(answer, request, keep)
                if isinstance(buffer, list):
                    if self.join_writes:  # TLS: one record
                        transport.write(b"".join(buffer))
                    else:
                        transport.writelines(buffer)
                else:
                    transport.write(buffer)
            else:
                assert isinstance(answer, Stream)
                await answer.end()
                keep = answer.keep
        except Exception as exc:  # the client left mid-answer (or an answer that cannot be written)
            self.task = None
            if isinstance(exc, ConnectionError):
                log.debug("HTTP connection from %s: %s", self.peername, exc)
            else:
                log.exception("cannot write the answer to %s %s", request.method, request.raw_path)
            if self.transport is not None:
                self.transport.close()
            return
        if request.body.received > body_worker.TRIM_AFTER_BYTES:  # once this request's buffers are gone
            self.loop.call_later(0.05, self.loop.run_in_executor, None, body_worker.release_memory)
        self.task = None
        self._finished(request, keep)

    def _finished(self, request: Request, keep: bool) -> None:
        queue = self.queue
        queue.popleft()
        self.queued_bytes -= request.head_size
        body = request.body
        if body.size:  # a body the handler did not read
            self.consumed(body.size)
        transport = self.transport
        if transport is None:
            return
        if not keep:
            self._linger()
            return
        if self.backlog and len(queue) <= PIPELINE_LOW and not self.write_paused:
            self._feed(b"")  # what waited for the queue to drain (its first request may start here)
            self._update_reading()
            if self.task is not None or self.transport is None:
                return
        if queue:
            if self.write_paused:
                asyncio.Task(self._after_drain(), loop=self.loop, name=TASK_NAME)
            else:
                self.task = asyncio.Task(self._serve(queue[0]), loop=self.loop, name=TASK_NAME)
            return
        if self.error is not None:
            transport.write(self.error)
            self._linger()
            return
        if self.last:
            self._linger()
            return
        self.idle_since = self.loop.time()
        if self.counted:
            connections.TABLE.idle_now(self)
        self._update_reading()

    async def _after_drain(self) -> None:
        try:
            await self.drain()
        except ConnectionError:
            return
        if self.queue and self.task is None and self.transport is not None:
            self._start()

    def consumed(self, n: int) -> None:
        """A handler took n body bytes (or they were dropped)."""
        self.buffered -= n
        if self.read_paused and self.buffered < BODY_LOW_WATER:
            self._update_reading()

    def write(self, data: bytes) -> None:
        """Bytes of the running request's answer (a streamed one, 100 Continue)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the connection was lost")
        transport.write(data)

    def lost_future(self) -> asyncio.Future[None]:
        """Resolved when this connection is lost (made on demand: most requests never ask)."""
        if self.lost is None:
            self.lost = self.loop.create_future()
            if self.transport is None or self.transport.is_closing():
                self.lost.set_result(None)
        return self.lost

    async def drain(self) -> None:
        """Wait while the transport cannot take more."""
        if self.write_paused:
            if self.transport is None:
                raise ConnectionResetError("the connection was lost")
            waiter = self.loop.create_future()
            self.drainers.append(waiter)
            await waiter

    def _stop(self) -> None:
        """No more requests on this connection. Reading goes on, dropping what comes (at most
        LINGER_BYTES, then reading pauses), so that a client that leaves is noticed at once
        (`lost`: a streamed answer stops) and a close later does not reset the connection."""
        if not self.stopped:
            self.stopped = True
            self.lingering = LINGER_BYTES

    def _yield_reads(self) -> None:
        """This connection's reads passed READ_BURST bytes since it last yielded: reading pauses
        until the loop's next pass (the data in hand is still handled), so that a client sending
        at loopback speed takes one burst per pass, not libuv's 32 reads, and the other
        connections' callbacks come between (see READ_BURST)."""
        self.burst_mark = self.rx_bytes + READ_BURST
        if not self.burst_paused:
            self.burst_paused = True
            self._update_reading()
            self.loop.call_soon(self._burst_over)

    def _burst_over(self) -> None:
        self.burst_paused = False
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        pause = (self.write_paused or self.buffered > BODY_HIGH_WATER or (self.stopped and not self.lingering)
                 or bool(self.backlog) or self.burst_paused)
        if pause and not self.read_paused:
            self.read_paused = True
            transport.pause_reading()
        elif not pause and self.read_paused and self.buffered < BODY_LOW_WATER:
            self.read_paused = False
            transport.resume_reading()

    def _malformed(self, exc: BaseException) -> None:
        """400 and close: at once, or after the answers to the requests before it."""
        cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else exc
        message = str(cause) if isinstance(cause, (_Refused, _OverShare)) else f"malformed HTTP request: {exc}"
        self.last = True
        self._stop()
        request = self.body_of
        if request is not None:  # its handler answers (400 from the broken body), then the connection ends
            request.body.fail(BodyError(message))
            self.body_of = None
            return
        self.error = _error_bytes(429, "Too Many Requests", message, "Retry-After: 1\r\n") \
            if isinstance(cause, _OverShare) else _error_bytes(400, "Bad Request", message)
        if self.task is None and not self.queue and self.transport is not None:
            self.transport.write(self.error)
            self._linger()

    def _linger(self) -> None:
        """Close after the last answer without losing it: a close with unread bytes from the
        client resets the connection, and a reset can discard the answer before the client
        reads it (a 413 while the client is still sending). So: send FIN, read and drop what
        still comes, for at most LINGER_S or LINGER_BYTES, then close (at once on the client's EOF)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.last = self.closing = True
        self._stop()
        if not self.lingering:  # (stopped with reading paused until this answer: _refuse_body)
            self.lingering = LINGER_BYTES
        if self.eof or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.loop.call_later(LINGER_S, transport.close)
        if self.read_paused and self.lingering:
            self.read_paused = False
            transport.resume_reading()

    # ---- the server's sweep and shutdown -------------------------------------------------------

    def check(self, now: float, limits: ServerLimits) -> str | None:
        """Why this connection must be closed now, if it must."""
        if self.rx != self.rx_seen:
            self.rx_seen, self.quiet_since = self.rx, now
        if self.body_of is None:
            self.body_seen = None  # (not kept: a finished request's buffers go)
        if self.read_paused:
            return None  # silence is this side's doing (backpressure)
        body = self.body_of
        if body is not None:
            read = limits.read_timeout_s
            if read and now - self.quiet_since >= read:
                return f"no request body bytes for {read:g} s (--read-timeout-s)"
            if body is not self.body_seen:
                self.body_seen, self.body_since = body, now
            whole = limits.body_timeout_s
            if whole and now - self.body_since >= whole:
                return f"request body not complete after {whole:g} s (--body-timeout-s)"
        elif self.header_since and not self.queue:  # (a new connection counts from its start)
            header = limits.header_timeout_s
            if header and now - self.header_since >= header:
                return f"request headers incomplete after {header:g} s (--header-timeout-s)"
        elif not self.queue and self.task is None:
            idle = limits.idle_timeout_s
            if idle and now - max(self.idle_since, self.quiet_since) >= idle:
                return f"idle for {idle:g} s (--idle-timeout-s)"
        return None

    def evict(self) -> bool:
        """Closed to make room for a new connection (connections.TABLE: the longest idle one)."""
        if self.task is None and not self.queue and self.transport is not None:
            log.debug("closing idle HTTP connection from %s: near --max-connections", self.peername)
            self.transport.close()
            return True
        return False

    def drop(self) -> None:
        """Closed at once, a request in progress or not: a connection that names no tenant yet,
        past their share (connections.TABLE.unnamed)."""
        if self.transport is not None:
            log.debug("closing HTTP connection from %s: unnamed connections past their share", self.peername)
            self.transport.abort()

    def close_if_idle(self) -> bool:
        """Close now when no request is in progress (graceful shutdown); else after it."""
        self.last = True
        if self.task is None and not self.queue and self.transport is not None:
            self.transport.close()
            return True
        return False


class Http1Server:
    """The listening socket and its connections; `shutdown` / `cleanup`
    (what `meshserve/server/process.py:serve` calls)."""

    def __init__(self, handler: Handler, limits: ServerLimits, acceptor: tls.Acceptor | None = None) -> None:
        self.handler = handler
        self.tls = acceptor
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        RECEIVING.limit = limits.max_receive_bytes  # (process-wide: every HTTP port of a process has the same)
        self.connections: set[Connection] = set()
        self.closing = False
        self._server: asyncio.base_events.Server | None = None
        timeouts = [t for t in (limits.header_timeout_s, limits.read_timeout_s, limits.idle_timeout_s,
                                limits.body_timeout_s) if t > 0]
        self.tick = min(1.0, max(0.05, min(timeouts) / 4)) if timeouts else 0.0
        self._sweeper: asyncio.TimerHandle | None = None

    def connection(self) -> Connection:
        """A new connection's protocol (the listening socket's factory; load/bench/http_path.py
        feeds one bytes in process)."""
        return Connection(self)

    async def start(self, host: str, port: int) -> int:
        factory: Callable[[], asyncio.Protocol] = self.connection
        if self.tls is not None:  # --http-use-ssl: each connection's handshake first (meshserve/server/tls.py)
            factory = self.tls.factory(factory)
        self._server = await self.loop.create_server(factory, host, port,
                                                     reuse_address=True, reuse_port=LISTEN.reuse_port, backlog=1024)
        if self.tick:
            self._sweeper = self.loop.call_later(self.tick, self._sweep)
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        now = self.loop.time()
        limits = self.limits
        for conn in list(self.connections):
            why = conn.check(now, limits)
            if why and conn.transport is not None:
                log.debug("closing HTTP connection from %s: %s", conn.peername, why)
                conn.transport.close()
        self._sweeper = self.loop.call_later(self.tick, self._sweep)

    async def shutdown(self, timeout: float = 60.0) -> None:
        """Stop accepting, close idle connections, let requests in progress finish (at most
        `timeout` s), then close what is left."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle()
        end = self.loop.time() + timeout
        while self.connections and self.loop.time() < end:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            if conn.transport is not None:
                conn.transport.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def cleanup(self) -> None:
        if not self.closing or self.connections:
            await self.shutdown()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


async def start(handler: Handler, host: str, port: int, limits: ServerLimits,
                acceptor: tls.Acceptor | None = None) -> tuple[Http1Server, int]:
    """Serve `handler` on host:port (over TLS with `acceptor`); returns (server, bound port)."""
    server = Http1Server(handler, limits, acceptor)
    return server, await server.start(host, port)
