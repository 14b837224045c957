"""meshserve.server.h2.H2GrpcServer conformance: the real grpcio client (aio and sync), a strict HTTP/2
client (the `h2` package) and hand-built frames against small test handlers.

Every server listens on 127.0.0.1 port 0 inside the test's own event loop (the thread-based
tests at the end run it on a loop of their own, stdlib asyncio and uvloop, for the sync
client). Timeouts are generous where the point is "does not hang" and tight only where the
point is speed (a deadline answered in well under 2 s).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import os
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import hpack
import pytest

from meshserve._proto import health_pb2
from meshserve.server import access
from meshserve.server.grpc_frontend import methods
from meshserve.server.h2 import (
    H2GrpcServer,
    Method,
    Status,
    stream_stream,
    stream_unary,
    unary_stream,
    unary_unary,
)
from meshserve.server.h2 import connect as h2_connect
from meshserve.server.health import NOT_SERVING, SERVING, HealthServicer, HealthState
from tests.support import eventually_async, loop_passes, slow
from tests.unit.server.h2_support import BaseProbe, MiB, method_path

try:
    import h2.config
    import h2.connection
    import h2.errors
    import h2.events
    import h2.settings
except ImportError:  # pragma: no cover - h2 is in the dev extra
    h2 = None  # type: ignore[assignment]

needs_h2 = pytest.mark.skipif(h2 is None, reason="needs the h2 package (pip install h2)")

SERVICE = "t.Test"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 0),
]


def path(name: str) -> str:
    return method_path(SERVICE, name)


# ---- test handlers ---------------------------------------------------------------------------
class Probe(BaseProbe):
    def __init__(self) -> None:
        super().__init__()
        self.cancelled_in: list[str] = []  # which handler saw the CancelledError
        self.time_remaining: list[float | None] = []
        self.peers: list[str] = []
        self.received: list[Any] = []
        self.done_cancelled: list[bool] = []
        self.release = asyncio.Event()  # lets the Hold handler read on

    def cancel(self, handler: str) -> None:
        self.cancelled_in.append(handler)
        self.cancelled.set()


def handlers(p: Probe) -> dict[str, Method]:
    uu, us, su, ss = unary_unary, unary_stream, stream_unary, stream_stream

    async def echo(req: bytes, ctx: Any) -> bytes:
        return req

    async def reverse(req: bytes, ctx: Any) -> bytes:
        return req[::-1]

    async def jitter(req: bytes, ctx: Any) -> bytes:
        await loop_passes(random.Random(req).randrange(40))  # answers complete out of order
        return req

    async def fill(req: bytes, ctx: Any) -> bytes:
        n = int(req)
        return (b"0123456789abcdef" * (n // 16 + 1))[:n]

    async def sleep(req: bytes, ctx: Any) -> bytes:
        p.started.set()
        try:
            await slow.work_for_async(float(req or b"5"))
        except asyncio.CancelledError:
            p.cancel("sleep")
            raise
        return b"slept"

    async def info(req: bytes, ctx: Any) -> bytes:
        p.metadata.append(ctx.invocation_metadata())
        p.time_remaining.append(ctx.time_remaining())
        p.peers.append(ctx.peer())
        ctx.set_trailing_metadata((("x-trailer", "t1"), ("x-trailer-bin", b"\x00\x01\xfe\xff")))
        return b"info"

    async def initial(req: bytes, ctx: Any) -> bytes:
        await ctx.send_initial_metadata((("x-initial", "i1"), ("x-initial-bin", b"\x00\xff")))
        return b"with initial metadata"

    async def big_trailer(req: bytes, ctx: Any) -> bytes:
        ctx.set_trailing_metadata((("x-big", "v" * int(req)),))
        return b"ok"

    async def set_code(req: bytes, ctx: Any) -> bytes:
        ctx.set_status(Status.NOT_FOUND, "no such thing")
        return b"this response must be dropped"

    async def set_code_none(req: bytes, ctx: Any) -> None:  # grpc_frontend._fail's way
        ctx.set_status(Status.INVALID_ARGUMENT, "bad argument")
        return None

    async def abort(req: bytes, ctx: Any) -> bytes:
        await ctx.abort(Status.PERMISSION_DENIED, "go away", trailing_metadata=(("x-why", "because"),))
        raise AssertionError("abort() returned")

    async def raise_(req: bytes, ctx: Any) -> bytes:
        raise ValueError("boom")

    async def details(req: bytes, ctx: Any) -> None:
        ctx.set_status(Status.FAILED_PRECONDITION, req.decode())

    async def done_callback(req: bytes, ctx: Any) -> bytes:
        ctx.add_done_callback(lambda c: p.done_cancelled.append(c.cancelled()))
        if req:
            return await sleep(req, ctx)
        return b"done"

    async def count(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        for i in range(int(req)):
            yield b"%d" % i

    async def write(req: bytes, ctx: Any) -> None:
        for i in range(int(req)):
            await ctx.write(b"w%d" % i)

    async def big_stream(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        n, size = (int(x) for x in req.split(b"x"))
        for i in range(n):
            yield bytes((i % 251,)) * size

    async def forever(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        p.started.set()
        try:
            i = 0
            while True:
                yield b"%d" % i
                i += 1
                await asyncio.sleep(0.001)  # the point: too slow to fill the window: a cancel finds it in its own await
        except asyncio.CancelledError:
            p.cancel("forever")
            raise
        finally:
            p.closed.set()

    async def firehose(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        p.started.set()
        try:
            while True:  # never awaits: only the server's flow-control wait can stop it
                yield b"x" * 16384
        finally:
            p.closed.set()

    async def slow_stream(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        yield b"first"
        try:
            await asyncio.Event().wait()  # never set: the call's deadline ends it
        except asyncio.CancelledError:
            p.cancel("slow_stream")
            raise
        yield b"never"

    async def partial_abort(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        for i in range(3):
            yield b"%d" % i
        await ctx.abort(Status.DATA_LOSS, "partial")

    async def partial_raise(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        yield b"0"
        yield b"1"
        raise RuntimeError("stream broke")

    async def concat(reqs: AsyncIterator[bytes], ctx: Any) -> bytes:
        parts = [m async for m in reqs]
        p.received.extend(parts)
        return struct.pack(">I", len(parts)) + b"".join(parts)

    async def first(reqs: AsyncIterator[bytes], ctx: Any) -> bytes:
        async for m in reqs:
            return b"first:" + m
        return b"none"

    async def hold(reqs: AsyncIterator[bytes], ctx: Any) -> bytes:
        """Reads one message, then nothing until released; answers how many it read."""
        n = 0
        async for _ in reqs:
            n += 1
            if n == 1:
                p.started.set()
                await p.release.wait()
        return b"%d" % n

    async def bidi(reqs: AsyncIterator[bytes], ctx: Any) -> AsyncIterator[bytes]:
        p.started.set()
        try:
            async for m in reqs:
                yield m
        except asyncio.CancelledError:
            p.cancel("bidi")
            raise
        finally:
            p.closed.set()

    return {
        "Echo": uu(echo), "Reverse": uu(reverse), "Jitter": uu(jitter), "Fill": uu(fill), "Sleep": uu(sleep),
        "Info": uu(info), "Initial": uu(initial), "BigTrailer": uu(big_trailer), "SetCode": uu(set_code),
        "SetCodeNone": uu(set_code_none), "Abort": uu(abort), "Raise": uu(raise_), "Details": uu(details),
        "DoneCallback": uu(done_callback),
        "Count": us(count), "Write": us(write), "BigStream": us(big_stream), "Forever": us(forever),
        "Firehose": us(firehose), "SlowStream": us(slow_stream), "PartialAbort": us(partial_abort),
        "PartialRaise": us(partial_raise),
        "Concat": su(concat), "First": su(first), "Hold": su(hold),
        "Bidi": ss(bidi),
    }


# ---- fixtures and helpers --------------------------------------------------------------------
@dataclass
class Env:
    server: H2GrpcServer
    port: int
    probe: Probe
    channel: grpc.aio.Channel

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def unary(self, name: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(path(name))

    def unary_stream(self, name: str) -> grpc.aio.UnaryStreamMultiCallable:
        return self.channel.unary_stream(path(name))

    def stream_unary(self, name: str) -> grpc.aio.StreamUnaryMultiCallable:
        return self.channel.stream_unary(path(name))

    def stream_stream(self, name: str) -> grpc.aio.StreamStreamMultiCallable:
        return self.channel.stream_stream(path(name))


@contextlib.asynccontextmanager
async def serving(**kwargs: Any) -> AsyncIterator[Env]:
    probe = Probe()
    server = H2GrpcServer(**kwargs)
    server.add_methods(SERVICE, handlers(probe))
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        yield Env(server, port, probe, channel)
    finally:
        await channel.close()
        await server.stop(None)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with serving() as e:
        yield e


async def rpc_error(aw: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await aw
    return info.value


async def waited(event: asyncio.Event, timeout: float = 5.0) -> None:
    await asyncio.wait_for(event.wait(), timeout)


async def still_serving(e: Env) -> None:
    """A fresh connection and the existing channel both still get answers."""
    assert await e.unary("Echo")(b"still here", timeout=10) == b"still here"
    async with grpc.aio.insecure_channel(e.target) as ch:
        assert await ch.unary_unary(path("Echo"))(b"new connection", timeout=10) == b"new connection"


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


def grpc_messages(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        flag, n = struct.unpack_from(">BI", data, pos)
        assert flag == 0, "responses go uncompressed"
        out.append(bytes(data[pos + 5:pos + 5 + n]))
        pos += 5 + n
    assert pos == len(data), "trailing bytes after the last message"
    return out


# ---- 1. unary ---------------------------------------------------------------------------------
async def test_unary_round_trip(env: Env) -> None:
    assert await env.unary("Echo")(b"hello", timeout=10) == b"hello"
    assert await env.unary("Echo")(b"", timeout=10) == b""  # an empty message is still one message
    assert await env.unary("Reverse")(bytes(range(256)), timeout=10) == bytes(range(256))[::-1]


async def test_unary_round_trip_sync_client(env: Env) -> None:
    def call() -> list[bytes]:
        with grpc.insecure_channel(env.target) as ch:
            echo = ch.unary_unary(path("Echo"))
            return [echo(b"sync %d" % i, timeout=10) for i in range(20)]

    assert await asyncio.to_thread(call) == [b"sync %d" % i for i in range(20)]


async def test_200_concurrent_unary_calls_get_their_own_answers(env: Env) -> None:
    requests = [b"req-%03d-" % i + os.urandom(i * 37) for i in range(200)]
    async with grpc.aio.insecure_channel(env.target, options=CHANNEL_OPTIONS) as second:
        callables = [env.unary("Jitter"), second.unary_unary(path("Jitter"))]
        answers = await asyncio.gather(*(callables[i % 2](r, timeout=30) for i, r in enumerate(requests)))
    assert answers == requests


# ---- 2. large messages -----------------------------------------------------------------------
async def test_20_mib_request_and_20_mib_response(env: Env) -> None:
    request = os.urandom(20 * MiB)
    response = await env.unary("Reverse")(request, timeout=60)
    assert len(response) == len(request)
    assert response == request[::-1]
    # a second big exchange on the same connection (windows were consumed and replenished)
    assert await env.unary("Fill")(b"%d" % (20 * MiB), timeout=60) == (b"0123456789abcdef" * (20 * MiB // 16))


async def test_large_server_stream_messages(env: Env) -> None:
    # Fresh connections: grpc's BDP probing raises SETTINGS_INITIAL_WINDOW_SIZE while the big
    # messages flow, which is when window bookkeeping mistakes show.
    for _ in range(3):
        async with grpc.aio.insecure_channel(env.target, options=CHANNEL_OPTIONS) as ch:
            call = ch.unary_stream(path("BigStream"))(b"40x262144", timeout=60)
            got = [m async for m in call]
            assert len(got) == 40
            assert all(m == bytes((i % 251,)) * 262144 for i, m in enumerate(got))


# ---- 3. request compression --------------------------------------------------------------------
@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
async def test_compressed_requests_are_decompressed(env: Env, compression: grpc.Compression) -> None:
    compressible = b"compress me please " * 20000  # 380 kB, compresses to ~1 kB
    for payload in (b"x", compressible, os.urandom(70000)):
        assert await env.unary("Echo")(payload, compression=compression, timeout=10) == payload
    async with grpc.aio.insecure_channel(env.target, options=CHANNEL_OPTIONS, compression=compression) as ch:
        assert await ch.unary_unary(path("Echo"))(compressible, timeout=10) == compressible

        async def parts() -> AsyncIterator[bytes]:
            for i in range(20):
                yield b"part %d " % i * (i * 100)

        answer = await ch.stream_unary(path("Concat"))(parts(), timeout=10)
        assert answer == struct.pack(">I", 20) + b"".join(b"part %d " % i * (i * 100) for i in range(20))


# ---- 4. deadline --------------------------------------------------------------------------------
async def test_deadline_exceeded_cancels_the_handler(env: Env) -> None:
    t0 = time.monotonic()
    err = await rpc_error(env.unary("Sleep")(b"5", timeout=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 2.0
    await waited(env.probe.cancelled, 2.0)
    await still_serving(env)


async def test_deadline_during_a_server_stream(env: Env) -> None:
    call = env.unary_stream("SlowStream")(b"", timeout=0.5)
    assert await call.read() == b"first"
    err = await rpc_error(call.read())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await waited(env.probe.cancelled, 2.0)


async def test_server_deadlines_of_calls_on_one_connection(env: Env) -> None:
    """The server's one deadline timer per connection, alone: our own client sends grpc-timeout
    and never cancels, so only the server's DEADLINE_EXCEEDED ends these calls. A call answered
    before its deadline leaves the timer set for it (3 s); later calls with shorter deadlines set
    it earlier; each call ends at its own deadline, the second once the first's has fired."""
    conn = await h2_connect(env.target)
    loop = asyncio.get_running_loop()
    ended: dict[str, tuple[int, float]] = {}
    t0 = loop.time()

    def call(name: str, method: str, payload: bytes, timeout: str) -> None:
        def on_close(code: int, details: str) -> None:
            ended[name] = (code, loop.time() - t0)
        conn.open_stream(path(method), (("grpc-timeout", timeout),), lambda m: None, on_close).send(payload, True)

    try:
        call("quick", "Echo", b"x", "3000m")
        await eventually_async(lambda: "quick" in ended)
        call("long", "Sleep", b"5", "1500m")
        call("short", "Sleep", b"5", "300m")
        await eventually_async(lambda: len(ended) == 3, timeout=10)
        assert ended["quick"][0] == Status.OK
        assert ended["short"][0] == ended["long"][0] == Status.DEADLINE_EXCEEDED
        assert 0.25 < ended["short"][1] < 1.2, ended
        assert 1.45 < ended["long"][1] < 5.0, ended
        assert env.probe.cancelled_in == ["sleep", "sleep"]
    finally:
        conn.close()


