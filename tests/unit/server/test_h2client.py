"""meshserve.server.h2.client (our HTTP/2 client for long-lived gRPC streams) against our H2GrpcServer and a real
grpc.aio server, both on 127.0.0.1 port 0 inside the test's own event loop.

Every call is a bidi stream on raw bytes (the gateway's ModelStreamInfer use): `open_stream`,
`send`, responses to `on_message`, the end to `on_close` exactly once. The client never
half-closes, so the test handlers end a call themselves (a message b"end"). Tests wait on
conditions instead of sleeping; timeouts are generous where the point is "does not hang" and
tight only where the point is speed (a connect timeout honoured in well under 2 s).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import hpack
import pytest

from meshserve.server.h2 import (
    Channel,
    ClientStream,
    GrpcError,
    H2ClientConnection,
    H2GrpcServer,
    Status,
    connect,
    stream_stream,
    unary_unary,
)
from meshserve.server.h2.frames import ACK, DATA, END_HEADERS, END_STREAM, HEADERS, SETTINGS, frame
from tests.support import eventually_async as until
from tests.support import loop_passes
from tests.unit.server.h2_support import BaseProbe, MiB, method_path

SERVICE = "t.Client"
OK, UNKNOWN, FAILED_PRECONDITION, UNIMPLEMENTED, UNAVAILABLE = 0, 2, 9, 12, 14
GRPC_AIO_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
DETAILS = "100% sure, %41 is not A, %zz — ünïcødé ✓ 日本語 🚀, trailing %"


def path(name: str) -> str:
    return method_path(SERVICE, name)


# ---- test handlers (stream_stream on raw bytes) ------------------------------------------------
class Probe(BaseProbe):
    def __init__(self) -> None:
        super().__init__()
        self.finished = asyncio.Event()  # a handler returned normally
        self.calls = 0  # Echo calls that reached the handler


def handlers(p: Probe, ours: bool = True) -> dict[str, Any]:
    """The handlers as meshserve's h2 server takes them (`ours`), or as grpc.aio's (the same
    functions: they use only what both calls offer, but the status is set each one's way)."""
    ss = stream_stream if ours else grpc.stream_stream_rpc_method_handler

    async def echo(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        p.started.set()
        p.calls += 1
        try:
            async for m in reqs:
                if m == b"end":
                    break
                yield m
        except asyncio.CancelledError:
            p.cancelled.set()
            raise
        finally:
            p.closed.set()
        p.finished.set()

    def failing(messages_first: int) -> Callable[[AsyncIterator[bytes], Any], AsyncIterator[bytes]]:
        async def fail(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
            async for m in reqs:  # the first message is the details to fail with
                for i in range(messages_first):
                    yield b"before the error %d" % i
                if ours:
                    ctx.set_status(Status.FAILED_PRECONDITION, m.decode())
                else:
                    ctx.set_code(grpc.StatusCode.FAILED_PRECONDITION)
                    ctx.set_details(m.decode())
                return

        return fail

    async def raise_(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        async for m in reqs:
            yield b"got " + m
            raise ValueError("boom")

    async def meta(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        p.metadata.append(tuple((k, v) for k, v in ctx.invocation_metadata()))
        yield b"seen"

    async def flood(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        p.started.set()
        try:
            while True:
                yield b"f" * 65536
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            p.cancelled.set()
            raise
        finally:
            p.closed.set()

    return {"Echo": ss(echo), "Fail": ss(failing(0)), "FailLater": ss(failing(2)), "Raise": ss(raise_),
            "Meta": ss(meta), "Flood": ss(flood)}


# ---- fixtures and helpers --------------------------------------------------------------------
@dataclass
class Srv:
    kind: str
    port: int
    probe: Probe
    server: Any  # H2GrpcServer or grpc.aio.Server: both have stop(grace)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)


@contextlib.asynccontextmanager
async def serving(kind: str) -> AsyncIterator[Srv]:
    probe = Probe()
    hs = handlers(probe, ours=kind == "h2grpc")
    server: Any
    if kind == "h2grpc":
        server = H2GrpcServer()
        server.add_methods(SERVICE, hs)
        port = await server.bind("127.0.0.1", 0)
    else:
        server = grpc.aio.server(options=GRPC_AIO_OPTIONS)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, hs),))
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Srv(kind, port, probe, server)
    finally:
        await server.stop(None)


@pytest.fixture(params=["h2grpc", "grpc.aio"])
async def srv(request: pytest.FixtureRequest) -> AsyncIterator[Srv]:
    async with serving(request.param) as s:
        yield s


@pytest.fixture
async def conn(srv: Srv) -> AsyncIterator[H2ClientConnection]:
    c = await connect(srv.target, timeout=5)
    try:
        yield c
    finally:
        c.close()


async def waited(event: asyncio.Event, timeout: float = 5.0) -> None:
    await asyncio.wait_for(event.wait(), timeout)


class Call:
    """One stream and what its callbacks received."""

    def __init__(self, conn: H2ClientConnection, name: str, metadata: Iterable[tuple[str, Any]] = ()) -> None:
        self.messages: list[bytes] = []
        self.closes: list[tuple[int, str]] = []
        self.stream: ClientStream = conn.open_stream(path(name) if not name.startswith("/") else name,
                                                     metadata, self.messages.append, self._on_close)

    def _on_close(self, code: int, details: str) -> None:
        self.closes.append((code, details))

    def send(self, payload: bytes) -> None:
        self.stream.send(payload)

    async def received(self, n: int, timeout: float = 10.0) -> list[bytes]:
        await until(lambda: len(self.messages) >= n or self.closes, timeout, f"{n} messages")
        assert len(self.messages) >= n, f"closed after {len(self.messages)} of {n} messages: {self.closes}"
        return self.messages

    async def closed(self, timeout: float = 10.0) -> tuple[int, str]:
        await until(lambda: self.closes, timeout, "on_close")
        return self.closes[0]


async def dropped(conn: H2ClientConnection, timeout: float = 5.0) -> None:
    """Close the connection from our side and wait until it is gone: an on_close still
    pending (a second one for a stream already ended) would have run by then."""
    conn.close()
    await until(lambda: conn.closed, timeout, "the connection to close")
    await loop_passes()  # room for an on_close that must not come (it would be a callback already due)


class Relay:
    """A TCP relay in front of a server, so a test can cut the connection as a crash or a
    network failure would (FIN, or RST with SO_LINGER 0), whatever the server."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Relay:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.cut(reset=False)
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self.tasks.add(task)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    def cut(self, reset: bool) -> None:
        for w in self.writers:
            if w.transport.is_closing():
                continue
            if reset:
                w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
            else:
                w.close()


# ---- 1. bidi echo ------------------------------------------------------------------------------
async def test_bidi_echo_1000_messages_in_order(srv: Srv, conn: H2ClientConnection) -> None:
    call = Call(conn, "Echo")
    msgs = [b"msg %d " % i * (i % 7 + 1) for i in range(1000)]
    for m in msgs:  # all written before any answer is read: many messages per write
        call.send(m)
    assert await call.received(1000) == msgs
    assert all(type(m) is bytes for m in call.messages)
    for i in range(100):  # then one at a time: each answer before the next request
        call.send(b"ping %d" % i)
        assert (await call.received(1001 + i))[-1] == b"ping %d" % i
    assert call.closes == []
    call.send(b"end")
    assert await call.closed() == (OK, "")
    await waited(srv.probe.finished)
    with pytest.raises(ConnectionError):
        call.send(b"after the end")
    await dropped(conn)
    assert call.closes == [(OK, "")]  # exactly once, even after the connection is gone


async def test_bidi_empty_one_byte_and_20_mib_messages(srv: Srv, conn: H2ClientConnection) -> None:
    big = os.urandom(20 * MiB)  # more than every window on either side: flow control both ways
    call = Call(conn, "Echo")
    first = [b"", b"x", big, b"", b"y"]
    for m in first:
        call.send(m)
    got = await call.received(len(first), timeout=60)
    assert [len(m) for m in got] == [len(m) for m in first]
    assert got == first
    # again on the same stream and connection: the windows were used up and given back
    second = [big[::-1], b"z" * 70000, b""]
    for m in second:
        call.send(m)
    got = await call.received(len(first) + len(second), timeout=60)
    assert got[len(first):] == second
    other = Call(conn, "Echo")  # another stream on the connection still flows
    other.send(b"small")
    assert await other.received(1) == [b"small"]
    assert call.closes == other.closes == []


def _flooding_server(message: bytes) -> tuple[socket.socket, threading.Thread]:
    """A raw HTTP/2 peer in a thread of its own (so it writes while the test's loop reads, as a
    service process does): its SETTINGS, then, once the client's first HEADERS arrive, stream 1's
    answer (``message`` as one gRPC message in 1 MiB DATA frames, then OK trailers) in one
    sendall, at loopback speed. What the client sends is read and dropped."""
    listener = socket.create_server(("127.0.0.1", 0))
    encoder = hpack.Encoder()
    head = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    trailers = encoder.encode([("grpc-status", "0")])
    body = b"\0" + struct.pack(">I", len(message)) + message
    answer = (frame(SETTINGS, ACK, 0) + frame(HEADERS, END_HEADERS, 1, head)
              + b"".join(frame(DATA, 0, 1, body[i:i + MiB]) for i in range(0, len(body), MiB))
              + frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers))

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.sendall(frame(SETTINGS, 0, 0))
            seen = b""
            while True:  # the preface, then frames, until stream 1's HEADERS
                chunk = sock.recv(1 << 16)
                if not chunk:
                    return
                seen += chunk
                pos, found = 24, False
                while pos + 9 <= len(seen):
                    n = int.from_bytes(seen[pos:pos + 3], "big")
                    found = found or (seen[pos + 3] == HEADERS and int.from_bytes(seen[pos + 5:pos + 9], "big") == 1)
                    pos += 9 + n
                if found:
                    break
            sock.sendall(answer)
            while sock.recv(1 << 16):  # (the client's window updates, until it closes)
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_large_answer_is_read_at_most_a_read_burst_per_loop_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server answering at loopback speed is read at most READ_BURST bytes (plus the read that
    passes it) per loop pass, on uvloop as in production: the connection's reading pauses until
    the next pass, so the process's other connections' callbacks come between (libuv would read
    one readable socket up to 32 times, 256 KiB each, in one pass: the gateway's loop was held by
    a python service streaming 1 MiB answers, tests/adversarial/test_stream_backlog.py). The
    answer still arrives whole."""
    uvloop = pytest.importorskip("uvloop")
    from meshserve.server.limits import READ_BURST
    passes = [0]
    per_pass: dict[int, int] = {}
    received = H2ClientConnection.data_received

    def counted(c: H2ClientConnection, data: bytes) -> None:
        per_pass[passes[0]] = per_pass.get(passes[0], 0) + len(data)
        received(c, data)

    monkeypatch.setattr(H2ClientConnection, "data_received", counted)
    message = os.urandom(12 * MiB)  # (within the client's 16 MiB stream window: sent without waiting)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        listener, thread = _flooding_server(message)
        running = [True]

        def tick() -> None:  # once per loop pass
            passes[0] += 1
            if running[0]:
                loop.call_soon(tick)

        conn = await connect(f"127.0.0.1:{listener.getsockname()[1]}", timeout=5)
        try:
            loop.call_soon(tick)
            call = Call(conn, "Echo")
            call.send(b"go")
            assert await call.received(1, timeout=60) == [message]
            assert await call.closed() == (OK, "")
        finally:
            running[0] = False
            conn.close()
            listener.close()
            await asyncio.to_thread(thread.join, 10)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(scenario(), 60))
    assert max(per_pass.values()) <= READ_BURST + (256 << 10), sorted(per_pass.values())[-5:]


# ---- 2. many streams on one connection -----------------------------------------------------------
async def test_50_concurrent_streams_interleave(srv: Srv, conn: H2ClientConnection) -> None:
    calls = [Call(conn, "Echo") for _ in range(50)]

    def message(i: int, j: int) -> bytes:
        return b"s%d-m%d-" % (i, j) + (bytes((i,)) * 50_000 if j % 10 == 3 else b"")

    for j in range(40):  # round-robin, so frames of different streams interleave on the wire
        for i, c in enumerate(calls):
            c.send(message(i, j))
    for i, c in enumerate(calls):
        assert await c.received(40, timeout=30) == [message(i, j) for j in range(40)], f"stream {i}"
    for c in calls:
        c.send(b"end")
    for c in calls:
        assert await c.closed() == (OK, "")
    assert conn.usable
    await dropped(conn)
    assert all(c.closes == [(OK, "")] for c in calls)


# ---- 3. how calls end ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["Fail", "FailLater"], ids=["trailers-only", "after-messages"])
async def test_error_code_and_details_reach_on_close_once(srv: Srv, conn: H2ClientConnection,
                                                          method: str) -> None:
    call = Call(conn, method)
    call.send(DETAILS.encode())
    assert await call.closed() == (FAILED_PRECONDITION, DETAILS)
    assert call.messages == ([b"before the error 0", b"before the error 1"] if method == "FailLater" else [])
    await dropped(conn)
    assert call.closes == [(FAILED_PRECONDITION, DETAILS)]


async def test_handler_exception_is_unknown(srv: Srv, conn: H2ClientConnection) -> None:
    call = Call(conn, "Raise")
    call.send(b"this")
    code, details = await call.closed()
    assert code == UNKNOWN
    assert "ValueError" in details
    if srv.kind == "h2grpc":  # ours names the type, never the exception's text (a path, data): issue 29 item 7
        assert "boom" not in details
    else:  # grpc.aio's own "Unexpected <class 'ValueError'>: boom"
        assert "boom" in details
    assert call.messages == [b"got this"]
    ok = Call(conn, "Echo")  # the connection is unaffected
    ok.send(b"still here")
    assert await ok.received(1) == [b"still here"]
    await dropped(conn)
    assert len(call.closes) == 1


@pytest.mark.parametrize("method", [path("Missing"), "/no.Such/Service"])
async def test_unknown_method_is_unimplemented(srv: Srv, conn: H2ClientConnection, method: str) -> None:
    call = Call(conn, method)
    code, _ = await call.closed()
    assert code == UNIMPLEMENTED
    with pytest.raises(ConnectionError):
        call.send(b"too late")
    ok = Call(conn, "Echo")
    ok.send(b"still here")
    assert await ok.received(1) == [b"still here"]
    await dropped(conn)
    assert len(call.closes) == 1


# ---- 4. the connection dies ------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "fin", "reset"])
async def test_lost_connection_ends_every_open_stream_once(srv: Srv, how: str) -> None:
    async with Relay(srv.port) as relay:
        target = f"127.0.0.1:{relay.port}"
        conn = await connect(target, timeout=5)
        try:
            finished = Call(conn, "Echo")
            finished.send(b"end")
            assert await finished.closed() == (OK, "")
            calls = [Call(conn, "Echo") for _ in range(3)]
            for i, c in enumerate(calls):
                c.send(b"hi %d" % i)
            for i, c in enumerate(calls):  # every handler is running
                assert await c.received(1) == [b"hi %d" % i]
            if how == "stop":
                await asyncio.wait_for(srv.stop(grace=0), 5)
            else:
                relay.cut(reset=how == "reset")
            for c in calls:
                await c.closed()
            await until(lambda: conn.closed, 5, "the connection to close")
            await loop_passes()  # room for a second on_close, which must not come
            for c in calls:
                assert len(c.closes) == 1, c.closes
                code, details = c.closes[0]
                assert code == UNAVAILABLE
                if srv.kind == "grpc.aio" and how == "stop":
                    # grpc ends its calls with a status of its own (UNAVAILABLE, "Cancelling
                    # all calls") before it closes the connection: the client passes that on
                    assert details, details
                else:
                    assert f"connection to {target} lost" in details, details
            assert finished.closes == [(OK, "")]
            assert not conn.usable
            for c in calls:
                with pytest.raises(ConnectionError):
                    c.send(b"after the loss")
            with pytest.raises(ConnectionError):
                Call(conn, "Echo")
        finally:
            conn.close()


# ---- 5. cancel -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["Echo", "Flood"])
async def test_cancel_cancels_the_handler_without_on_close(srv: Srv, conn: H2ClientConnection,
                                                           method: str) -> None:
    call = Call(conn, method)
    call.send(b"hello")
    await call.received(3 if method == "Flood" else 1)
    call.stream.cancel()
    await waited(srv.probe.closed)  # the handler is gone (a flood may end at a yield, not an await)
    if method == "Echo" and srv.kind == "h2grpc":
        await waited(srv.probe.cancelled)
    # grpc.aio does not cancel a handler that waits for requests: on RST_STREAM(CANCEL) its
    # request iterator just ends (the same with grpcio's own client's cancel()); the handler
    # ending is what shows the reset arrived, since this client never half-closes
    with pytest.raises(ConnectionError):
        call.send(b"after cancel")
    call.stream.cancel()  # twice is harmless
    assert conn.usable
    for i in range(3):  # responses for the cancelled stream still in flight do not disturb others
        fresh = Call(conn, "Echo")
        fresh.send(b"fresh %d" % i)
        assert await fresh.received(1) == [b"fresh %d" % i]
        fresh.send(b"end")
        assert await fresh.closed() == (OK, "")
    await dropped(conn)
    assert call.closes == []


# ---- 6. connect ------------------------------------------------------------------------------------
async def test_connect_to_a_closed_port_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        t0 = time.monotonic()
        with pytest.raises(OSError):
            await connect(f"127.0.0.1:{port}", timeout=5)
        assert time.monotonic() - t0 < 2.0


async def test_a_server_that_dies_before_its_settings_fails_the_connect_at_once() -> None:
    """The TCP handshake done, the peer closes before sending SETTINGS (a process killed while
    its listening socket still took connections): the connect fails as the connection drops,
    not after the whole timeout (a gateway stream waited the full 5 s on one)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="before its HTTP/2 SETTINGS"):
            await connect(f"127.0.0.1:{port}", timeout=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        server.close()
        await server.wait_closed()


async def test_connect_timeout_is_honoured() -> None:
    """A listener whose accept queue is full drops SYNs: the connect hangs until the timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(3):
                f = socket.socket()
                f.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    f.connect(("127.0.0.1", port))
                fillers.append(f)
            t0 = time.monotonic()
            try:
                conn = await connect(f"127.0.0.1:{port}", timeout=0.3)
            except TimeoutError:
                pass
            else:
                conn.close()
                pytest.skip("this kernel does not drop SYNs to a listener with a full accept queue")
            elapsed = time.monotonic() - t0
            assert 0.25 <= elapsed < 2.0, elapsed
        finally:
            for f in fillers:
                f.close()


# ---- 7. GOAWAY -------------------------------------------------------------------------------------
async def test_graceful_stop_lets_the_open_stream_finish(srv: Srv, conn: H2ClientConnection) -> None:
    call = Call(conn, "Echo")
    call.send(b"before")
    assert await call.received(1) == [b"before"]
    stopping = asyncio.ensure_future(srv.stop(grace=3))
    await until(lambda: not conn.usable, 5, "GOAWAY")
    assert not conn.closed  # the call in flight keeps the connection
    with pytest.raises(ConnectionError):
        Call(conn, "Echo")
    call.send(b"after goaway")
    assert await call.received(2) == [b"before", b"after goaway"]
    assert call.closes == []
    call.send(b"end")
    assert await call.closed() == (OK, "")
    await waited(srv.probe.finished)
    assert not srv.probe.cancelled.is_set()
    await asyncio.wait_for(stopping, 5)
    await until(lambda: conn.closed, 5, "the server to close the connection")
    assert call.closes == [(OK, "")]
    assert not conn.usable
    with pytest.raises(ConnectionError):
        Call(conn, "Echo")


async def test_a_stream_crossing_the_goaway_ends_unavailable_once() -> None:
    """A stream whose HEADERS leave after the server's GOAWAY (last stream id below it) was not
    processed: UNAVAILABLE (safe to retry), exactly once, although the server also refuses it
    with RST_STREAM(REFUSED_STREAM) and then closes the connection."""
    async with serving("h2grpc") as srv:
        conn = await connect(srv.target, timeout=5)
        try:
            first = Call(conn, "Echo")
            first.send(b"one")
            assert await first.received(1) == [b"one"]
            stopping = asyncio.ensure_future(srv.stop(grace=3))  # runs (sends GOAWAY) before ...
            late = Call(conn, "Echo")  # ... this stream's HEADERS are flushed
            late.send(b"too late")
            code, details = await late.closed()
            assert code == UNAVAILABLE
            assert "not processed" in details or "refused" in details, details
            first.send(b"end")
            assert await first.closed() == (OK, "")
            await asyncio.wait_for(stopping, 5)
            await until(lambda: conn.closed, 5, "the server to close the connection")
            assert srv.probe.calls == 1  # the late stream never reached a handler
            assert late.messages == [] and len(late.closes) == 1
            assert first.closes == [(OK, "")]
        finally:
            conn.close()


# ---- 8. metadata -----------------------------------------------------------------------------------
async def test_metadata_reaches_the_handler(srv: Srv, conn: H2ClientConnection) -> None:
    blob = bytes(range(256))
    call = Call(conn, "Meta", metadata=(("x-plain", "hello world"), ("x-blob-bin", blob), ("x-one-bin", b"\xff"),
                                        ("x-two-bin", b"\x00\xfe"), ("x-multi", "a"), ("x-multi", "b")))
    assert await call.received(1) == [b"seen"]
    assert await call.closed() == (OK, "")
    md = srv.probe.metadata[-1]
    assert ("x-plain", "hello world") in md
    assert ("x-blob-bin", blob) in md
    assert ("x-one-bin", b"\xff") in md  # unpadded base64 of 1 and 2 bytes
    assert ("x-two-bin", b"\x00\xfe") in md
    assert [v for k, v in md if k == "x-multi"] == ["a", "b"]


async def test_open_stream_that_raises_leaves_no_stream_behind() -> None:
    """Metadata that cannot be encoded (a key with a lone surrogate: UnicodeEncodeError in pure
    Python and compiled alike; a key that is not a string fails too, AttributeError pure and the
    declared type's TypeError compiled): open_stream raises, and the caller, who got no stream,
    must never hear of it again (no on_close when the connection goes)."""
    async with serving("h2grpc") as srv:
        conn = await connect(srv.target, timeout=5)
        try:
            closes: list[tuple[int, str]] = []
            with pytest.raises(UnicodeEncodeError):
                conn.open_stream(path("Echo"), (("x-\udc80", "v"),), lambda m: None,
                                 lambda code, details: closes.append((code, details)))
            ok = Call(conn, "Echo")  # the connection is unaffected
            ok.send(b"fine")
            assert await ok.received(1) == [b"fine"]
            await dropped(conn)
            assert closes == [], "on_close called for a stream open_stream refused"
            assert len(ok.closes) == 1
        finally:
            conn.close()


# ---- 9. compressed responses, closing from our side, endpoints ---------------------------------------
@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate], ids=["gzip", "deflate"])
async def test_compressed_responses_are_decompressed(compression: grpc.Compression) -> None:
    """grpc.aio compresses responses when the client accepts it (grpc-accept-encoding)."""
    async def echo(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        async for m in reqs:
            yield m

    server = grpc.aio.server(options=GRPC_AIO_OPTIONS, compression=compression)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.stream_stream_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn = await connect(f"127.0.0.1:{port}", timeout=5)
    try:
        call = Call(conn, "Echo", metadata=(("grpc-accept-encoding", "identity,deflate,gzip"),))
        msgs = [b"compress me " * 1000, b"", os.urandom(100_000), b"x", b"a" * (3 * MiB)]
        for m in msgs:
            call.send(m)
        assert await call.received(len(msgs), timeout=30) == msgs
        assert call.closes == []
    finally:
        conn.close()
        await server.stop(None)


async def test_close_ends_open_streams_and_refuses_new_ones_at_once(srv: Srv, conn: H2ClientConnection) -> None:
    calls = [Call(conn, "Echo") for _ in range(2)]
    for c in calls:
        c.send(b"hi")
    for c in calls:
        await c.received(1)
    conn.close()
    usable_after_close = conn.usable  # before the loop has run connection_lost
    try:
        opened_after_close: Call | None = Call(conn, "Echo")
    except ConnectionError:
        opened_after_close = None
    for c in calls:
        code, details = await c.closed()
        assert code == UNAVAILABLE and f"connection to {srv.target} lost" in details, details
    await until(lambda: conn.closed, 5, "the connection to close")
    await loop_passes()  # room for a second on_close that must not come
    assert all(len(c.closes) == 1 for c in calls)
    assert not conn.usable
    with pytest.raises(ConnectionError):
        Call(conn, "Echo")
    # Right after close() the connection must already say so: a pool that checks `usable`
    # would otherwise hand out a connection whose writes are silently dropped.
    assert not usable_after_close, "conn.usable is True right after conn.close()"
    assert opened_after_close is None, "open_stream succeeded on a connection already closed"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("form", ["{h}:{p}", "dns:///{h}:{p}", "localhost:{p}", "[::1]:{p}", "dns:///[::1]:{p}"])
async def test_connect_endpoint_forms(form: str) -> None:
    ipv6 = "::1" in form
    if ipv6 and not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    server = H2GrpcServer()
    server.add_methods(SERVICE, handlers(Probe()))
    port = await server.bind("::1" if ipv6 else "127.0.0.1", 0)
    await server.start()
    try:
        conn = await connect(form.format(h="127.0.0.1", p=port), timeout=5)
        try:
            call = Call(conn, "Echo")
            call.send(b"hello")
            assert await call.received(1) == [b"hello"]
        finally:
            conn.close()
    finally:
        await server.stop(None)


# ---- the client and our server on uvloop (the gateway's loop) --------------------------------------
def test_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        async with serving("h2grpc") as srv:
            conn = await connect(srv.target, timeout=5)
            try:
                call = Call(conn, "Echo")
                msgs = [b"m%d" % i * (i % 5) for i in range(1000)] + [os.urandom(20 * MiB), b""]
                for m in msgs:
                    call.send(m)
                assert await call.received(len(msgs), timeout=60) == msgs
                cancelled = Call(conn, "Echo")
                cancelled.send(b"x")
                await cancelled.received(1)
                cancelled.stream.cancel()
                await waited(srv.probe.cancelled)
                await asyncio.wait_for(srv.stop(grace=0), 5)
                code, details = await call.closed()
                assert code == UNAVAILABLE and "lost" in details
                await until(lambda: conn.closed, 5, "the connection to close")
                assert cancelled.closes == [] and len(call.closes) == 1
            finally:
                conn.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(scenario(), 60))


