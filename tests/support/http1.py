"""Raw HTTP/1.1 over a socket, for the front-door tests: connect, read one answer, see the
server close the connection."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from typing import IO, NamedTuple


class Answer(NamedTuple):
    status: int
    version: str
    headers: dict[str, str]  # lower-case names
    body: bytes


def connect(hostport: str, timeout: float = 10.0) -> socket.socket:
    host, port = hostport.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_answer(f: IO[bytes]) -> Answer:
    """One response from the stream (a Content-Length or chunked body; not for HEAD)."""
    line = f.readline()
    assert line.startswith(b"HTTP/1."), line or "the connection closed before a response"
    version, status = line.split(b" ", 2)[:2]
    headers: dict[str, str] = {}
    while (h := f.readline()) not in (b"\r\n", b""):
        k, _, v = h.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(f.readline().strip(), 16)) > 0:
            body += f.read(size + 2)[:-2]
        f.readline()  # the CRLF after the last chunk
    else:
        body = f.read(int(headers.get("content-length", "0")))
    return Answer(int(status), version.decode(), headers, body)


def closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed `sock` (EOF or reset), reading and dropping what comes
    meanwhile; None when it was still open after `timeout`."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    return time.monotonic() - t0


def send_slowly(sock: socket.socket, pieces: Iterable[bytes], pause: float) -> None:
    """A slow but steady client: each piece, then ``pause`` s (under the server's read timeout)."""
    for piece in pieces:
        sock.sendall(piece)
        time.sleep(pause)  # the point: the client's pacing (the unit and the integration test share it)


def idle_then_ask(sock: socket.socket, f: IO[bytes], request: bytes, idle_s: float) -> None:
    """Leave a keep-alive connection idle ``idle_s`` (past the header timeout: idle between requests
    is not a slow header), then ``request`` on it is answered 200 (``f``: the socket's reader)."""
    time.sleep(idle_s)  # the point: idle past the header timeout (two front-door tests share it)
    sock.sendall(request)
    answer = read_answer(f)
    assert answer.status == 200 and answer.version == "HTTP/1.1", answer