# ---- 5. client cancellation ------------------------------------------------------------------------
async def test_client_cancel_cancels_the_handler(env: Env) -> None:
    call = env.unary("Sleep")(b"5")
    await waited(env.probe.started)
    assert call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await waited(env.probe.cancelled, 2.0)
    await still_serving(env)


async def test_closing_the_channel_cancels_handlers(env: Env) -> None:
    async with grpc.aio.insecure_channel(env.target) as ch:
        task = asyncio.ensure_future(ch.unary_unary(path("Sleep"))(b"5"))
        await waited(env.probe.started)
    with pytest.raises((grpc.aio.AioRpcError, asyncio.CancelledError)):
        await task
    await waited(env.probe.cancelled, 2.0)
    await still_serving(env)


@pytest.mark.parametrize("abort", [False, True], ids=["fin", "reset"])
async def test_a_dropped_connection_cancels_handlers(env: Env, abort: bool) -> None:
    """The TCP connection goes away without RST_STREAM: connection_lost must cancel the calls."""
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    raw.send(PREFACE + settings()
             + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Sleep")) + frame(DATA, END_STREAM, 1, grpc_message(b"5"))
             + frame(HEADERS, END_HEADERS, 3, request_headers(enc, "Bidi")) + frame(DATA, 0, 3, grpc_message(b"hi")))
    await waited(env.probe.started)
    await raw.read_until(lambda fs: any(t == DATA and s == 3 for t, _, s, _ in fs), 5.0)
    if abort:
        sock = raw.writer.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()
    await waited(env.probe.closed, 2.0)
    await eventually_async(lambda: len(env.probe.cancelled_in) == 2, 2.0, "both handlers cancelled")
    assert sorted(env.probe.cancelled_in) == ["bidi", "sleep"]
    await still_serving(env)


