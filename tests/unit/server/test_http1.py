"""meshserve/server/http1 (the httptools server) with small handlers of its own, over raw sockets:
pipelining, chunked bodies, 100-continue, HTTP/1.0, Connection: close, malformed heads, size
limits, streamed (chunked) responses, backpressure, timeouts, lingering close and graceful
shutdown. tests/integration/test_http1_conformance.py runs the same server in front of real
gateway and service processes."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvloop

from meshserve.server import http1
from meshserve.server.http1 import Answer, Request, Stream
from meshserve.server.http1.server import (
    BODY_HIGH_WATER,
    BODY_PIECE_MIN,
    BODY_PIECES_FREE,
    MAX_FIELD_BYTES,
    MAX_HEADERS,
)
from meshserve.server.limits import ServerLimits
from tests.support import eventually, eventually_async, slow
from tests.support.http1 import closed_within, read_answer, send_slowly

NO_TIMEOUTS = ServerLimits(header_timeout_s=0, read_timeout_s=0, idle_timeout_s=0)


@dataclasses.dataclass
class Served:
    port: int
    loop: asyncio.AbstractEventLoop
    server: http1.Http1Server
    seen: list[str]

    def connect(self, timeout: float = 5.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)


async def echo(request: Request) -> Answer | Stream:
    """POST: the body back; GET /sse: three server-sent events, chunked; GET /slow?s: sleeps."""
    path = request.path
    if path == "/sse":
        events = await request.stream(200, {"Content-Type": "text/event-stream"})
        for i in range(3):
            await events.write(b"data: %d\n\n" % i)
        return events  # (the server ends it)
    if path == "/slow":
        await slow.work_for_async(float(request.query_string))
    if path == "/big":
        return Answer(b"z" * int(request.query_string), {})
    if path == "/head-only":  # answers without reading the body
        return Answer(b"early", {})
    if path == "/expect":  # reads the body as Request.read_body does: 100 Continue first
        if (request.header("expect") or "").lower() == "100-continue":
            request.send_continue()
    if path == "/limited":  # refuses a body over 1000 bytes as it arrives (413, connection closed)
        total = 0
        while chunk := await request.body.readany():
            total += len(chunk)
            if total > 1000:
                return Answer(b"too large", {}, 413, close=True)
    body = await request.body.read()
    headers = {"Content-Type": "application/octet-stream", "X-Method": request.method, "X-Path": request.raw_path,
               "X-Version": "{}.{}".format(*request.version)}
    return Answer(body, headers)


@contextmanager
def serving(handler: Callable[[Any], Awaitable[Answer | Stream]] = echo,
            limits: ServerLimits = NO_TIMEOUTS) -> Iterator[Served]:
    """The server on a loop of its own (uvloop, as in production), in a thread."""
    loop = uvloop.new_event_loop()
    started: list[Served] = []
    ready = threading.Event()
    seen: list[str] = []

    async def main() -> None:
        server, port = await http1.start(handler, "127.0.0.1", 0, limits)
        started.append(Served(port, loop, server, seen))
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(main(), loop).result(10)
    try:
        yield started[0]
    finally:
        asyncio.run_coroutine_threadsafe(started[0].server.cleanup(), loop).result(70)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def closed(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Did the server close `sock` (EOF or reset) within `timeout`?"""
    return closed_within(sock, timeout) is not None


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


# ---- keep-alive, pipelining, versions ------------------------------------------------------------

