"""meshserve's own HTTP request and answer types, as the httptools server (server.py) makes and
writes them: what `meshserve/server/http_frontend.py:HttpFrontend`'s handlers see.

- `Request`: method, raw_path / path / query, header fields, version, keep_alive, the `body`
  as it arrives (`Body`: chunks, backpressure), `read_body` (the whole body within the server's
  limits: --max-request-bytes, --max-receive-bytes, Content-Encoding, 100-continue), `lost` (a
  future resolved when the client leaves), `cancel_on_loss` (a lost connection cancels the
  handler) and `stream` (a chunked answer written as it is made: server-sent events).
- `Answer`: a complete answer (status, headers, bytes body), written as one buffer by `render`.
- `Stream`: a streamed answer (`Request.stream`), chunked on HTTP/1.1.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote

from meshserve.protocol import http_codec
from meshserve.protocol.errors import InferError
from meshserve.server import admission, inflate, tls

if TYPE_CHECKING:
    from meshserve.server.http1.server import Connection

Version = tuple[int, int]
HTTP10: Version = (1, 0)
HTTP11: Version = (1, 1)
_VERSIONS = {"1.1": HTTP11, "1.0": HTTP10}
SMALL_BODY_BYTES = 1 << 16  # a plain body of at most this many bytes with a Content-Length is read in one go
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodyError(Exception):
    """A request body that cannot be read to its end (broken framing, the client left):
    `Request.read_body` turns it into 400 malformed request body."""


class ReceiveBudget:
    """Bytes of HTTP request bodies received (beyond SMALL_BODY_BYTES each) and not yet answered,
    process-wide, against --max-receive-bytes: counted as they arrive, before decoding and
    admission, a compressed body's decoded bytes too (before each slice is inflated), and given
    back when the request's handler is done (`Connection._serve`). With tenants every body's
    bytes, wire and decoded, count against its tenant's share of the limit as well (``who``)."""

    __slots__ = ("limit", "used", "tenants", "held_by")

    def __init__(self) -> None:
        self.limit = 0  # 0: unbounded
        self.used = 0
        # with tenants: what each tenant's bodies hold (at most its share of the limit), and per
        # request its tenant; every byte a request holds (``request.held``) is charged for that one
        # caller (``read_body`` names it once), so the tenant gets back what the request gives back
        self.tenants = inflate.Tenancy(http_codec.DECODE_SLICE)
        self.held_by: dict[Request, str] = {}

    def charge(self, request: Request, n: int, who: inflate.Caller | None = None) -> None:
        """n more bytes held by ``request`` (for tenant ``who``, with tenants); 429 + Retry-After
        when they do not fit the whole or the tenant's share."""
        if self.limit and self.used + n > self.limit:
            raise InferError.exhausted(
                f"server busy: {self.used} bytes of request bodies being received (limit --max-receive-bytes "
                f"{self.limit}); this body's {n} more do not fit, retry later", retry_after_s=admission.RETRY_AFTER_S)
        if who is not None and self.limit:
            refusal = self.tenants.refusal(who, n, self.limit, "request bodies")
            if refusal is not None:
                raise InferError.exhausted(refusal, retry_after_s=admission.RETRY_AFTER_S)
            self.tenants.charge(who[0], n)
            self.held_by[request] = who[0]
        self.used += n
        request.held += n

    def refund(self, request: Request, n: int) -> None:
        """n of the bytes charged to ``request`` were not used after all."""
        self.used -= n
        request.held -= n
        if self.held_by and (tenant := self.held_by.get(request)) is not None:
            self.tenants.refund(tenant, n)

    def release(self, request: Request) -> None:
        if self.held_by and (tenant := self.held_by.pop(request, None)) is not None:  # (with tenants)
            self.tenants.refund(tenant, request.held)
        self.used -= request.held
        request.held = 0


RECEIVING = ReceiveBudget()