# ---- 6. unknown methods ------------------------------------------------------------------------
async def test_unknown_method_is_unimplemented(env: Env) -> None:
    for p in (path("NoSuchMethod"), "/no.Such/Service", "/grpc.health.v1.Health/Check"):
        err = await rpc_error(env.channel.unary_unary(p)(b"", timeout=10))
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED, p
    err = await rpc_error(env.channel.stream_stream("/no.Such/Stream")().read())
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    await still_serving(env)


# ---- 7. metadata and context ---------------------------------------------------------------------
async def test_metadata_both_ways_and_time_remaining(env: Env) -> None:
    blob = bytes(range(256))
    call = env.unary("Info")(b"", metadata=(("x-plain", "hello world"), ("x-blob-bin", blob),
                                            ("x-empty-bin", b""), ("x-multi", "a"), ("x-multi", "b")))
    assert await call == b"info"
    md = env.probe.metadata[-1]
    assert ("x-plain", "hello world") in md
    assert ("x-blob-bin", blob) in md
    assert ("x-empty-bin", b"") in md
    assert [v for k, v in md if k == "x-multi"] == ["a", "b"]
    assert not any(k.startswith(":") or k in ("grpc-timeout", "content-type", "te") for k, _ in md)
    assert env.probe.time_remaining[-1] is None
    assert env.probe.peers[-1].startswith("ipv4:127.0.0.1:")
    trailing = await call.trailing_metadata()
    assert trailing.get_all("x-trailer") == ["t1"]
    assert trailing.get_all("x-trailer-bin") == [b"\x00\x01\xfe\xff"]
    assert await call.code() == grpc.StatusCode.OK

    assert await env.unary("Info")(b"", timeout=5) == b"info"
    remaining = env.probe.time_remaining[-1]
    assert remaining is not None and 3.0 < remaining <= 5.5  # grpc rounds the timeout header up


async def test_large_request_metadata(env: Env) -> None:
    value = "v" * 30000
    assert await env.unary("Info")(b"", metadata=(("x-large", value),), timeout=10) == b"info"
    assert ("x-large", value) in env.probe.metadata[-1]


async def test_initial_metadata(env: Env) -> None:
    call = env.unary("Initial")(b"", timeout=10)
    initial = await call.initial_metadata()
    assert initial.get_all("x-initial") == ["i1"]
    assert initial.get_all("x-initial-bin") == [b"\x00\xff"]
    assert await call == b"with initial metadata"


async def test_done_callback_and_cancelled(env: Env) -> None:
    assert await env.unary("DoneCallback")(b"", timeout=10) == b"done"
    assert env.probe.done_cancelled == [False]  # a call that succeeded was not cancelled
    call = env.unary("DoneCallback")(b"5")
    await waited(env.probe.started)
    call.cancel()
    await waited(env.probe.cancelled)
    await eventually_async(lambda: len(env.probe.done_cancelled) == 2, 1.0, "both done callbacks")
    assert env.probe.done_cancelled == [False, True]