def test_pipelined_requests_are_answered_in_order() -> None:
    with serving() as srv, srv.connect() as sock:
        requests = [post("/slow?0.2", b"first"), b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", post("/slow?0.05", b"third"),
                    post("/b", b"x" * 100_000)]
        sock.sendall(b"".join(requests))  # all at once: the first is the slowest
        f = sock.makefile("rb")
        answers = [read_answer(f) for _ in requests]
        assert [a.headers["x-path"] for a in answers] == ["/slow?0.2", "/a", "/slow?0.05", "/b"]
        assert [a.body for a in answers] == [b"first", b"", b"third", b"x" * 100_000]
        sock.sendall(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")  # still open (keep-alive)
        assert read_answer(f).headers["x-path"] == "/again"


def test_a_repeated_head_is_taken_as_its_request_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that is the last plain request's head again with a body of its length is that
    request (Connection._replay: not parsed again); anything else is parsed: another body
    length, two requests in one read, a closing or HTTP/1.0 request, a malformed one after."""
    replayed: list[bytes] = []
    replay = http1.server.Connection._replay

    def counted(conn: Any, known: Any, data: bytes) -> None:
        replayed.append(data)
        replay(conn, known, data)

    monkeypatch.setattr(http1.server.Connection, "_replay", counted)
    with serving() as srv, srv.connect() as sock:
        f = sock.makefile("rb")
        for i in range(5):  # one read each (the answer comes before the next is sent)
            sock.sendall(post("/same", b"body-%d" % i, b"X-Tag: t\r\n"))
            answer = read_answer(f)
            assert (answer.status, answer.body, answer.headers["x-path"]) == (200, b"body-%d" % i, "/same")
        assert replayed == [post("/same", b"body-%d" % i, b"X-Tag: t\r\n") for i in (1, 2, 3, 4)]
        sock.sendall(post("/same", b"longer body", b"X-Tag: t\r\n"))  # another length: parsed (and known next)
        assert read_answer(f).body == b"longer body"
        sock.sendall(post("/same", b"body-5", b"X-Tag: t\r\n") * 2)  # two in one read: parsed
        assert [read_answer(f).body for _ in range(2)] == [b"body-5", b"body-5"]
        assert len(replayed) == 4
        for body in (b"body-6", b"body-8"):  # the first learnt again (the last known had another length)
            sock.sendall(post("/same", body, b"X-Tag: t\r\n"))
            assert read_answer(f).body == body
        assert len(replayed) == 5
        sock.sendall(post("/same", b"body-7", b"X-Tag: t\r\n") + b"\x01")  # the head and more: parsed, 400
        assert read_answer(f).body == b"body-7"
        assert read_answer(f).status == 400
        assert closed(sock)
    with serving() as srv, srv.connect() as sock:
        f = sock.makefile("rb")
        for _ in range(2):  # HTTP/1.0 keep-alive: never kept
            sock.sendall(b"POST /old HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nab")
            assert read_answer(f).body == b"ab"
        sock.sendall(post("/c", b"cd", b"Connection: close\r\n"))  # closing: answered, then closed
        assert read_answer(f).body == b"cd"
        assert closed(sock)
        assert len(replayed) == 5


def test_connection_close_and_http10() -> None:
    with serving() as srv:
        with srv.connect() as sock:
            sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET /never HTTP/1.1\r\n\r\n")
            f = sock.makefile("rb")
            a = read_answer(f)
            assert a.status == 200 and a.headers["connection"] == "close"
            assert f.read() == b""  # the pipelined request after `close` is not answered
        with srv.connect() as sock:
            sock.sendall(b"GET /a HTTP/1.0\r\n\r\n")
            f = sock.makefile("rb")
            a = read_answer(f)
            assert a.version == "HTTP/1.0" and a.headers["x-version"] == "1.0"
            assert "connection" not in a.headers or a.headers["connection"] == "close"
            assert f.read() == b""  # HTTP/1.0 without keep-alive: closed
        with srv.connect() as sock:
            sock.sendall(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            f = sock.makefile("rb")
            assert read_answer(f).headers["connection"] == "keep-alive"
            sock.sendall(b"POST /b HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok")
            assert read_answer(f).body == b"ok"


# ---- request bodies ----------------------------------------------------------------------------------

def test_chunked_request_body() -> None:
    with serving() as srv, srv.connect() as sock:
        parts = [b"a" * 10, b"b" * 70_000, b"c"]
        head = b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head)
        eventually(lambda: len(srv.server.connections) == 1, what="the connection accepted")
        conn = next(iter(srv.server.connections))
        sent = len(head)
        for p in parts:  # in separate writes, as a streaming client sends them
            chunk = b"%x;ext=1\r\n%s\r\n" % (len(p), p)
            sock.sendall(chunk)
            sent += len(chunk)
            eventually(lambda sent=sent: conn.rx_bytes >= sent, what="the chunk received")  # (in separate reads)
        sock.sendall(b"0\r\nTrailer: t\r\n\r\n")
        f = sock.makefile("rb")
        assert read_answer(f).body == b"".join(parts)


def test_malformed_chunked_body_is_400_and_close() -> None:
    async def reader(request: Request) -> Answer:
        try:
            await request.body.read()
        except Exception as exc:  # what Request.read_body turns into 400
            return Answer(type(exc).__name__.encode(), {}, 400)
        return Answer(b"read", {})

    with serving(reader) as srv, srv.connect() as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n")
        f = sock.makefile("rb")
        a = read_answer(f)
        assert (a.status, a.body) == (400, b"BodyError")
        assert f.read() == b""


@pytest.mark.parametrize("size", [1, 200])
def test_a_body_of_tiny_chunks_is_400_past_its_free_pieces(size: int) -> None:
    """Past BODY_PIECES_FREE pieces, a body's chunks may average no less than BODY_PIECE_MIN
    bytes: 1-byte chunks (6 bytes of wire each, within FRAMING_RATIO) are refused after the free
    ones, not read for a minute of a core (a 64 MiB request: 11 million of them). The message
    names the rule; nothing more is read from the connection."""
    async def reader(request: Request) -> Answer:
        try:
            await request.body.read()
        except Exception as exc:  # what Request.read_body turns into 400
            return Answer(str(exc).encode(), {}, 400)
        return Answer(b"read", {})

    chunk = b"%x\r\n%s\r\n" % (size, b"x" * size)
    with serving(reader) as srv, srv.connect() as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):  # (the server may stop reading once it has refused)
            for _ in range(2 * BODY_PIECES_FREE // 256):
                sock.sendall(chunk * 256)
        a = read_answer(sock.makefile("rb"))
        assert a.status == 400 and b"they may average no less than 256 bytes" in a.body, a


def test_a_body_of_tiny_chunks_then_larger_ones_is_read() -> None:
    """1-byte chunks (a quarter of BODY_PIECES_FREE), then 1 KiB ones: past the free pieces they
    average well over BODY_PIECE_MIN, and the body is read whole."""
    n_tiny, n_big = BODY_PIECES_FREE // 4, BODY_PIECES_FREE
    with serving() as srv, srv.connect() as sock:
        big = b"400\r\n" + b"y" * 1024 + b"\r\n"
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"1\r\nx\r\n" * n_tiny + big * n_big + b"0\r\n\r\n")
        a = read_answer(sock.makefile("rb"))
        assert a.status == 200 and a.body == b"x" * n_tiny + b"y" * (1024 * n_big)
    assert BODY_PIECE_MIN < 1024 * (BODY_PIECES_FREE - n_tiny) // BODY_PIECES_FREE


def test_expect_100_continue() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"POST /expect HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        f = sock.makefile("rb")
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"  # before the body is sent
        sock.sendall(b"hello")
        assert read_answer(f).body == b"hello"


def test_an_unread_body_ends_the_connection_after_the_answer() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"POST /head-only HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" + b"x" * 1000)
        f = sock.makefile("rb")
        assert read_answer(f).body == b"early"
        assert closed(sock)


def test_refused_body_is_answered_before_the_close_while_the_client_still_sends() -> None:
    """A 413 while the client is still sending must reach it (a close with unread bytes would
    reset the connection and could discard the answer): the server lingers, reading and dropping."""
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"POST /limited HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (4096, b"y" * 4096)
        got = b""
        sock.settimeout(0.01)
        for _ in range(2000):  # keeps sending after the answer: at most 8 MiB
            try:
                sock.sendall(chunk)
            except (BlockingIOError, TimeoutError, BrokenPipeError, ConnectionResetError):
                break
            try:
                got += sock.recv(65536)
            except TimeoutError:
                continue
            if b"too large" in got:
                break
        sock.settimeout(5)
        while b"too large" not in got and (more := sock.recv(65536)):
            got += more
        assert got.startswith(b"HTTP/1.1 413") and b"too large" in got, got[:200]
        assert b"connection: close" in got.lower()


def test_reading_pauses_while_a_body_waits_for_its_handler() -> None:
    """Backpressure on requests: a handler that does not read yet holds at most about
    BODY_HIGH_WATER bytes in the server; the client's sends then block."""
    release = threading.Event()
    buffered: list[int] = []

    async def late_reader(request: Request) -> Answer:
        await eventually_async(release.is_set, 60, "the test's release")
        buffered.append(request.conn.buffered)
        return Answer(str(len(await request.body.read())).encode(), {})

    total = 64 << 20
    with serving(late_reader) as srv, srv.connect() as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % total)
        sock.settimeout(0.5)
        sent = 0
        block = b"x" * 65536
        try:
            while sent < total:
                sent += sock.send(block)
        except TimeoutError:
            pass  # the server stopped reading
        assert sent < total // 2, sent
        release.set()
        sock.settimeout(10)
        threading.Thread(target=lambda: sock.sendall(b"x" * (total - sent)), daemon=True).start()
        assert read_answer(sock.makefile("rb")).body == str(total).encode()
        assert buffered[0] <= BODY_HIGH_WATER + (1 << 20), buffered