# ---- 10. unary calls and the reconnecting Channel (the load generator's gRPC client) ------------
async def _unary_server(port: int = 0) -> tuple[H2GrpcServer, int]:
    async def echo(req: bytes, ctx: Any) -> bytes:
        if req == b"fail":
            await ctx.abort(Status.FAILED_PRECONDITION, DETAILS)
        if req == b"slow":
            await asyncio.Event().wait()  # never set: the client's deadline ends the call
        md = dict(ctx.invocation_metadata())
        return req + md.get("x-tag", "").encode()

    server = H2GrpcServer()
    server.add_methods(SERVICE, {"Unary": unary_unary(echo)})
    bound = await server.bind("127.0.0.1", port)
    await server.start()
    return server, bound


async def test_unary_ok_error_and_deadline() -> None:
    server, port = await _unary_server()
    conn = await connect(f"127.0.0.1:{port}", timeout=5)
    try:
        assert await conn.unary(path("Unary"), b"hi", (("x-tag", "!"),)) == b"hi!"
        big = os.urandom(3 * MiB)  # flow control on a half-closed request
        assert await conn.unary(path("Unary"), big) == big
        with pytest.raises(GrpcError) as err:
            await conn.unary(path("Unary"), b"fail")
        assert (err.value.code, err.value.details) == (FAILED_PRECONDITION, DETAILS)
        t0 = time.monotonic()
        with pytest.raises(GrpcError) as err:
            await conn.unary(path("Unary"), b"slow", timeout=0.3)
        assert err.value.code == 4 and time.monotonic() - t0 < 2.0
        with pytest.raises(GrpcError) as err:
            await conn.unary(path("Nope"), b"x")
        assert err.value.code == UNIMPLEMENTED
        assert conn.usable  # errors end calls, not the connection
    finally:
        conn.close()
        await server.stop(0)