def _again(exc: BaseException) -> BaseException:
    """A copy of a body's stored error, to raise: raised itself, the stored one would take a
    traceback holding the reader's frames, which hold the Body, which holds the error: a cycle
    only the collector frees, keeping the request's body and handler frames (a 413's, a lost
    connection's; docs/security.md, "Session 11: error cycles"). Its code, message and retry hint
    are the same."""
    if type(exc) is InferError:
        return InferError(exc.code, exc.message, retry_after_s=exc.retry_after_s)
    if type(exc) is BodyError:
        return BodyError(*exc.args)
    return exc  # (only the two above are stored: http1/server.py's fail() calls)


class Body:
    """A request body as it arrives, read chunk by chunk (`readany`) or whole (`read`).

    The connection feeds it; reading takes from it and lets the connection resume reading
    from the socket once little is buffered (`Connection.consumed`)."""

    __slots__ = ("conn", "chunks", "size", "received", "eof", "error", "waiter")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.chunks: deque[bytes] = deque()
        self.size = 0  # bytes buffered, not yet read
        self.received = 0  # bytes fed in all
        self.eof = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        self.chunks.append(data)
        n = len(data)
        self.size += n
        self.received += n
        self._wake()

    def whole(self, data: bytes) -> None:
        """feed(data) (when not empty) and feed_eof() of a body that has just been made: no waiter to wake."""
        if data:
            self.chunks.append(data)
            self.size = self.received = len(data)
        self.eof = True

    def feed_eof(self) -> None:
        self.eof = True
        self._wake()

    def reopen(self) -> None:
        """The body did not end: llhttp ended it early, before any handler read it (an upgrade
        request's: Connection._upgrade); it comes on after all."""
        self.eof = False

    def fail(self, exc: BaseException) -> None:
        if not self.eof:
            self.error = exc
            self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self) -> None:
        if self.error is not None:
            raise _again(self.error)
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.chunks:
            raise _again(self.error)

    def _take(self) -> bytes:
        data = self.chunks.popleft()
        self.size -= len(data)
        self.conn.consumed(len(data))
        return data

    async def readany(self) -> bytes:
        """The next chunk as it arrived; b"" at the end of the body."""
        while not self.chunks:
            if self.eof:
                return b""
            await self._wait()
        return self._take()

    async def read(self, n: int = -1) -> bytes:
        """The whole body (n < 0), or at most n bytes of it (the rest stays for the next read)."""
        if n >= 0:
            data = await self.readany() if n else b""
            if len(data) > n:  # the rest stays for the next read
                self.chunks.appendleft(data[n:])
                self.size += len(data) - n
                self.conn.buffered += len(data) - n
                data = data[:n]
            return data
        parts = []
        while True:  # taken as they come: the connection keeps reading (its backpressure is for readany)
            while self.chunks:
                parts.append(self._take())
            if self.eof:
                break
            await self._wait()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def at_eof(self) -> bool:
        return self.eof and not self.chunks




_date: tuple[int, str] = (0, "")


