"""A minimal HTTP/1.1 keep-alive client for the load generator's hot path.

aiohttp costs ~100+ µs of client CPU per request; the generator only needs to write pre-built
request bytes and read a status code and a body length, which an asyncio.Protocol does for a
fraction of that. Supports Content-Length and chunked responses and `Connection: close`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast


class ProtocolError(Exception):
    pass


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.closed = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError("server closed the connection"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return
        try:
            status = self._parse()
        except ProtocolError as exc:
            self.waiter.set_exception(exc)
            return
        if status is not None:
            self.waiter.set_result(status)

    def _parse(self) -> int | None:
        """The status of a complete response at the start of the buffer (consumed), or None."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(buf[:end]).decode("latin-1").split("\r\n")
        try:
            status = int(head[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise ProtocolError(f"bad status line {head[0]!r}") from None
        length = None
        chunked = False
        for line in head[1:]:
            k, _, v = line.partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
            elif k == "connection" and v.strip().lower() == "close":
                self.keep_alive = False
        start = end + 4
        if chunked:
            pos = start
            while True:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    return None
                size = int(bytes(buf[pos:nl]).split(b";")[0], 16)
                if size == 0:
                    trailer = buf.find(b"\r\n\r\n", nl)
                    if trailer < 0:
                        return None
                    del buf[:trailer + 4]
                    return status
                pos = nl + 2 + size + 2
                if pos > len(buf):
                    return None
        if length is None:
            length = 0
        if len(buf) - start < length:
            return None
        del buf[:start + length]
        return status


@dataclass
class HttpPool:
    """Keep-alive connections to one host; one request at a time per connection."""

    host: str
    port: int

    def __post_init__(self) -> None:
        self.idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_Conn, self.host, self.port)
        return proto

    async def request(self, raw: bytes, timeout: float | None = None) -> int:
        """Send one pre-built HTTP/1.1 request, return the response status (the body is discarded)."""
        conn = None
        while self.idle:
            c = self.idle.pop()
            if not c.closed:
                conn = c
                break
        if conn is None:
            conn = await self._connect()
        assert conn.transport is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        conn.waiter = fut
        timer = loop.call_later(timeout, _expire, fut) if timeout else None
        conn.transport.write(raw)
        try:
            status = await fut
        except BaseException:
            conn.transport.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        conn.waiter = None
        if conn.keep_alive and not conn.closed:
            self.idle.append(conn)
        else:
            conn.transport.close()
        return status

    def close(self) -> None:
        for c in self.idle:
            if c.transport is not None:
                c.transport.close()
        self.idle.clear()


def _expire(fut: asyncio.Future[int]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def build_request(host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