def test_a_client_that_does_not_read_pauses_the_connection() -> None:
    """Backpressure on answers: a client that pipelines requests for large answers but reads
    nothing makes the server stop reading (it does not buffer answer after answer)."""
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"GET /big?4000000 HTTP/1.1\r\nHost: x\r\n\r\n" * 50)  # 200 MB of answers if all ran
        eventually(lambda: len(srv.server.connections) == 1, what="the connection accepted")
        conn = next(iter(srv.server.connections))
        eventually(lambda: conn.read_paused and conn.write_paused)
        time.sleep(0.3)  # (nothing may change in this window: the server waits for the client)
        assert conn.transport is not None and conn.transport.get_write_buffer_size() <= 4_100_000
        assert len(conn.queue) > 40  # the rest wait unanswered
        with sock.makefile("rb") as f:  # (closed with the socket: a stuck peer would hold shutdown)
            for _ in range(3):  # reading resumes it
                assert len(read_answer(f).body) == 4_000_000


def test_a_connection_sending_at_full_speed_yields_the_loop_each_read_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body arriving at loopback speed is read at most READ_BURST bytes (plus the read that
    passes it) per loop pass: the connection's reading pauses until the next pass, so other
    connections' callbacks come between (libuv would read one readable socket up to 32 times,
    256 KiB each, in one pass). The body still arrives whole."""
    from meshserve.server.limits import READ_BURST
    passes = [0]
    per_pass: dict[tuple[int, int], int] = {}
    received = http1.server.Connection.data_received

    def counted(conn: Any, data: bytes) -> None:
        key = (id(conn), passes[0])
        per_pass[key] = per_pass.get(key, 0) + len(data)
        received(conn, data)

    monkeypatch.setattr(http1.server.Connection, "data_received", counted)
    body = b"b" * (24 << 20)
    with serving() as srv:
        def tick() -> None:  # once per loop pass
            passes[0] += 1
            srv.loop.call_soon(tick)
        srv.loop.call_soon_threadsafe(tick)
        with srv.connect(timeout=30) as sock:
            sender = threading.Thread(target=sock.sendall, args=(post("/flood", body),))
            sender.start()
            answer = read_answer(sock.makefile("rb"))
            sender.join(30)
        assert answer.status == 200 and answer.body == body
    assert max(per_pass.values()) <= READ_BURST + (256 << 10), sorted(per_pass.values())[-5:]


# ---- an upgrade asked for: not offered, ignored (RFC 9110 7.8) --------------------------------------

H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"  # curl --http2's


def chunked(body: bytes, size: int = 20_000) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


@pytest.mark.parametrize("framing", ["length", "chunked"])
@pytest.mark.parametrize("reads", ["one", "head-then-body"])
def test_an_upgrade_request_is_answered_with_its_body_and_the_connection_goes_on(framing: str, reads: str) -> None:
    # httptools had llhttp skip an upgrade request's body: the handler got b"" and the body's bytes
    # were parsed as the next request (curl --http2 POSTs to an http:// URL were 400)
    body = bytes(range(256)) * 300  # 76,800 bytes: over a parse slice
    head = (b"POST /up HTTP/1.1\r\nHost: x\r\n" + H2C
            + (b"Content-Length: %d\r\n\r\n" % len(body) if framing == "length" else b"Transfer-Encoding: chunked\r\n\r\n"))
    wire = body if framing == "length" else chunked(body)
    after = b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n"
    with serving() as srv, srv.connect() as sock:
        if reads == "one":
            sock.sendall(head + wire + after)
        else:
            sock.sendall(head)
            eventually(lambda: len(srv.server.connections) == 1, what="the connection accepted")
            conn = next(iter(srv.server.connections))
            eventually(lambda: conn.rx_bytes >= len(head), what="the head received")
            sock.sendall(wire[:1000])
            eventually(lambda: conn.rx_bytes >= len(head) + 1000, what="the body's start received")
            sock.sendall(wire[1000:] + after)
        f = sock.makefile("rb")
        answer = read_answer(f)
        assert (answer.status, answer.headers["x-path"], answer.headers["x-version"]) == (200, "/up", "1.1")
        assert answer.body == body
        assert read_answer(f).headers["x-path"] == "/after"
        sock.sendall(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")  # still HTTP/1.1, kept alive
        assert read_answer(f).headers["x-path"] == "/again"


def test_an_upgrade_without_a_body_and_the_requests_after_it_are_answered() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                     + post("/next", b"payload"))
        f = sock.makefile("rb")
        assert read_answer(f).headers["x-path"] == "/ws"
        answer = read_answer(f)
        assert answer.headers["x-path"] == "/next" and answer.body == b"payload"


@pytest.mark.parametrize("body", [b"", b"body"])
@pytest.mark.parametrize("reads", ["one", "head-then-body"])
def test_an_upgrade_with_connection_close_ends_after_its_body(body: bytes, reads: str) -> None:
    head = (b"POST /up HTTP/1.1\r\nHost: x\r\nConnection: close, Upgrade\r\nUpgrade: h2c\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    rest = body + b"GET /never HTTP/1.1\r\n\r\n"
    with serving() as srv, srv.connect() as sock:
        if reads == "one":
            sock.sendall(head + rest)
        else:
            sock.sendall(head)
            eventually(lambda: len(srv.server.connections) == 1, what="the connection accepted")
            conn = next(iter(srv.server.connections))
            eventually(lambda: conn.rx_bytes >= len(head), what="the head received")
            sock.sendall(rest)
        f = sock.makefile("rb")
        answer = read_answer(f)
        assert answer.body == body and answer.headers["connection"] == "close"
        assert f.read() == b""


def test_a_connect_is_answered_and_its_tunnel_bytes_are_not_read_as_requests() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"CONNECT elsewhere:443 HTTP/1.1\r\nHost: elsewhere:443\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n")
        f = sock.makefile("rb")
        assert read_answer(f).headers["x-method"] == "CONNECT"
        assert f.read() == b""


# ---- malformed and oversized heads ---------------------------------------------------------------

@pytest.mark.parametrize("head", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nbad header\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET /" + b"a" * (MAX_FIELD_BYTES + 10) + b" HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (MAX_FIELD_BYTES + 10) + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n",
    # HTTP/1.0 with Transfer-Encoding (RFC 9112 6.1): read chunked, the GET after the chunks was a
    # second request that an HTTP/1.0 proxy in front never saw (f.read() == b"": no second answer)
    b"POST / HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    b"GET /a HTTP/1.1\r\n\r\n",
    b"GET / HTTP/2.0\r\n\r\nGET /a HTTP/1.1\r\n\r\n",  # (answered "HTTP/2.0 200 OK" before)
    b"GET / HTTP/0.9\r\n\r\n",
    b"GET /\r\n\r\n",  # (llhttp's HTTP/0.9)
], ids=["garbage", "no-colon", "version", "two-lengths", "length-and-chunked", "long-target", "long-field",
        "many-fields", "http10-chunked", "http20", "http09", "no-version"])
def test_malformed_or_oversized_head_is_400_and_close(head: bytes) -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(head)
        f = sock.makefile("rb")
        a = read_answer(f)
        assert a.status == 400 and a.headers["connection"] == "close", a
        assert b"error" in a.body
        assert f.read() == b""


def test_a_malformed_request_after_good_ones_is_answered_in_turn() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(post("/slow?0.1", b"one") + b"GET /two HTTP/1.1\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
        f = sock.makefile("rb")
        assert read_answer(f).body == b"one"
        assert read_answer(f).headers["x-path"] == "/two"
        assert read_answer(f).status == 400
        assert f.read() == b""


def test_an_endless_head_is_refused() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nX-Endless: ")
        try:
            for _ in range(200):  # a field that never ends: 1.6 MB, over MAX_HEAD_BYTES (1 MiB)
                sock.sendall(b"v" * 8000)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 400") and b"request head over" in data, data[:300]


# ---- streamed answers ----------------------------------------------------------------------------------

def test_stream_response_is_chunked_and_keeps_the_connection() -> None:
    with serving() as srv, srv.connect() as sock:
        sock.sendall(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        f = sock.makefile("rb")
        a = read_answer(f)
        assert a.headers["transfer-encoding"] == "chunked" and a.headers["content-type"] == "text/event-stream"
        assert a.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert read_answer(f).headers["x-path"] == "/after"


def test_a_client_that_leaves_mid_stream_is_noticed() -> None:
    """A streamed answer's handler learns at once that its client left (`Connection.lost`, as
    http_frontend's generate_stream waits on), also after a `Connection: close` request."""
    left = threading.Event()

    async def stream(request: Request) -> Stream:
        lost = request.lost()
        events = await request.stream(200, {"Content-Type": "text/event-stream"})
        await events.write(b"data: first\n\n")
        await asyncio.wait_for(lost, 30)  # the next event would be a minute away
        left.set()
        return events

    for extra in (b"", b"Connection: close\r\n"):
        left.clear()
        with serving(stream) as srv:
            with srv.connect() as sock:
                sock.sendall(b"GET /sse HTTP/1.1\r\nHost: x\r\n%s\r\n" % extra)
                data = b""
                while b"data: first" not in data:
                    data += sock.recv(65536)
            assert left.wait(5), extra