def http_date() -> str:
    """The Date header's value, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


def _connection(keep_alive: bool, version: Version) -> str:
    """The Connection header an answer needs ("" for none)."""
    if not keep_alive:
        return "Connection: close"
    return "Connection: keep-alive" if version == HTTP10 else ""


class Answer:
    """A complete answer whose body is bytes, written as one buffer by `render`. `headers`
    holds Content-Type and the answer's own; Content-Length, Date and Connection are added.
    ``close``: the connection ends after it."""

    __slots__ = ("status", "body", "headers", "close")

    def __init__(self, body: bytes, headers: dict[str, str], status: int = 200, close: bool = False) -> None:
        self.status = status
        self.body = body
        self.headers = headers
        self.close = close


_STATUS_LINES: dict[tuple[Version, int], str] = {}


def _status_line(version: Version, status: int) -> str:
    line = _STATUS_LINES.get((version, status))
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        line = _STATUS_LINES[(version, status)] = f"HTTP/{version[0]}.{version[1]} {status} {reason}\r\n"
    return line


def _fields(head: list[str], headers: dict[str, str]) -> None:
    for k, v in headers.items():
        if "\r" in v or "\n" in v or "\r" in k or "\n" in k:  # no header injection
            raise ValueError(f"newline or carriage return in the response header {k!r}")
        head.append(f"{k}: {v}\r\n")


# The last answer's head as render formatted it, for the next answer of the same status,
# headers, version and keep-alive (an infer answer's are those of the answers before it but
# for a changed Inference-Header-Content-Length): (headers (a copy), status, version, keep_alive,
# the bytes from the status line to "Content-Length: ", the bytes after the Date line). One kept:
# a server whose answers alternate between two heads formats each, as before. Measured:
# docs/perf/side-by-side-round-3.md, "Session 15".
_head_last: tuple[dict[str, str] | None, int, Version | None, bool, bytes, bytes] = (None, 0, None, False, b"", b"")
# the Date line between them, "\r\nDate: ...\r\n", for the second it was formatted in
_dated: tuple[int, bytes] = (0, b"")


def _head(answer: Answer, version: Version, keep_alive: bool) -> tuple[bytes, bytes]:
    """(the head's bytes before the Content-Length value, those after the Date line) of an
    answer; kept in ``_head_last``. Raises ValueError for a header with CR or LF in it."""
    global _head_last
    headers = answer.headers
    head = [_STATUS_LINES.get((version, answer.status)) or _status_line(version, answer.status)]
    _fields(head, headers)
    head.append("Content-Length: ")
    connection = _connection(keep_alive, version)
    prefix, suffix = "".join(head).encode(), f"{connection}\r\n\r\n".encode() if connection else b"\r\n"
    _head_last = (dict(headers), answer.status, version, keep_alive, prefix, suffix)
    return prefix, suffix


def _date_line(now: int) -> bytes:
    global _dated
    _dated = (now, f"\r\nDate: {formatdate(now, usegmt=True)}\r\n".encode())
    return _dated[1]


def render(answer: Answer, request: Request, keep_alive: bool) -> bytes | list[bytes]:
    """An Answer's bytes, status line to body, as one buffer (two for a large body: not copied;
    the head alone for HEAD). The head of the same status, headers, version and keep-alive as
    the last answer's is that one's but for Content-Length and Date (``_head_last``)."""
    version = request.version
    body = answer.body
    last = _head_last
    if last[0] == answer.headers and last[1] == answer.status and last[2] == version and last[3] == keep_alive:
        prefix, suffix = last[4], last[5]
    else:
        prefix, suffix = _head(answer, version, keep_alive)
    now = int(time.time())
    dated = _dated
    data = b"%b%d%b%b" % (prefix, len(body), dated[1] if dated[0] == now else _date_line(now), suffix)
    if request.method == "HEAD":
        return data
    if len(body) > 65536:
        return [data, body]
    return data + body


class Stream:
    """A streamed answer (`Request.stream`): each `write` is sent at once (a chunk on HTTP/1.1;
    HTTP/1.0 gets the bytes as they are and the connection closes after them), `end` finishes it."""

    __slots__ = ("conn", "chunked", "keep", "ended")

    def __init__(self, conn: Connection, chunked: bool, keep: bool) -> None:
        self.conn = conn
        self.chunked = chunked
        self.keep = keep
        self.ended = False

    async def write(self, data: bytes) -> None:
        if data:
            self.conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        await self.conn.drain()

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            if self.chunked:
                self.conn.write(b"0\r\n\r\n")
            await self.conn.drain()


def text_headers(headers: dict[str, str]) -> dict[str, str]:
    """A copy of a request's headers as valid text: header bytes that are not UTF-8 arrive as
    lone surrogates (`Connection` decodes them with surrogateescape), which no gRPC metadata or
    protobuf field can carry (a `tracestate` of such bytes was a 500 on a tracing gateway); they
    become U+FFFD. For the core's headers (`meshserve/server/http_frontend.py:_context_headers`)
    and for naming a compressed body's tenant."""
    if "".join(headers.values()).isascii():  # (the usual request: a copy in C, no comprehension frame)
        return dict(headers)
    return {k: v if v.isascii() else v.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            for k, v in headers.items()}


