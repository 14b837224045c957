"""The request and response plumbing of the httptools front door (see server.py).

`Request` offers the subset of aiohttp's `web.BaseRequest` that meshserve's handlers use
(method, path, raw_path, query, headers, content_length, version, keep_alive, content,
writer, protocol, transport), so `HttpFrontend`'s dispatch runs on either server unchanged.
`Writer` is the `AbstractStreamWriter` aiohttp's `StreamResponse.prepare` writes through
(status line and headers, chunked transfer encoding, backpressure), and `render` turns the
common answer, a plain `web.Response` with a bytes body, into one buffer without it.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import HttpVersion
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict, MultiDict, MultiDictProxy

if TYPE_CHECKING:
    from meshserve.server.http1.server import Connection

HTTP10 = HttpVersion(1, 0)
HTTP11 = HttpVersion(1, 1)
_VERSIONS = {"1.1": HTTP11, "1.0": HTTP10}


class Body:
    """A request body as it arrives: aiohttp's `StreamReader` subset (read, readany).

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

    def feed_eof(self) -> None:
        self.eof = True
        self._wake()

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
            raise self.error
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.chunks:
            raise self.error

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
        """The whole body (n < 0), or at most n bytes of it (aiohttp's semantics)."""
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


class Writer(AbstractStreamWriter):
    """Writes one response on its connection: aiohttp's StreamResponse writes through this.
    The status line and headers are held until the first body bytes (or `send_headers`)."""

    __slots__ = ("conn", "chunked", "head")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.chunked = False
        self.head = b""
        self.length: int | None = None
        self.output_size = 0
        self.buffer_size = 0

    def _out(self, data: bytes | bytearray | memoryview) -> None:
        transport = self.conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.output_size += len(data)
        transport.write(data)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        if self.chunked and chunk:
            chunk = b"%x\r\n%b\r\n" % (len(chunk), bytes(chunk))
        if self.head:
            chunk, self.head = self.head + chunk, b""
        if chunk:
            self._out(chunk)
        await self.conn.drain()

    async def write_eof(self, chunk: bytes = b"") -> None:
        if self.chunked:
            chunk = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk)) if chunk else b"0\r\n\r\n"
        self.chunked = False
        if chunk or self.head:
            await self.write(chunk)

    async def drain(self) -> None:
        await self.conn.drain()

    def enable_compression(self, encoding: str = "deflate", strategy: int | None = None) -> None:
        raise NotImplementedError("response compression is done by the handler (http_codec.encode_body)")

    def enable_chunking(self) -> None:
        self.chunked = True

    async def write_headers(self, status_line: str, headers: CIMultiDict[str]) -> None:
        self.head = _head(status_line, headers.items())

    def send_headers(self) -> None:
        if self.head:
            head, self.head = self.head, b""
            self._out(head)


def _head(status_line: str, items: Any) -> bytes:
    lines = [status_line]
    for k, v in items:
        line = f"{k}: {v}"
        if "\r" in line or "\n" in line:  # (aiohttp's writer refuses them too: no header injection)
            raise ValueError(f"newline or carriage return in the response header {k!r}")
        lines.append(line)
    lines.append("\r\n")
    return "\r\n".join(lines).encode()


_date: tuple[int, str] = (0, "")


def http_date() -> str:
    """The Date header's value, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True))
    return _date[1]


def _connection(keep_alive: bool, version: HttpVersion) -> str:
    """The Connection header an answer needs ("" for none)."""
    if not keep_alive:
        return "Connection: close"
    return "Connection: keep-alive" if version == HTTP10 else ""


def render(response: web.Response, request: Request, keep_alive: bool) -> bytes | list[bytes] | None:
    """The bytes of a plain `web.Response` whose body is bytes, status line to body: one buffer
    (a list of two for a large body: not copied). None when it needs aiohttp's own preparation
    (a streamed or compressed body, cookies, a Payload)."""
    body = response._body
    if (response._cookies or response.compression or response.chunked
            or not (body is None or isinstance(body, bytes | bytearray))):
        return None
    status = response.status
    version = request.version
    headers = response.headers
    lines = [f"HTTP/{version[0]}.{version[1]} {status} {response.reason}"]
    empty = status < 200 or status in (204, 304) or request.method == "HEAD"
    for k, v in headers.items():
        line = f"{k}: {v}"
        if "\r" in line or "\n" in line:
            raise ValueError(f"newline or carriage return in the response header {k!r}")
        lines.append(line)
    n = len(body) if body else 0
    if "Content-Length" not in headers and not (status < 200 or status in (204, 304)):
        lines.append(f"Content-Length: {n}")
    if n and "Content-Type" not in headers:
        lines.append("Content-Type: application/octet-stream")
    if "Date" not in headers:
        lines.append("Date: " + http_date())
    if "Connection" not in headers and (connection := _connection(keep_alive, version)):
        lines.append(connection)
    lines.append("\r\n")
    head = "\r\n".join(lines).encode()
    if empty or not body:
        return head
    if n > 65536:
        return [head, bytes(body)]
    return head + body


class Answer:
    """A complete answer whose body is bytes (the infer route's): written as one buffer by
    `render_answer`, without aiohttp's Response (`to_response` makes one for aiohttp's server).
    `headers` holds Content-Type; Content-Length, Date and Connection are added."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, body: bytes, headers: dict[str, str], status: int = 200) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    def to_response(self) -> web.Response:
        return web.Response(body=self.body, status=self.status, headers=self.headers)