# ---- 8. errors ------------------------------------------------------------------------------------
async def test_set_code_and_details(env: Env) -> None:
    call = env.unary("SetCode")(b"", timeout=10)
    err = await rpc_error(call)
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no such thing")
    err = await rpc_error(env.unary("SetCodeNone")(b"", timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "bad argument")


async def test_abort(env: Env) -> None:
    err = await rpc_error(env.unary("Abort")(b"", timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.PERMISSION_DENIED, "go away")
    assert ("x-why", "because") in tuple(err.trailing_metadata())


async def test_handler_exception_is_unknown_and_the_server_keeps_serving(env: Env) -> None:
    for _ in range(3):
        err = await rpc_error(env.unary("Raise")(b"", timeout=10))
        assert err.code() == grpc.StatusCode.UNKNOWN
        assert "ValueError" in (err.details() or "") and "boom" not in (err.details() or "")  # text: log only
    await still_serving(env)


@pytest.mark.parametrize("details", [
    "plain ascii",
    "100% sure, %41 is not A, %zz, trailing %",
    "ünïcødé ✓ 日本語 — emoji 🚀",
    "tab\there, newline\nthere, cr\rend",
])
async def test_error_details_arrive_intact(env: Env, details: str) -> None:
    err = await rpc_error(env.unary("Details")(details.encode(), timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == details


async def test_an_error_without_details_still_says_what_it_is(env: Env) -> None:
    """A client shows only the details (tritonclient's InferenceServerException prints nothing
    else): a status set without any still arrives with its name."""
    err = await rpc_error(env.unary("Details")(b"", timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "FAILED_PRECONDITION (the server gave no details)"


async def test_errors_after_streamed_messages(env: Env) -> None:
    call = env.unary_stream("PartialAbort")(b"", timeout=10)
    got = [await call.read() for _ in range(3)]
    assert got == [b"0", b"1", b"2"]
    err = await rpc_error(call.read())
    assert (err.code(), err.details()) == (grpc.StatusCode.DATA_LOSS, "partial")

    call = env.unary_stream("PartialRaise")(b"", timeout=10)
    assert [await call.read(), await call.read()] == [b"0", b"1"]
    err = await rpc_error(call.read())
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert "RuntimeError" in (err.details() or "") and "stream broke" not in (err.details() or "")


# ---- 9. streaming ---------------------------------------------------------------------------------
async def test_server_streaming_1000_messages(env: Env) -> None:
    call = env.unary_stream("Count")(b"1000", timeout=30)
    assert [m async for m in call] == [b"%d" % i for i in range(1000)]
    assert await call.code() == grpc.StatusCode.OK
    call = env.unary_stream("Write")(b"300", timeout=30)  # ctx.write() instead of yield
    assert [m async for m in call] == [b"w%d" % i for i in range(300)]
    call = env.unary_stream("Count")(b"0", timeout=30)  # no messages at all
    assert [m async for m in call] == []
    assert await call.code() == grpc.StatusCode.OK


async def test_client_streaming(env: Env) -> None:
    parts = [b"", b"a", os.urandom(100_000), b"b" * 16379, b"c" * 16380, b"tail"] + [b"%d" % i for i in range(200)]

    async def gen() -> AsyncIterator[bytes]:
        for i, m in enumerate(parts):
            yield m
            if i % 50 == 0:
                await asyncio.sleep(0)

    answer = await env.stream_unary("Concat")(gen(), timeout=30)
    assert answer == struct.pack(">I", len(parts)) + b"".join(parts)
    assert env.probe.received == parts

    async def none() -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover

    assert await env.stream_unary("Concat")(none(), timeout=10) == struct.pack(">I", 0)


async def test_client_streaming_handler_returns_early(env: Env) -> None:
    async def slow() -> AsyncIterator[bytes]:
        for i in range(50):
            yield b"m%d" % i
            await loop_passes(5)  # the handler returns while these still come

    assert await env.stream_unary("First")(slow(), timeout=10) == b"first:m0"
    await still_serving(env)


async def test_bidirectional_interleaved_500_messages(env: Env) -> None:
    call = env.stream_stream("Bidi")(timeout=30)
    for i in range(500):
        msg = b"ping %d " % i * (i % 7 + 1)
        await call.write(msg)
        assert await call.read() == msg  # the answer comes before the next request is sent
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("method", ["Forever", "Firehose"])
async def test_abandoned_server_stream_is_closed(env: Env, method: str) -> None:
    call = env.unary_stream(method)(b"")
    for _ in range(3):
        assert await call.read() != grpc.aio.EOF
    if method == "Firehose":  # it fills the window the client does not open, and waits at it
        await eventually_async(lambda: any(c.blocked for c in env.server._conns), 10, "the firehose stopped")
    call.cancel()
    await waited(env.probe.closed, 2.0)
    if method == "Forever":
        await waited(env.probe.cancelled, 2.0)
    await still_serving(env)


async def test_abandoned_bidi_stream_is_cancelled(env: Env) -> None:
    call = env.stream_stream("Bidi")()
    await call.write(b"one")
    assert await call.read() == b"one"
    call.cancel()
    await waited(env.probe.cancelled, 2.0)
    await waited(env.probe.closed, 2.0)
    await still_serving(env)


# ---- 10. max_receive_message_length -------------------------------------------------------------
async def test_max_receive_message_length() -> None:
    async with serving(max_receive_message_length=1000) as e:
        assert await e.unary("Echo")(b"a" * 1000, timeout=10) == b"a" * 1000
        for size in (1001, 2000, 100_000):  # one frame, and split over many frames
            err = await rpc_error(e.unary("Echo")(b"a" * size, timeout=10))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, size
            assert "1000" in (err.details() or "") and str(size) in (err.details() or "")

        async def parts() -> AsyncIterator[bytes]:
            yield b"small"
            yield b"b" * 2000

        err = await rpc_error(e.stream_unary("Concat")(parts(), timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1000" in (err.details() or "")
        assert await e.unary("Echo")(b"fine", timeout=10) == b"fine"


async def test_max_receive_message_length_applies_to_the_decompressed_message() -> None:
    # grpc checks the limit on the decompressed size: 100 kB of zeros gzip to ~130 bytes, and a
    # server that only checks the wire size hands a decompression bomb to its handler.
    async with serving(max_receive_message_length=1000) as e:
        err = await rpc_error(e.unary("Echo")(bytes(100_000), compression=grpc.Compression.Gzip, timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1000" in (err.details() or "")


# ---- 11. graceful stop -----------------------------------------------------------------------------
async def test_graceful_stop_finishes_calls_in_flight() -> None:
    async with serving() as e:
        call = asyncio.ensure_future(e.unary("Sleep")(b"0.5", timeout=10))
        await waited(e.probe.started)
        t0 = time.monotonic()
        stopping = asyncio.ensure_future(e.server.stop(grace=5))
        await asyncio.sleep(0)  # stop() runs up to its wait for the calls in flight: no longer accepting
        async with grpc.aio.insecure_channel(e.target) as ch:  # no new connections while draining
            err = await rpc_error(ch.unary_unary(path("Echo"))(b"x", timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert await call == b"slept"
        await asyncio.wait_for(stopping, 5)
        assert time.monotonic() - t0 < 4.0  # stop() returns once idle, not after the whole grace
        assert not e.probe.cancelled.is_set()
        async with grpc.aio.insecure_channel(e.target) as ch:
            err = await rpc_error(ch.unary_unary(path("Echo"))(b"x", timeout=5))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        err = await rpc_error(e.unary("Echo")(b"x", timeout=5))  # the old channel too
        assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_stop_cancels_calls_that_outlive_the_grace() -> None:
    async with serving() as e:
        call = asyncio.ensure_future(e.unary("Sleep")(b"10", timeout=30))
        await waited(e.probe.started)
        t0 = time.monotonic()
        await asyncio.wait_for(e.server.stop(grace=0.3), 5)
        assert time.monotonic() - t0 < 3.0
        await waited(e.probe.cancelled, 2.0)
        err = await rpc_error(asyncio.wait_for(call, 5))
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)


# ---- 12. garbage and raw HTTP/2 ----------------------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0, 1, 3, 6, 9


def frame(typ: int, flags: int, sid: int, payload: bytes = b"", length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack(">I", n)[1:] + bytes((typ, flags)) + struct.pack(">I", sid) + payload


def settings(**values: int) -> bytes:
    codes = {"header_table_size": 1, "initial_window_size": 4, "max_frame_size": 5}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", codes[k], v) for k, v in values.items()))


def request_headers(enc: hpack.Encoder, name: str, content_type: str = "application/grpc",
                    extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    return enc.encode([(":method", "POST"), (":scheme", "http"), (":path", path(name)),
                       (":authority", "localhost"), ("content-type", content_type), ("te", "trailers"),
                       *extra])


Frame = tuple[int, int, int, bytes]


class RawConn:
    """Hand-built frames over a plain socket, for what a well-behaved client never sends."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = bytearray()
        self.frames: list[Frame] = []
        self.eof = False

    @classmethod
    async def open(cls, port: int) -> RawConn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read_until(self, done: Callable[[list[Frame]], bool], timeout: float = 5.0) -> list[Frame]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done(self.frames) and not self.eof:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), remaining)
            except TimeoutError:
                break
            except ConnectionError:  # a reset counts as closed
                data = b""
            if not data:
                self.eof = True
                break
            self.buf += data
            while len(self.buf) >= 9:
                n = int.from_bytes(self.buf[:3], "big")
                if len(self.buf) < 9 + n:
                    break
                typ, flags = self.buf[3], self.buf[4]
                sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
                self.frames.append((typ, flags, sid, bytes(self.buf[9:9 + n])))
                del self.buf[:9 + n]
        return self.frames

    async def read_to_eof(self, timeout: float = 5.0) -> list[Frame]:
        return await self.read_until(lambda _: False, timeout)

    def close(self) -> None:
        self.writer.close()


def goaway_code(frames: list[Frame]) -> int | None:
    for typ, _, _, payload in frames:
        if typ == GOAWAY:
            return int(struct.unpack_from(">I", payload, 4)[0])
    return None


def responses(frames: list[Frame]) -> tuple[dict[int, list[dict[bytes, bytes]]], dict[int, bytes]]:
    """Per stream: the header blocks (HEADERS + CONTINUATIONs joined, HPACK-decoded in wire
    order as a peer must) and the DATA bytes."""
    dec = hpack.Decoder()
    blocks: dict[int, list[dict[bytes, bytes]]] = collections.defaultdict(list)
    data: dict[int, bytes] = collections.defaultdict(bytes)
    pending = b""
    for t, f, s, p in frames:
        if t in (HEADERS, CONTINUATION):
            pending += p
            if f & END_HEADERS:
                blocks[s].append(dict(dec.decode(pending, raw=True)))
                pending = b""
        elif t == DATA:
            data[s] += p
    return blocks, data


def stream_ended(sid: int) -> Callable[[list[Frame]], bool]:
    return lambda frames: any(s == sid and f & END_STREAM and t in (HEADERS, DATA) for t, f, s, _ in frames)


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: curl\r\n\r\n",
    b"GET /\r\n",
    b"PRI * HTTP/1.1\r\n\r\nSM\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(200),  # a TLS ClientHello start
    bytes([0x7F]) + random.Random(1234).randbytes(4096),
], ids=["http1", "short", "bad-preface", "tls", "random"])
async def test_garbage_connection_is_closed(env: Env, garbage: bytes) -> None:
    raw = await RawConn.open(env.port)
    raw.send(garbage)
    await raw.read_to_eof(5.0)
    assert raw.eof, "the server kept a garbage connection open"
    raw.close()
    await still_serving(env)


@pytest.mark.parametrize(("frames", "code"), [
    (frame(DATA, 0, 0, b"data"), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 2, b"\x82"), PROTOCOL_ERROR),  # client streams are odd
    (frame(SETTINGS, 0, 0, b"\x00\x04\x00"), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 0, struct.pack(">HI", 5, 100)), PROTOCOL_ERROR),  # MAX_FRAME_SIZE below 16384
    (frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 31)), FLOW_CONTROL_ERROR),
    (frame(SETTINGS, 0, 1, b""), PROTOCOL_ERROR),
    (frame(PING, 0, 0, b"1234567"), FRAME_SIZE_ERROR),
    (frame(WINDOW_UPDATE, 0, 0, b"\x00\x01"), FRAME_SIZE_ERROR),
    (frame(WINDOW_UPDATE, 0, 9, b"\x00\x00\x00\x00\x01"), FRAME_SIZE_ERROR),  # (a stream we do not know)
    (frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), PROTOCOL_ERROR),  # a zero increment for the connection
    (frame(DATA, 0, 1, length=2 * MiB), FRAME_SIZE_ERROR),  # over our MAX_FRAME_SIZE of 1 MiB
    (frame(CONTINUATION, END_HEADERS, 1, b"\x82"), PROTOCOL_ERROR),
    (frame(HEADERS, 0, 1, b"\x83") + frame(DATA, 0, 1, b"x"), PROTOCOL_ERROR),  # CONTINUATION expected
    (frame(HEADERS, 0, 1, b"\x83") + frame(CONTINUATION, END_HEADERS, 3, b"\x82"), PROTOCOL_ERROR),
    (frame(HEADERS, END_HEADERS, 1, b"\xbf\xff\xff\xff\xff\xff"), COMPRESSION_ERROR),
    (frame(HEADERS, END_HEADERS | PADDED, 1, b"\x09\x82"), PROTOCOL_ERROR),  # padding beyond the frame
    (frame(PUSH_PROMISE, END_HEADERS, 1, b"\x00\x00\x00\x02\x82"), PROTOCOL_ERROR),
], ids=["data-on-0", "even-stream", "settings-length", "small-max-frame", "huge-window", "settings-on-stream",
        "ping-length", "window-update-length", "unknown-stream-window-update-length", "zero-window-update",
        "oversized-frame", "stray-continuation",
        "interrupted-headers", "continuation-other-stream", "hpack-garbage", "headers-padding",
        "push-promise"])
async def test_protocol_violations_get_goaway_and_close(env: Env, frames: bytes, code: int) -> None:
    raw = await RawConn.open(env.port)
    raw.send(PREFACE + settings() + frames)
    got = await raw.read_to_eof(5.0)
    assert raw.eof, "connection left open after a connection error"
    assert goaway_code(got) == code
    raw.close()
    await still_serving(env)


async def test_data_padding_beyond_the_frame_is_a_connection_error(env: Env) -> None:
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Echo"))
             + frame(DATA, PADDED | END_STREAM, 1, b"\x20" + grpc_message(b"hi")))  # pad 32 > frame
    got = await raw.read_to_eof(5.0)
    assert raw.eof and goaway_code(got) == PROTOCOL_ERROR


async def test_raw_unary_with_hand_built_frames(env: Env) -> None:
    """CONTINUATION, padding, PRIORITY flag, a message in 1-byte DATA frames, trailers-only
    errors: what grpcio never sends but HTTP/2 allows."""
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    raw.send(PREFACE + settings())
    block = request_headers(enc, "Echo", extra=(("x-note", "n" * 300),))
    pieces = [block[i:i + 7] for i in range(0, len(block), 7)]
    # stream 1: HEADERS (padded, with priority) + CONTINUATIONs; message in 1-byte DATA frames
    raw.send(frame(HEADERS, PADDED | 0x20, 1, bytes((3,)) + b"\x00\x00\x00\x00\x10" + pieces[0] + b"pad")
             + b"".join(frame(CONTINUATION, 0, 1, p) for p in pieces[1:-1])
             + frame(CONTINUATION, END_HEADERS, 1, pieces[-1]))
    for b in grpc_message(b"one byte at a time"):
        raw.send(frame(DATA, 0, 1, bytes((b,))))
    raw.send(frame(DATA, END_STREAM, 1))
    # stream 3: padded DATA frames, the message split across them, and a PRIORITY frame between
    msg = grpc_message(b"padded " * 100)
    raw.send(frame(HEADERS, END_HEADERS, 3, request_headers(enc, "Echo"))
             + frame(DATA, PADDED, 3, b"\xff" + msg[:10] + bytes(255))
             + frame(PRIORITY, 0, 3, b"\x00\x00\x00\x01\x20")
             + frame(DATA, PADDED | END_STREAM, 3, b"\x00" + msg[10:]))
    # stream 5: an unknown method, answered trailers-only; stream 7: an unknown frame type first
    raw.send(frame(HEADERS, END_HEADERS, 5, enc.encode([(":method", "POST"), (":scheme", "http"),
                                                       (":path", "/x.Y/Z"), (":authority", "localhost"),
                                                       ("content-type", "application/grpc+proto")]))
             + frame(DATA, END_STREAM, 5, grpc_message(b"")))
    raw.send(frame(0xEE, 0x55, 7, b"ignore me") + frame(HEADERS, END_HEADERS, 7, request_headers(enc, "Echo"))
             + frame(DATA, END_STREAM, 7, grpc_message(b"seven")))
    got = await raw.read_until(lambda fs: all(stream_ended(s)(fs) for s in (1, 3, 5, 7)), 10.0)
    assert not raw.eof

    blocks, data = responses(got)
    for sid, expected in ((1, b"one byte at a time"), (3, b"padded " * 100), (7, b"seven")):
        assert blocks[sid][0][b":status"] == b"200" and blocks[sid][0][b"content-type"] == b"application/grpc"
        assert blocks[sid][-1][b"grpc-status"] == b"0"
        assert grpc_messages(data[sid]) == [expected]
    assert len(blocks[5]) == 1 and data[5] == b""  # trailers-only
    assert blocks[5][0][b":status"] == b"200" and blocks[5][0][b"grpc-status"] == b"12"
    raw.close()


async def test_raw_no_rst_stream_on_a_stream_closed_both_ways(env: Env) -> None:
    """A request whose HEADERS carry END_STREAM and that is answered at once (HTTP 415, or
    trailers-only UNIMPLEMENTED) leaves the stream closed on both sides: nothing more may be
    sent on it (RFC 9113 5.1), RST_STREAM included."""
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    raw.send(PREFACE + settings()
             + frame(HEADERS, END_HEADERS | END_STREAM, 1, request_headers(enc, "Echo", content_type="text/plain"))
             + frame(HEADERS, END_HEADERS | END_STREAM, 3, request_headers(enc, "NoSuchMethod"))
             + frame(HEADERS, END_HEADERS, 5, request_headers(enc, "Echo"))
             + frame(DATA, END_STREAM, 5, grpc_message(b"last")))
    got = await raw.read_until(lambda fs: all(stream_ended(s)(fs) for s in (1, 3, 5)), 5.0)
    await raw.read_until(lambda fs: False, 0.3)
    assert [(t, s) for t, _, s, _ in got if t == RST_STREAM] == []
    raw.close()


async def test_raw_initial_window_size_setting_is_honoured(env: Env) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0: headers, no DATA; raising it releases exactly the window;
    WINDOW_UPDATEs release the rest, in frames no larger than the client's MAX_FRAME_SIZE."""
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    raw.send(PREFACE + settings(initial_window_size=0)
             + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Fill"))
             + frame(DATA, END_STREAM, 1, grpc_message(b"100000")))
    await raw.read_until(lambda fs: any(t == HEADERS and s == 1 for t, _, s, _ in fs), 5.0)
    await raw.read_until(lambda fs: False, 0.3)
    assert not any(t == DATA for t, _, _, _ in raw.frames), "DATA sent into a zero window"

    def data_bytes() -> int:
        return sum(len(p) for t, _, s, p in raw.frames if t == DATA and s == 1)

    mark = len(raw.frames)
    raw.send(settings(initial_window_size=30000))
    await raw.read_until(lambda fs: data_bytes() >= 30000, 5.0)
    await raw.read_until(lambda fs: False, 0.3)
    assert data_bytes() == 30000
    # The SETTINGS ACK must go out before DATA that relies on the larger window: grpc core (and
    # h2) only count a new INITIAL_WINDOW_SIZE once acknowledged, and grpc fails the stream with
    # "frame of size N overflows local window" otherwise.
    later = [(t, f) for t, f, _, _ in raw.frames[mark:]]
    assert (SETTINGS, ACK) in later, "no SETTINGS ACK"
    assert later.index((SETTINGS, ACK)) < next(i for i, (t, _) in enumerate(later) if t == DATA), \
        "DATA sent on the new window before the SETTINGS ACK"
    raw.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 100000)))  # the connection window (65535) limits
    await raw.read_until(lambda fs: data_bytes() >= 65535, 5.0)
    await raw.read_until(lambda fs: False, 0.3)
    assert data_bytes() == 65535
    raw.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 100000)))
    await raw.read_until(stream_ended(1), 5.0)
    assert data_bytes() == 100005
    assert max(len(p) for t, _, _, p in raw.frames if t == DATA) <= 16384
    raw.close()


async def test_raw_server_enforces_grpc_timeout(env: Env) -> None:
    """The client never cancels: the server's own deadline answers and cancels the handler."""
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    t0 = time.monotonic()
    raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(
        enc, "Sleep", extra=(("grpc-timeout", "200m"),))) + frame(DATA, END_STREAM, 1, grpc_message(b"5")))
    got = await raw.read_until(stream_ended(1), 5.0)
    assert time.monotonic() - t0 < 2.0
    blocks, data = responses(got)
    assert len(blocks[1]) == 1 and not data[1]  # trailers-only
    assert blocks[1][0][b"grpc-status"] == b"4"
    await waited(env.probe.cancelled, 2.0)
    raw.close()


@pytest.mark.parametrize(("encoding", "compress"), [
    ("gzip", gzip.compress), ("deflate", zlib.compress),
])
async def test_raw_compressed_request(env: Env, encoding: str, compress: Callable[[bytes], bytes]) -> None:
    raw = await RawConn.open(env.port)
    enc = hpack.Encoder()
    payload = b"squeeze me " * 1000
    raw.send(PREFACE + settings()
             + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Echo", extra=(("grpc-encoding", encoding),)))
             + frame(DATA, END_STREAM, 1, grpc_message(compress(payload), compressed=True))
             # the same, streaming request path
             + frame(HEADERS, END_HEADERS, 3, request_headers(enc, "Concat", extra=(("grpc-encoding", encoding),)))
             + frame(DATA, 0, 3, grpc_message(compress(b"ab"), compressed=True) + grpc_message(b"cd"))
             + frame(DATA, END_STREAM, 3, grpc_message(compress(payload), compressed=True))
             # bad: corrupt data, a compressed flag without grpc-encoding, an unknown encoding
             + frame(HEADERS, END_HEADERS, 5, request_headers(enc, "Echo", extra=(("grpc-encoding", encoding),)))
             + frame(DATA, END_STREAM, 5, grpc_message(b"not compressed at all", compressed=True))
             + frame(HEADERS, END_HEADERS, 7, request_headers(enc, "Echo"))
             + frame(DATA, END_STREAM, 7, grpc_message(compress(payload), compressed=True))
             + frame(HEADERS, END_HEADERS, 9, request_headers(enc, "Echo", extra=(("grpc-encoding", "snappy"),)))
             + frame(DATA, END_STREAM, 9, grpc_message(payload)))
    got = await raw.read_until(lambda fs: all(stream_ended(s)(fs) for s in (1, 3, 5, 7, 9)), 10.0)
    blocks, data = responses(got)
    status = {sid: b[-1][b"grpc-status"] for sid, b in blocks.items()}
    assert status == {1: b"0", 3: b"0", 5: b"3", 7: b"3", 9: b"12"}
    assert grpc_messages(data[1]) == [payload]
    assert grpc_messages(data[3]) == [struct.pack(">I", 3) + b"abcd" + payload]
    raw.close()


# ---- raw HTTP/2 with the h2 package (a strict client: it raises on any server mistake) --------------
@dataclass
class StreamLog:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    frame_sizes: list[int] = field(default_factory=list)
    ended: bool = False
    reset: int | None = None

    def status(self) -> bytes | None:
        return self.trailers.get(b"grpc-status", self.headers.get(b"grpc-status"))


class H2Client:
    """h2's H2Connection on an asyncio stream; it validates every frame and header the server
    sends (flow-control windows, frame sizes, header rules) and raises on a violation."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Any) -> None:
        self.reader, self.writer, self.conn = reader, writer, conn
        self.streams: dict[int, StreamLog] = collections.defaultdict(StreamLog)
        self.pings: list[bytes] = []
        self.terminated: Any = None

    @classmethod
    async def connect(cls, port: int, **local: int) -> H2Client:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        if local:
            codes = h2.settings.SettingCodes
            values = {codes.MAX_CONCURRENT_STREAMS: 100, codes.MAX_HEADER_LIST_SIZE: 1 << 20}
            values.update({getattr(codes, k.upper()): v for k, v in local.items()})
            conn.local_settings = h2.settings.Settings(client=True, initial_values=values)
            conn.max_inbound_frame_size = conn.local_settings.max_frame_size
        conn.initiate_connection()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer, conn)
        client.flush()
        return client

    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.writer.write(out)

    def request(self, name: str, message: bytes | None, *, content_type: str = "application/grpc",
                method: str = "POST", extra: tuple[tuple[str, str], ...] = (), end_stream: bool = True,
                pad_length: int | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":scheme", "http"), (":path", path(name)), (":authority", "localhost"),
                   ("content-type", content_type), ("te", "trailers"), *extra]
        self.conn.send_headers(sid, headers, end_stream=message is None and end_stream)
        if message is not None:
            self.conn.send_data(sid, grpc_message(message), end_stream=end_stream, pad_length=pad_length)
        self.flush()
        return sid

    def handle(self, events: list[Any]) -> None:
        ev_ = h2.events
        for ev in events:
            if isinstance(ev, ev_.ResponseReceived):
                self.streams[ev.stream_id].headers = dict(ev.headers)
            elif isinstance(ev, ev_.TrailersReceived):
                self.streams[ev.stream_id].trailers = dict(ev.headers)
            elif isinstance(ev, ev_.DataReceived):
                s = self.streams[ev.stream_id]
                s.data += ev.data
                s.frame_sizes.append(len(ev.data))  # one event per DATA frame
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, ev_.StreamEnded):
                self.streams[ev.stream_id].ended = True
            elif isinstance(ev, ev_.StreamReset):
                self.streams[ev.stream_id].reset = ev.error_code
            elif isinstance(ev, ev_.PingAckReceived):
                self.pings.append(ev.ping_data)
            elif isinstance(ev, ev_.ConnectionTerminated):
                self.terminated = ev

    async def until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done():
            remaining = deadline - loop.time()
            assert remaining > 0, "timed out waiting for the server"
            try:
                data = await asyncio.wait_for(self.reader.read(1 << 16), remaining)
            except TimeoutError:
                raise AssertionError("timed out waiting for the server") from None
            assert data, "the server closed the connection"
            self.handle(self.conn.receive_data(data))
            self.flush()

    def close(self) -> None:
        self.writer.close()


@needs_h2
async def test_h2_ping_gets_an_ack(env: Env) -> None:
    c = await H2Client.connect(env.port)
    c.conn.ping(b"12345678")
    c.flush()
    await c.until(lambda: len(c.pings) == 1, 5)
    assert c.pings == [b"12345678"]
    c.close()


@needs_h2
async def test_h2_unary_and_headers_split_into_continuations(env: Env) -> None:
    c = await H2Client.connect(env.port)
    await c.until(lambda: c.conn.remote_settings.max_frame_size == 1 << 20, 5)
    real = c.conn.max_outbound_frame_size
    c.conn.max_outbound_frame_size = 20  # h2 splits the header block: HEADERS + CONTINUATION x N
    sid = c.request("Echo", None, end_stream=False, extra=(("x-long", "l" * 500),))
    c.conn.max_outbound_frame_size = real
    c.conn.send_data(sid, grpc_message(b"continued"), end_stream=True)
    c.flush()
    plain = c.request("Echo", b"plain")
    await c.until(lambda: c.streams[sid].ended and c.streams[plain].ended, 5)
    for s, body in ((sid, b"continued"), (plain, b"plain")):
        log = c.streams[s]
        assert log.headers[b":status"] == b"200"
        assert log.status() == b"0"
        assert grpc_messages(bytes(log.data)) == [body]
    c.close()


@needs_h2
async def test_h2_padded_data(env: Env) -> None:
    c = await H2Client.connect(env.port)
    sids = [c.request("Echo", b"padded %d" % pad, pad_length=pad) for pad in (0, 1, 100, 255)]
    await c.until(lambda: all(c.streams[s].ended for s in sids), 5)
    for s, pad in zip(sids, (0, 1, 100, 255), strict=True):
        assert c.streams[s].status() == b"0"
        assert grpc_messages(bytes(c.streams[s].data)) == [b"padded %d" % pad]
    c.close()


@needs_h2
@pytest.mark.parametrize(("method", "content_type", "status"), [
    ("POST", "text/plain", b"415"),
    ("POST", "application/json", b"415"),
    ("GET", "application/grpc", b"405"),
])
async def test_h2_non_grpc_requests_get_http_errors(env: Env, method: str, content_type: str,
                                                    status: bytes) -> None:
    c = await H2Client.connect(env.port)
    sid = c.request("Echo", None, method=method, content_type=content_type)
    body = c.request("Echo", b"with a body", content_type=content_type) if method == "POST" else None
    await c.until(lambda: c.streams[sid].ended and (body is None or c.streams[body].ended), 5)
    assert c.streams[sid].headers[b":status"] == status
    if body is not None:
        assert c.streams[body].headers[b":status"] == status
    ok = c.request("Echo", b"still fine")
    await c.until(lambda: c.streams[ok].ended, 5)
    assert c.streams[ok].status() == b"0" and c.terminated is None
    c.close()


@needs_h2
async def test_h2_rst_stream_cancels_the_handler(env: Env) -> None:
    c = await H2Client.connect(env.port)
    sid = c.request("Sleep", b"5")
    await waited(env.probe.started)
    c.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    c.flush()
    await waited(env.probe.cancelled, 2.0)
    ok = c.request("Echo", b"next stream")  # the connection lives on
    await c.until(lambda: c.streams[ok].ended, 5)
    assert grpc_messages(bytes(c.streams[ok].data)) == [b"next stream"]
    assert not c.streams[sid].ended  # nothing more was sent on the reset stream
    c.close()


@needs_h2
async def test_h2_rst_stream_cancels_a_bidi_handler(env: Env) -> None:
    c = await H2Client.connect(env.port)
    sid = c.request("Bidi", b"hello", end_stream=False)
    await c.until(lambda: len(c.streams[sid].data) >= 10, 5)
    c.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    c.flush()
    await waited(env.probe.cancelled, 2.0)
    await waited(env.probe.closed, 2.0)
    c.close()


@needs_h2
async def test_h2_flow_control_small_windows(env: Env) -> None:
    """A 1 kB stream window and a 20000-byte MAX_FRAME_SIZE: h2 raises if the server sends past a
    window or a frame past the limit; the server must honour frames up to the client's size."""
    c = await H2Client.connect(env.port, initial_window_size=1024, max_frame_size=20000)
    sid = c.request("Fill", b"300000")
    await c.until(lambda: c.streams[sid].ended, 20)
    log = c.streams[sid]
    assert log.status() == b"0"
    assert grpc_messages(bytes(log.data)) == [(b"0123456789abcdef" * 18750)[:300000]]
    assert max(log.frame_sizes) <= 1024
    big = c.request("Fill", b"300000")
    c.conn.increment_flow_control_window(1 << 20, stream_id=big)
    c.conn.increment_flow_control_window(1 << 20)
    c.flush()
    await c.until(lambda: c.streams[big].ended, 20)
    assert max(c.streams[big].frame_sizes) <= 20000
    assert max(c.streams[big].frame_sizes) > 16384, "the client's larger MAX_FRAME_SIZE went unused"
    c.close()


@needs_h2
async def test_h2_large_trailing_metadata_respects_max_frame_size(env: Env) -> None:
    """Header blocks larger than the peer's MAX_FRAME_SIZE (16384) must go out as HEADERS +
    CONTINUATION (RFC 9113 4.2, 6.10); h2 fails the connection on an oversized frame."""
    c = await H2Client.connect(env.port)
    sid = c.request("BigTrailer", b"40000")
    await c.until(lambda: c.streams[sid].ended, 5)
    assert c.streams[sid].status() == b"0"
    assert c.streams[sid].trailers[b"x-big"] == b"v" * 40000
    c.close()


@needs_h2
async def test_h2_byte_at_a_time(env: Env) -> None:
    """Every byte of the connection (preface included) in its own TCP write."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sids = []
    for i in range(3):
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path("Echo")),
                                (":authority", "localhost"), ("content-type", "application/grpc"),
                                ("te", "trailers")])
        conn.send_data(sid, grpc_message(b"slowly %d" % i), end_stream=True)
        sids.append(sid)
    wire = conn.data_to_send()
    reader, writer = await asyncio.open_connection("127.0.0.1", env.port)
    writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for b in wire:
        writer.write(bytes((b,)))
        await writer.drain()
        await asyncio.sleep(0)
    c = H2Client(reader, writer, conn)
    await c.until(lambda: all(c.streams[s].ended for s in sids), 10)
    for i, s in enumerate(sids):
        assert grpc_messages(bytes(c.streams[s].data)) == [b"slowly %d" % i]
    c.close()


async def test_raw_goaway_on_stop_refuses_new_streams_and_finishes_old_ones() -> None:
    async with serving() as e:
        raw = await RawConn.open(e.port)
        enc = hpack.Encoder()
        raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Sleep"))
                 + frame(DATA, END_STREAM, 1, grpc_message(b"0.5")))
        await waited(e.probe.started)
        stopping = asyncio.ensure_future(e.server.stop(grace=5))
        got = await raw.read_until(lambda fs: goaway_code(fs) is not None, 5.0)
        goaway = next(p for t, _, _, p in got if t == GOAWAY)
        assert struct.unpack_from(">II", goaway) == (1, NO_ERROR)  # last stream 1, graceful
        raw.send(frame(HEADERS, END_HEADERS, 3, request_headers(enc, "Echo"))
                 + frame(DATA, END_STREAM, 3, grpc_message(b"too late")))
        got = await raw.read_to_eof(5.0)  # stream 1 completes, then the server closes
        assert raw.eof
        assert (RST_STREAM, 0, 3, struct.pack(">I", 7)) in got  # REFUSED_STREAM: safe to retry
        blocks, data = responses(got)
        assert blocks[1][-1][b"grpc-status"] == b"0"
        assert grpc_messages(data[1]) == [b"slept"]
        await asyncio.wait_for(stopping, 5)
        raw.close()


# ---- 13. grpc.health.v1 ------------------------------------------------------------------------------
async def test_health_check_and_watch() -> None:
    state = HealthState()
    state.set("svc", NOT_SERVING)
    server = H2GrpcServer()
    server.add_methods(access.HEALTH_SERVICE, methods(HealthServicer(state), access.HEALTH_METHODS))
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    req, resp = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=req.SerializeToString,
                                   response_deserializer=resp.FromString)
            watch = ch.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=req.SerializeToString,
                                    response_deserializer=resp.FromString)
            assert (await check(req(service=""), timeout=10)).status == NOT_SERVING
            state.set("", SERVING)
            assert (await check(req(service=""), timeout=10)).status == SERVING
            err = await rpc_error(check(req(service="nope"), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND and "nope" in (err.details() or "")

            call = watch(req(service="svc"), timeout=30)
            assert (await call.read()).status == NOT_SERVING
            state.set("svc", SERVING)
            assert (await asyncio.wait_for(call.read(), 5)).status == SERVING
            state.set("svc", NOT_SERVING)
            assert (await asyncio.wait_for(call.read(), 5)).status == NOT_SERVING
            call.cancel()
            assert (await check(req(service="svc"), timeout=10)).status == NOT_SERVING
    finally:
        await server.stop(None)


# ---- the sync client against a server on its own loop: stdlib asyncio and uvloop ---------------------
@contextlib.contextmanager
def threaded_server(loop_factory: Callable[[], asyncio.AbstractEventLoop],
                    cancelled: threading.Event) -> Iterator[int]:
    ready = threading.Event()
    state: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            probe = Probe()
            hs = handlers(probe)
            inner = hs["Sleep"].fn

            async def sleep(req: bytes, ctx: Any) -> bytes:
                try:
                    return await inner(req, ctx)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise

            hs["Sleep"] = unary_unary(sleep)
            server = H2GrpcServer()
            server.add_methods(SERVICE, hs)
            state["port"] = await server.bind("127.0.0.1", 0)
            await server.start()
            state["stop"] = stop = asyncio.Event()
            state["loop"] = asyncio.get_running_loop()
            ready.set()
            await stop.wait()
            await server.stop(None)

        try:
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                runner.run(main())
        finally:
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10) and "port" in state, "the server thread did not start"
    try:
        yield state["port"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)


def _loop_factories() -> list[Any]:
    out: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
        out.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    except ImportError:  # pragma: no cover
        out.append(pytest.param(None, id="uvloop", marks=pytest.mark.skip(reason="uvloop not installed")))
    return out


@pytest.mark.parametrize("loop_factory", _loop_factories())
def test_sync_client_against_a_server_on_its_own_loop(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
    cancelled = threading.Event()
    with threaded_server(loop_factory, cancelled) as port, \
            grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        echo = ch.unary_unary(path("Echo"))
        assert echo(b"hi", timeout=10) == b"hi"
        big = os.urandom(8 * MiB)
        assert ch.unary_unary(path("Reverse"))(big, timeout=60) == big[::-1]
        assert list(ch.unary_stream(path("Count"))(b"1000", timeout=30)) == [b"%d" % i for i in range(1000)]
        msgs = [b"m%d" % i * 100 for i in range(200)]
        assert list(ch.stream_stream(path("Bidi"))(iter(msgs), timeout=30)) == msgs
        assert ch.stream_unary(path("Concat"))(iter(msgs), compression=grpc.Compression.Gzip,
                                               timeout=30) == struct.pack(">I", 200) + b"".join(msgs)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary(path("Sleep"))(b"5", timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        assert time.monotonic() - t0 < 2.0
        assert cancelled.wait(2.0)
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary(path("Raise"))(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
        assert echo(b"after", timeout=10) == b"after"


@needs_h2
async def test_h2_a_flood_of_empty_request_messages_waits_unparsed(env: Env) -> None:
    """Empty messages cost 5 bytes each on the wire but an object each once parsed: past
    STREAM_MAX_QUEUED unread ones the rest stay raw bytes (bounded by the window) and the window
    is not given back; as the handler reads on they are queued, and the stream ends after the
    last of them; nothing is lost."""
    from meshserve.server.h2 import STREAM_MAX_QUEUED

    flood = STREAM_MAX_QUEUED * 3
    c = await H2Client.connect(env.port)
    try:
        await c.until(lambda: c.conn.remote_settings.initial_window_size > 65535, 5)
        sid = c.request("Hold", b"first", end_stream=False)
        await waited(env.probe.started)
        c.conn.send_data(sid, grpc_message(b"") * flood, end_stream=True)
        c.flush()
        (conn,) = env.server._conns
        await c.until(lambda: sid in conn.streams and conn.streams[sid].remote_ended, 5)
        st = conn.streams[sid]
        assert st.parked and st.queue.qsize() <= STREAM_MAX_QUEUED  # the rest waits as bytes
        assert len(st.buf) >= 5 * (flood - STREAM_MAX_QUEUED - 1)
        env.probe.release.set()
        await c.until(lambda: c.streams[sid].ended, 10)
        assert c.streams[sid].trailers[b"grpc-status"] == b"0"
        assert grpc_messages(c.streams[sid].data) == [b"%d" % (flood + 1)]
    finally:
        c.close()


@needs_h2
async def test_h2_request_stream_window_comes_back_only_as_the_handler_reads(env: Env) -> None:
    """A request-streaming call's window is given back as its handler takes messages, not as
    they arrive: a client that outruns its handler is stopped by flow control once the window
    is spent, and goes on when the handler reads again; nothing is lost."""
    async def pump(c: H2Client, seconds: float) -> None:  # read what the server sends meanwhile
        with contextlib.suppress(AssertionError):
            await c.until(lambda: False, seconds)

    c = await H2Client.connect(env.port)
    try:
        await c.until(lambda: c.conn.remote_settings.initial_window_size > 65535, 5)
        sid = c.request("Hold", b"first", end_stream=False)
        await waited(env.probe.started)
        chunk = grpc_message(b"x" * (256 * 1024))
        sent = 1
        while c.conn.local_flow_control_window(sid) >= len(chunk) and sent < 200:  # 16 MiB is 64
            c.conn.send_data(sid, chunk)
            c.flush()
            sent += 1
            await pump(c, 0.001)
        await pump(c, 0.5)  # time for a WINDOW_UPDATE that must not come
        spent = c.conn.local_flow_control_window(sid)
        assert spent < len(chunk) and sent > 32  # window + backlog (~24 MiB) taken; the handler read one
        env.probe.release.set()
        await c.until(lambda: c.conn.local_flow_control_window(sid) > spent)
        assert c.conn.local_flow_control_window(sid) >= len(chunk)  # room again: one more goes
        c.conn.send_data(sid, chunk)
        sent += 1
        c.conn.end_stream(sid)
        c.flush()
        await c.until(lambda: c.streams[sid].ended)
        assert c.streams[sid].trailers[b"grpc-status"] == b"0"
        assert grpc_messages(c.streams[sid].data) == [b"%d" % sent]
    finally:
        c.close()