class Request:
    """One parsed request (see the module docstring).

    `lower` maps lower-case header names to their values (the last one of a repeated field);
    `header` reads the first value of one."""

    __slots__ = ("conn", "method", "raw_path", "version", "fields", "lower", "keep_alive", "body",
                 "_path", "head_size", "held", "cancel_on_loss", "streamed", "__weakref__")

    def __init__(self, conn: Connection, method: str, raw_path: str, version: str,
                 headers: list[tuple[str, str]], keep_alive: bool, lower: dict[str, str] | None = None) -> None:
        self.conn = conn
        self.method = method
        self.raw_path = raw_path
        self.version: Version = _VERSIONS.get(version) or (int(version[0]), int(version[2]))
        self.fields = headers
        # (the server builds `lower` as the fields arrive: no comprehension here)
        self.lower = {k.lower(): v for k, v in headers} if lower is None else lower
        self.keep_alive = keep_alive
        self.body = Body(conn)
        self._path: str | None = None
        self.head_size = 0  # its target and header fields' bytes (the connection's pipelining bound)
        self.held = 0  # body bytes it holds in RECEIVING (given back when its handler is done)
        self.cancel_on_loss = False  # while set, a lost connection cancels the handler (the infer route)
        self.streamed: Stream | None = None

    def header(self, lower_name: str) -> str | None:
        """The first value of a header (its name in lower case), None when absent."""
        if len(self.lower) == len(self.fields):  # (no name repeated: the one value is the first)
            return self.lower.get(lower_name)
        return next((v for k, v in self.fields if k.lower() == lower_name), None)

    def caller(self) -> inflate.Caller | None:
        """With tenants, the tenant and share this request's headers (or, on a mutual-TLS port,
        its client certificate) name (``inflate.caller``: UNAUTHENTICATED for a key that is no
        tenant's); None without tenants, with no header looked at."""
        if inflate.tenant_of is None:
            return None
        return inflate.caller(text_headers(self.lower), self.conn.transport, tls.cert_names_http)

    @property
    def remote(self) -> str | None:
        peer = self.conn.peername
        return str(peer[0]) if isinstance(peer, tuple) else None

    @property
    def path(self) -> str:
        """The path without the query, percent-decoded."""
        if self._path is None:
            self._path = unquote(self.raw_path.split("?", 1)[0])
        return self._path

    @property
    def query_string(self) -> str:
        return self.raw_path.partition("?")[2]

    @property
    def query(self) -> list[tuple[str, str]]:
        return parse_qsl(self.query_string, keep_blank_values=True)

    @property
    def content_length(self) -> int | None:
        value = self.header("content-length")
        return int(value) if value is not None else None  # (llhttp checked it is a number)

    def lost(self) -> asyncio.Future[None]:
        """Resolved when the request's connection is lost."""
        return self.conn.lost_future()

    def send_continue(self) -> None:
        """``100 Continue`` (read_body sends it when the client asked for it: curl waits 1 s)."""
        if self.version >= HTTP11:
            self.conn.write(CONTINUE)

    async def stream(self, status: int, headers: dict[str, str]) -> Stream:
        """Start a streamed answer: its head is sent now; the handler returns the Stream."""
        conn = self.conn
        body = self.body
        keep = self.keep_alive and self.version >= HTTP11 and not conn.server.closing and body.eof \
            and body.error is None
        stream = self.streamed = Stream(conn, self.version >= HTTP11, keep)
        head = [_status_line(self.version, status)]
        _fields(head, headers)
        if stream.chunked:
            head.append("Transfer-Encoding: chunked\r\n")
        head.append(f"Date: {http_date()}\r\n")
        connection = _connection(keep, self.version)
        head.append(f"{connection}\r\n\r\n" if connection else "\r\n")
        conn.write("".join(head).encode())
        await conn.drain()
        return stream

    def complete_body(self) -> list[bytes] | None:
        """read_body's answer at once, where it needs no wait and no check but the length's: a
        body received to its end, with a Content-Length of at most SMALL_BODY_BYTES and
        --max-request-bytes, no Content-Encoding and no 100-continue (an infer request's usual
        body: no coroutine of read_body and Body.read to make and await); None: read_body."""
        body = self.body
        lower = self.lower
        if not body.eof or len(lower) != len(self.fields) or "content-encoding" in lower:
            return None
        length = lower.get("content-length")
        if length is None:
            return None
        size = int(length)  # (llhttp checked it is a number)
        if size > SMALL_BODY_BYTES or size > self.conn.server.limits.max_request_bytes:
            return None
        expect = lower.get("expect")
        if expect is not None and expect.lower() == "100-continue":
            return None
        chunks = body.chunks
        if len(chunks) == 1:
            return [body._take()]
        parts = []
        while chunks:
            parts.append(body._take())
        return [b"".join(parts)]

    async def read_body(self) -> list[bytes]:
        """The body's chunks, decompressed, at most --max-request-bytes on the wire and after
        decoding (a large body is kept as chunks: never joined here).

        An announced Content-Length over the limit is refused before a byte of the body is read,
        a chunked or compressed body as soon as it passes the limit (413; the connection closes
        after the answer: the rest is not read). An unsupported Content-Encoding is 415 before
        reading; a malformed or truncated body 400. Bytes beyond SMALL_BODY_BYTES are charged to
        --max-receive-bytes (429 when they do not fit)."""
        limit = self.conn.server.limits.max_request_bytes
        encoding = self.header("content-encoding")
        # (no decoder object for the common plain body: the fast path below stays a few attribute reads)
        decoder = http_codec.BodyDecoder(encoding, limit) if encoding else None
        plain = decoder is None or decoder.identity
        length = self.content_length
        small = length is not None and plain and length <= SMALL_BODY_BYTES
        who = tenant = None
        if not small and (who := self.caller()) is not None:  # (with tenants: named before a byte is charged)
            tenant = who[0]
        if length is not None and length > limit:
            raise InferError.too_large(
                f"request body of {length} bytes exceeds the {limit}-byte limit (--max-request-bytes)")
        expect = self.header("expect")
        if expect is not None and expect.lower() == "100-continue":
            self.send_continue()
        body = self.body
        chunks: list[bytes] = []
        wire_size = 0
        try:
            if small:
                return [await body.read()]  # the common case: one read, not the chunk loop below
            if length is not None:  # all of it must fit (refused before it is read)
                RECEIVING.charge(self, length, who)
                charged = length
            else:
                charged = 0
            while True:
                chunk = await body.readany()
                if not chunk:
                    break
                wire_size += len(chunk)
                if wire_size > limit:
                    raise InferError.too_large(f"request body exceeds the {limit}-byte limit (--max-request-bytes)")
                if wire_size > charged:  # (chunked: as it comes)
                    RECEIVING.charge(self, wire_size - charged, who)
                    charged = wire_size
                if decoder is None or plain:  # (plain already says it; mypy needs the None test)
                    chunks.append(chunk)
                    continue
                pieces = decoder.feed(chunk)
                turns = inflate.INFLATING_NOW
                index = await turns.take(tenant, inflate.TURNS)  # (a turn of the process's inflating, as gRPC's)
                turn = True
                try:
                    for n in itertools.count():  # bounded slices: let other requests run
                        if n:
                            turn = False
                            index = await turns.between(index, tenant, inflate.TURNS)  # (other tenants' slices first)
                            turn = True
                        RECEIVING.charge(self, http_codec.DECODE_SLICE, who)  # (decoded bytes too, before each slice)
                        piece = next(pieces, b"")
                        RECEIVING.refund(self, http_codec.DECODE_SLICE - len(piece))
                        if not piece:
                            break
                        chunks.append(piece)
                finally:
                    if turn:
                        turns.give(index, tenant)
            if decoder is not None:
                decoder.finish()
        except BodyError as exc:
            raise InferError.invalid(f"malformed request body: {exc}") from None
        return chunks