_STATUS_LINES: dict[tuple[HttpVersion, int], str] = {}


def render_answer(answer: Answer, request: Request, keep_alive: bool) -> bytes | list[bytes]:
    """`render` for an Answer: its bytes, status line to body, as one buffer (two for a large body)."""
    version = request.version
    status = answer.status
    line = _STATUS_LINES.get((version, status))
    if line is None:
        line = _STATUS_LINES[(version, status)] = \
            f"HTTP/{version[0]}.{version[1]} {status} {web.Response(status=status).reason}\r\n"
    body = answer.body
    head = [line]
    for k, v in answer.headers.items():
        if "\r" in v or "\n" in v:
            raise ValueError(f"newline or carriage return in the response header {k!r}")
        head.append(f"{k}: {v}\r\n")
    head.append(f"Content-Length: {len(body)}\r\nDate: {http_date()}\r\n")
    connection = _connection(keep_alive, version)
    head.append(f"{connection}\r\n\r\n" if connection else "\r\n")
    data = "".join(head).encode()
    if len(body) > 65536:
        return [data, body]
    return data + body


class Request:
    """One parsed request: the `web.BaseRequest` subset meshserve's handlers use.

    `lower` maps lower-case header names to their values (the last one of a repeated field);
    `header` reads it (the first value, as CIMultiDict's get); `headers`, the CIMultiDict, is
    made on first use."""

    __slots__ = ("protocol", "method", "raw_path", "version", "fields", "lower", "keep_alive", "content",
                 "_headers", "_writer", "_path", "head_size", "__weakref__")

    def __init__(self, conn: Connection, method: str, raw_path: str, version: str,
                 headers: list[tuple[str, str]], keep_alive: bool) -> None:
        self.protocol = conn
        self.method = method
        self.raw_path = raw_path
        self.version = _VERSIONS.get(version) or HttpVersion(*map(int, version.split(".", 1)))
        self.fields = headers
        self.lower = {k.lower(): v for k, v in headers}
        self._headers: CIMultiDict[str] | None = None
        self.keep_alive = keep_alive
        self.content = Body(conn)
        self._writer: Writer | None = None
        self._path: str | None = None
        self.head_size = 0  # its target and header fields' bytes (the connection's pipelining bound)

    @property
    def headers(self) -> CIMultiDict[str]:
        """(read only by handlers: no read-only proxy around it)"""
        if self._headers is None:
            self._headers = CIMultiDict(self.fields)
        return self._headers

    def header(self, lower_name: str) -> str | None:
        """The first value of a header (its name in lower case), None when absent."""
        if len(self.lower) == len(self.fields):  # (no name repeated: the one value is the first)
            return self.lower.get(lower_name)
        return self.headers.get(lower_name)

    @property
    def writer(self) -> Writer:
        """Raw writes (100 Continue) and where aiohttp's StreamResponse.prepare writes; made on
        first use (most requests never need it)."""
        if self._writer is None:
            self._writer = Writer(self.protocol)
        return self._writer

    @property
    def _payload_writer(self) -> Writer:
        return self.writer

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        """(aiohttp's on_response_prepare signal: none here)"""

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.protocol.transport

    @property
    def remote(self) -> str | None:
        peer = self.protocol.peername
        return str(peer[0]) if isinstance(peer, tuple) else None

    @property
    def path(self) -> str:
        """The path without the query, percent-decoded (aiohttp's request.path)."""
        if self._path is None:
            self._path = unquote(self.raw_path.split("?", 1)[0])
        return self._path

    @property
    def query_string(self) -> str:
        return self.raw_path.partition("?")[2]

    @property
    def query(self) -> MultiDictProxy[str]:
        return MultiDictProxy(MultiDict(parse_qsl(self.query_string, keep_blank_values=True)))

    @property
    def content_length(self) -> int | None:
        value = self.header("content-length")
        return int(value) if value is not None else None  # (llhttp checked it is a number)

    @property
    def can_read_body(self) -> bool:
        return not self.content.at_eof()

    @property
    def body_exists(self) -> bool:
        return self.content.received > 0 or not self.content.eof


def payload_error(message: str) -> RequestPayloadError:
    """What a handler reading a broken body sees: aiohttp's exception, so the handlers' rule
    for it (400 malformed request body) holds on both servers."""
    return RequestPayloadError(message)