class _Silent(asyncio.Protocol):
    """An HTTP/2 server that says SETTINGS and then answers nothing (nor enforces any deadline):
    only the client's own timer can end its calls. Keeps what it reads."""

    def __init__(self, got: bytearray) -> None:
        self.got = got

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.got += data


async def test_unary_deadlines_are_the_clients_own() -> None:
    """H2ClientConnection's one deadline timer (no wait_for per call): a call past its timeout
    ends with DEADLINE_EXCEEDED and its stream is reset, a later deadline waits its turn, and the
    header block of repeated calls is made once (H2ClientConnection.blocks)."""
    got = bytearray()
    srv = await asyncio.get_running_loop().create_server(lambda: _Silent(got), "127.0.0.1", 0)
    conn = await connect(f"127.0.0.1:{srv.sockets[0].getsockname()[1]}", timeout=5)
    try:
        t0 = time.monotonic()
        late = asyncio.ensure_future(conn.unary(path("Unary"), b"late", timeout=30))
        await loop_passes()  # (it starts first: stream 1)
        with pytest.raises(GrpcError) as err:
            await conn.unary(path("Unary"), b"soon", timeout=0.3)
        assert (err.value.code, err.value.details) == (4, "Deadline Exceeded") and 0.25 < time.monotonic() - t0 < 5
        await until(lambda: struct.pack(">BHBBI", 0, 4, 3, 0, 3) + struct.pack(">I", 8) in got, 5.0,
                    "RST_STREAM(CANCEL) of the expired call")  # (stream 3: the second call)
        assert not late.done() and list(conn.streams) == [1]
        second = asyncio.ensure_future(conn.unary(path("Unary"), b"late", timeout=30))
        await loop_passes()
        assert len(conn.blocks) == 2  # (the two 30 s calls share one block, the 0.3 s call has its own)
        late.cancel()
        second.cancel()
        for call in (late, second):
            with pytest.raises(asyncio.CancelledError):
                await call
        assert conn.streams == {}
    finally:
        conn.close()
        srv.close()


async def test_channel_reconnects_after_the_server_restarts() -> None:
    server, port = await _unary_server()
    channel = Channel(f"127.0.0.1:{port}", connect_timeout=5)
    try:
        first = await channel.get()
        assert await channel.get() is first  # reused while usable
        assert await first.unary(path("Unary"), b"a") == b"a"
        await server.stop(0)
        await until(lambda: not first.usable, 5.0, "the connection to break")
        with pytest.raises(OSError):
            await channel.get()  # nothing listening: a clear connection error, no hang
        server, _ = await _unary_server(port)
        second = await channel.get()
        assert second is not first and await second.unary(path("Unary"), b"b") == b"b"
    finally:
        channel.close()
        await server.stop(0)