def test_stream_response_to_http10_closes_instead_of_chunking() -> None:
    async def stream(request: Request) -> Stream:
        events = await request.stream(200, {})
        await events.write(b"abc")
        await events.end()
        return events

    with serving(stream) as srv, srv.connect() as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        sock.settimeout(5)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") and b"chunked" not in head.lower() and body == b"abc"


def test_a_handler_that_fails_mid_stream_cuts_the_stream() -> None:
    """After a streamed answer's head is out, a failing handler ends the connection: no 500 is
    written into the chunked body, and no final chunk says the stream was whole."""
    async def failing(request: Request) -> Stream:
        events = await request.stream(200, {"Content-Type": "text/event-stream"})
        await events.write(b"data: first\n\n")
        raise RuntimeError("the model failed")

    with serving(failing) as srv, srv.connect() as sock:
        sock.sendall(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\nGET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert b"data: first" in data and b"500" not in data and not data.endswith(b"0\r\n\r\n"), data


def test_handler_errors_are_500_and_the_connection_goes_on() -> None:
    async def broken(request: Request) -> Answer:
        if request.path == "/boom":
            raise RuntimeError("boom")
        return Answer(b"fine", {})

    with serving(broken) as srv, srv.connect() as sock:
        sock.sendall(b"GET /boom HTTP/1.1\r\n\r\nGET /ok HTTP/1.1\r\n\r\n")
        f = sock.makefile("rb")
        assert read_answer(f).status == 500
        assert read_answer(f).body == b"fine"


def test_response_header_injection_is_refused() -> None:
    async def bad(request: Request) -> Answer:
        return Answer(b"x", {"X-A": request.query_string.replace("_", "\r\n")})

    with serving(bad) as srv, srv.connect() as sock:
        sock.sendall(b"GET /?a_Set-Cookie:%20x HTTP/1.1\r\n\r\n")
        assert closed(sock)  # nothing written, connection closed (logged)


# ---- timeouts -------------------------------------------------------------------------------------------

TIMED = ServerLimits(header_timeout_s=0.5, read_timeout_s=0.5, idle_timeout_s=1.5)


def test_timeouts() -> None:
    with serving(limits=TIMED) as srv:
        with srv.connect() as silent, srv.connect() as trickle, srv.connect() as stalled, srv.connect() as idle:
            t0 = time.monotonic()
            trickle.sendall(b"GET / HTTP/1.1\r\n")
            stalled.sendall(b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc")
            idle.sendall(b"GET /a HTTP/1.1\r\n\r\n")
            assert read_answer(idle.makefile("rb")).status == 200
            assert closed(silent) and closed(trickle) and closed(stalled)
            assert 0.45 <= time.monotonic() - t0 < 1.5
            assert closed(idle)  # idle past the header timeout, closed by the idle timeout
            assert time.monotonic() - t0 >= 1.4


def test_slow_but_steady_body_is_not_cut() -> None:
    with serving(limits=TIMED) as srv, srv.connect() as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nContent-Length: 6\r\n\r\n")
        send_slowly(sock, [bytes([b]) for b in b"steady"], 0.2)  # under the 0.5 s read timeout, 1.2 s in all
        assert read_answer(sock.makefile("rb")).body == b"steady"


# ---- shutdown ---------------------------------------------------------------------------------------------

def test_graceful_shutdown_finishes_requests_in_flight() -> None:
    with serving() as srv:
        busy, idle = srv.connect(), srv.connect()
        try:
            idle.sendall(b"GET /a HTTP/1.1\r\n\r\n")
            read_answer(idle.makefile("rb"))
            busy.sendall(b"GET /slow?0.5 HTTP/1.1\r\n\r\n")
            eventually(lambda: any(c.task is not None for c in srv.server.connections))
            done = asyncio.run_coroutine_threadsafe(srv.server.shutdown(10), srv.loop)
            assert closed(idle, 2)  # the idle connection is closed at once ...
            f = busy.makefile("rb")
            a = read_answer(f)  # ... the busy one gets its answer, marked close, then ends
            assert a.status == 200 and a.headers["connection"] == "close"
            done.result(5)
            with pytest.raises(OSError):
                srv.connect(1).sendall(b"GET / HTTP/1.1\r\n\r\n")
        finally:
            busy.close()
            idle.close()


# ---- a complete small body taken at once (Request.complete_body) ---------------------------------

async def body_reader(request: Request) -> Answer:
    """The body as the infer route reads it: complete_body, else read_body; X-How says which."""
    try:
        body = request.complete_body()
        how = "at once" if body is not None else "read"
        if body is None:
            body = await request.read_body()
    except Exception as exc:  # (read_body's refusals: their message)
        return Answer(str(exc).encode(), {"X-How": "refused"}, 400)
    return Answer(b"".join(body), {"X-How": how})


GZIPPED = gzip.compress(b"hello", mtime=0)  # (mtime 0: the same bytes, so the same test ids, in every xdist worker)


@pytest.mark.parametrize(("sent", "how", "body"), [
    (post("/", b"hello"), "at once", b"hello"),
    (post("/", b""), "at once", b""),
    (post("/", b"hello", b"Expect:\r\n"), "at once", b"hello"),  # (perf_analyzer's empty Expect)
    (post("/", b"hello", b"Expect: 100-continue\r\n"), "read", b"hello"),
    (post("/", GZIPPED, b"Content-Encoding: gzip\r\n"), "read", b"hello"),
    (post("/", b"hello", b"X-A: 1\r\nX-A: 2\r\n"), "read", b"hello"),  # (a repeated name: header()'s first)
    (post("/", b"x" * 70_000), "read", b"x" * 70_000),  # over SMALL_BODY_BYTES
    (post("/", b"x" * 2000), "refused", None),  # over --max-request-bytes: read_body's 413
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "read", b"hello"),
])
def test_a_complete_small_body_is_taken_at_once_and_the_rest_read(sent: bytes, how: str, body: bytes | None) -> None:
    limits = dataclasses.replace(NO_TIMEOUTS, max_request_bytes=100_000 if len(sent) > 10_000 else 1000)
    with serving(body_reader, limits) as srv, srv.connect() as sock:
        sock.sendall(sent)
        f = sock.makefile("rb")
        answer = read_answer(f)
        if b"100-continue" in sent:
            assert answer.status == 100
            answer = read_answer(f)
        assert answer.headers["x-how"] == how
        if body is not None:
            assert (answer.status, answer.body) == (200, body)


def test_a_body_still_arriving_is_read() -> None:
    with serving(body_reader) as srv, srv.connect() as sock:
        sock.sendall(post("/", b"hello")[:-3])
        f = sock.makefile("rb")
        time.sleep(0.2)  # (the handler waits for the rest: nothing to take at once)
        sock.sendall(b"llo")
        answer = read_answer(f)
        assert (answer.headers["x-how"], answer.body) == ("read", b"hello")


# ---- the answer's head (render: the last head kept, Content-Length and Date per answer) ---------------

def test_an_answer_s_head_is_the_last_one_s_but_for_its_length_and_date(monkeypatch: pytest.MonkeyPatch) -> None:
    """render keeps the last answer's head (request.py:_head_last): an answer of the same status,
    headers, version and keep-alive gets it with its own Content-Length and the second's Date;
    any other is formatted (its own headers only, the Connection its request needs); a header with
    CR or LF is still refused after a kept head."""
    from email.utils import formatdate

    now = [1_800_000_000.25]
    monkeypatch.setattr(http1.request.time, "time", lambda: now[0])

    async def heads(request: Request) -> Answer:
        body = await request.body.read()
        if request.path == "/bad":
            return Answer(b"x", {"X-A": "a\r\nSet-Cookie: x"})
        if request.path == "/created":
            return Answer(body, {"Content-Type": "text/plain", "X-N": "1"}, 201)
        return Answer(body, {"Content-Type": "text/plain", "X-N": request.path[1:]})

    def date(t: float) -> str:
        return formatdate(int(t), usegmt=True)

    with serving(heads) as srv, srv.connect() as sock:
        f = sock.makefile("rb")
        for body in (b"a", b"bb", b"", b"c" * 70_000):  # the same head, another length each
            sock.sendall(post("/1", body))
            answer = read_answer(f)
            assert (answer.status, answer.body) == (200, body)
            assert answer.headers == {"content-type": "text/plain", "x-n": "1", "content-length": str(len(body)),
                                      "date": date(now[0])}
        now[0] += 1.0  # the next second: the next answer's Date
        sock.sendall(post("/1", b"d"))
        assert read_answer(f).headers["date"] == date(now[0])
        sock.sendall(post("/2", b"e"))  # other headers
        assert read_answer(f).headers == {"content-type": "text/plain", "x-n": "2", "content-length": "1",
                                          "date": date(now[0])}
        sock.sendall(post("/created", b"f"))  # the same headers as /1, another status
        answer = read_answer(f)
        assert (answer.status, answer.headers["x-n"], answer.body) == (201, "1", b"f")
        sock.sendall(post("/1", b"g"))
        answer = read_answer(f)
        assert (answer.status, answer.headers["x-n"], answer.body) == (200, "1", b"g")
        sock.sendall(b"HEAD /1 HTTP/1.1\r\nHost: x\r\n\r\n")  # the head alone, its Content-Length the body's
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += f.read(1)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nContent-Length: 0\r\n" in head
        sock.sendall(b"POST /1 HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nh")  # HTTP/1.0
        answer = read_answer(f)
        assert (answer.version, answer.headers["connection"], answer.body) == ("HTTP/1.0", "keep-alive", b"h")
        sock.sendall(post("/1", b"i"))  # HTTP/1.1 again: no Connection header
        answer = read_answer(f)
        assert (answer.version, answer.body, "connection" in answer.headers) == ("HTTP/1.1", b"i", False)
        sock.sendall(post("/bad", b""))  # after kept heads, a header with CR LF is still refused
        assert closed(sock)
    with serving(heads) as srv, srv.connect() as sock:
        f = sock.makefile("rb")
        sock.sendall(post("/1", b"j"))
        assert "connection" not in read_answer(f).headers
        sock.sendall(post("/1", b"k", b"Connection: close\r\n"))  # the same answer, closing
        answer = read_answer(f)
        assert (answer.headers["connection"], answer.body) == ("close", b"k")
        assert closed(sock)
