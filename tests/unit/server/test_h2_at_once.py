"""The h2 server's at-once hook (meshserve/server/h2/server.py: H2GrpcServer.at_once, called in
ServerConnection._start_unary): a unary call it answers ends there, without a Task (the gateway's
cache hits); its error status, its exception, a compressed request, an answer larger than the
peer's window and a call it declines (the method's handler, in a Task) — through the real grpcio
client over loopback."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from load.bench.h2_calls import _Transport
from meshserve import native
from meshserve.server import connections
from meshserve.server.h2 import Call, H2GrpcServer, Status, unary_unary
from meshserve.server.h2 import server as h2server
from meshserve.server.h2.frames import PREFACE, literal, plain_decode
from meshserve.server.h2.server import ServerConnection
from tests.support.waiting import eventually_async

# compiled (MESHSERVE_NATIVE=1 with the build: docs/perf/native.md), the connection calls its own
# methods directly: a test that replaces one on the instance sees nothing
COMPILED = native.running(h2server) == "compiled"

SERVICE = "t.AtOnce"
PATH = f"/{SERVICE}/Ask"
PLAIN = f"/{SERVICE}/Plain"  # a hook that wants no call: OK answers without trailing metadata
LARGE = 3 << 20  # more than the client's flow-control windows at the start


class Seen:
    def __init__(self) -> None:
        self.hook_tasks: list[Any] = []
        self.handled: list[bytes] = []


def _server(seen: Seen) -> H2GrpcServer:
    async def handler(request: bytes, call: Call) -> bytes:
        seen.handled.append(request)
        assert asyncio.current_task() is not None
        return b"task:" + request

    def hook(message: bytes, call: Call) -> bytes | None:
        seen.hook_tasks.append(asyncio.current_task())
        if message.startswith(b"now"):
            call.set_trailing_metadata((("x-hit", "1"),))
            return b"at-once:" + message
        if message == b"large":
            return b"L" * LARGE
        if message == b"deny":
            call.set_status(Status.PERMISSION_DENIED, "not this one")
            return b""
        if message == b"boom":
            raise ValueError("/secret/path exploded")
        return None  # the handler, in a Task

    def plain(message: bytes, call: Call | None) -> bytes | None:
        assert call is None
        seen.hook_tasks.append(asyncio.current_task())
        if message == b"boom":
            raise ValueError("/secret/path exploded")
        return b"plain:" + message if message else None

    server = H2GrpcServer()
    server.add_methods(SERVICE, {"Ask": unary_unary(handler), "Plain": unary_unary(handler)})
    server.at_once[PATH] = (hook, True)
    server.at_once[PLAIN] = (plain, False)
    return server


@pytest.fixture
async def served() -> Any:
    seen = Seen()
    server = _server(seen)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        yield server, seen, port
    finally:
        await server.stop(0)


async def test_a_call_the_hook_answers_ends_without_a_task(served: Any) -> None:
    server, seen, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        ask = ch.unary_unary(PATH)
        call = ask(b"now-1", timeout=10)
        assert await call == b"at-once:now-1"
        assert ("x-hit", "1") in tuple(await call.trailing_metadata())
        assert seen.hook_tasks == [None]  # (run in the read's frame loop: no Task)
        assert await ask(b"other", timeout=10) == b"task:other"  # declined: the method's handler
        assert seen.handled == [b"other"]
        # many calls on one connection, answered and declined mixed: each ends exactly once
        answers = await asyncio.gather(*(ask(b"now-%d" % i if i % 2 else b"t%d" % i, timeout=10)
                                         for i in range(64)))
        assert answers == [b"at-once:now-%d" % i if i % 2 else b"task:t%d" % i for i in range(64)]
        plain = ch.unary_unary(PLAIN)
        call = plain(b"p", timeout=10)
        assert await call == b"plain:p" and not tuple(await call.trailing_metadata() or ())
        assert await plain(b"", timeout=10) == b"task:"  # declined: the handler
        assert seen.hook_tasks.count(None) == len(seen.hook_tasks)
    assert server._active == 0


async def test_the_hooks_status_exception_compression_and_a_large_answer(served: Any) -> None:
    _, seen, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        ask = ch.unary_unary(PATH)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ask(b"deny", timeout=10)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "not this one")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ask(b"boom", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNKNOWN
        assert "secret" not in (info.value.details() or "")  # an exception's text stays in the log
        # a gzip request: the hook sees the message decompressed
        assert await ask(b"now-gzip" * 100, timeout=10, compression=grpc.Compression.Gzip) == \
            b"at-once:" + b"now-gzip" * 100
        # larger than the windows: HEADERS and DATA as the peer's WINDOW_UPDATEs allow, then trailers
        large = await ask(b"large", timeout=30)
        assert len(large) == LARGE and large == b"L" * LARGE
    assert seen.handled == []


# ---- a call answered from its two frames (ServerConnection._at_once), the frame loop fed in process ----

class _Wire(_Transport):
    """A transport that keeps what the server writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def writelines(self, data: Any) -> None:
        for piece in data:
            self.out += piece

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        """(type, flags, stream, payload) of everything written since the last call."""
        data, self.out = bytes(self.out), bytearray()
        out, pos = [], 0
        while pos < len(data):
            length = int.from_bytes(data[pos:pos + 3], "big")
            out.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                        data[pos + 9:pos + 9 + length]))
            pos += 9 + length
        return out


def _frame(typ: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((typ, flags)) + sid.to_bytes(4, "big") + payload


_BLOCK = (b"".join(literal(k, v) for k, v in ((b":method", b"POST"), (b":scheme", b"http"), (b":path", PLAIN.encode()),
                                            (b":authority", b"t"), (b"content-type", b"application/grpc"),
                                            (b"te", b"trailers"), (b"grpc-timeout", b"10S"))))


def _call(sid: int, message: bytes, block: bytes = _BLOCK) -> bytes:
    """A unary call as a client writes it: HEADERS (END_HEADERS), then its message in one DATA frame."""
    return (_frame(1, 0x4, sid, block)
            + _frame(0, 0x1, sid, b"\x00" + len(message).to_bytes(4, "big") + message))


def _answers(frames: list[tuple[int, int, int, bytes]]) -> dict[int, tuple[bytes, dict[bytes, bytes]]]:
    """stream -> (its message, its trailers) from a server's frames; a trailers-only answer has no message."""
    out: dict[int, tuple[bytes, dict[bytes, bytes]]] = {}
    for typ, flags, sid, payload in frames:
        message, trailers = out.get(sid, (b"", {}))
        if typ == 0:
            message += payload[5:] if payload[:1] == b"\x00" and not message else payload
        elif typ == 1 and flags & 0x1:
            trailers = dict(plain_decode(payload) or [])
        out[sid] = (message, trailers)
    return out


async def _connection(seen: Seen, window: int = 1 << 24) -> tuple[Any, _Wire, ServerConnection]:
    server = _server(seen)
    conn = ServerConnection(server)
    wire = _Wire()
    conn.connection_made(wire)  # type: ignore[arg-type]
    settings = (4).to_bytes(2, "big") + window.to_bytes(4, "big")  # the client's INITIAL_WINDOW_SIZE
    conn.data_received(PREFACE + _frame(4, 0, 0, settings) + _frame(8, 0, 0, (1 << 24).to_bytes(4, "big")))
    conn.data_received(_call(1, b"first"))  # (its block decoded now: the next calls' blocks are known)
    assert _answers(wire.frames())[1] == (b"plain:first", {b"grpc-status": b"0"})
    return server, wire, conn


@pytest.mark.skipif(COMPILED, reason="watches which method of the connection runs (pure-Python internals); "
                                     "on the build: test_frames_that_arrive_together_open_no_stream_compiled_or_not")
async def test_a_call_whose_frames_arrive_together_is_answered_without_a_stream() -> None:
    seen = Seen()
    server, wire, conn = await _connection(seen)
    opened: list[int] = []
    usual = conn._on_headers
    conn._on_headers = lambda flags, sid, block: (opened.append(sid), usual(flags, sid, block))[1]  # type: ignore[method-assign]
    window = conn.send_window
    conn.data_received(b"".join(_call(sid, b"m%d" % sid) for sid in (3, 5, 7)))
    answers = _answers(wire.frames())
    assert answers == {sid: (b"plain:m%d" % sid, {b"grpc-status": b"0"}) for sid in (3, 5, 7)}
    assert opened == [] and conn.streams == {} and server._active == 0 and conn.last_sid == 7
    assert conn.send_window == window - sum(len(b"plain:m3") + 5 for _ in range(3))
    assert len(seen.hook_tasks) == 4 and seen.handled == []  # (the hook once per call, no handler)
    # a stream id not above the last one, or frames of two calls interleaved: the usual path
    conn.data_received(_call(7, b"again"))
    assert _answers(wire.frames()) == {} and not conn.dead  # (a finished stream's late frames: dropped)
    conn.data_received(_frame(1, 0x4, 9, _BLOCK) + _frame(1, 0x4, 11, _BLOCK)
                       + _call(9, b"a")[9 + len(_BLOCK):] + _call(11, b"b")[9 + len(_BLOCK):])
    assert _answers(wire.frames()) == {9: (b"plain:a", {b"grpc-status": b"0"}), 11: (b"plain:b", {b"grpc-status": b"0"})}
    assert opened == [7, 9, 11] and conn.streams == {}


async def test_frames_that_arrive_together_open_no_stream_compiled_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above through what both builds show: the connection tells the connection table
    it is busy again (ConnectionTable.idle_now) at its first call, from the usual path with that
    call's stream open (``conn.streams``, until the call ends), from the at-once path (once per
    connection) with no stream at all."""
    seen = Seen()
    server, wire, conn = await _connection(seen)
    busy: list[list[int]] = []  # the connection's streams each time it turned busy
    idle_now = connections.ConnectionTable.idle_now

    def watching(table: connections.ConnectionTable, c: Any) -> None:
        if c is conn:
            busy.append(sorted(conn.streams))
        idle_now(table, c)

    monkeypatch.setattr(connections.ConnectionTable, "idle_now", watching)
    window = conn.send_window
    conn.data_received(b"".join(_call(sid, b"m%d" % sid) for sid in (3, 5, 7)))
    answers = _answers(wire.frames())
    assert answers == {sid: (b"plain:m%d" % sid, {b"grpc-status": b"0"}) for sid in (3, 5, 7)}
    assert busy == [[]] and conn.streams == {} and server._active == 0 and conn.last_sid == 7
    assert conn.send_window == window - sum(len(b"plain:m3") + 5 for _ in range(3))
    assert len(seen.hook_tasks) == 4 and seen.handled == []  # (the hook once per call, no handler)
    conn.data_received(_call(7, b"again"))  # a stream id not above the last one: dropped
    assert _answers(wire.frames()) == {} and not conn.dead and busy == [[]]
    # frames of two calls interleaved: each HEADERS opens its stream, the usual way
    conn.data_received(_frame(1, 0x4, 9, _BLOCK))
    assert busy == [[], [9]] and list(conn.streams) == [9]
    conn.data_received(_frame(1, 0x4, 11, _BLOCK))
    assert sorted(conn.streams) == [9, 11]
    conn.data_received(_call(9, b"a")[9 + len(_BLOCK):] + _call(11, b"b")[9 + len(_BLOCK):])
    assert _answers(wire.frames()) == {9: (b"plain:a", {b"grpc-status": b"0"}), 11: (b"plain:b", {b"grpc-status": b"0"})}
    assert conn.streams == {} and busy == [[], [9]]


async def test_a_declined_raising_or_large_answer_opens_the_stream_as_usual() -> None:
    seen = Seen()
    server, wire, conn = await _connection(seen, window=64)
    # declined (the hook says None): the method's handler, in its Task
    conn.data_received(_call(3, b""))
    await eventually_async(lambda: seen.handled == [b""] and server._active == 0)
    assert _answers(wire.frames())[3] == (b"task:", {b"grpc-status": b"0"})
    # a hook that raises: UNKNOWN, its text only in the log
    conn.data_received(_call(5, b"boom"))
    status = _answers(wire.frames())[5][1]
    assert status[b"grpc-status"] == b"2" and b"secret" not in status.get(b"grpc-message", b"")
    # an answer larger than the client's stream window (64 bytes): sent as the window allows
    conn.data_received(_call(7, b"x" * 100))
    first = _answers(wire.frames())[7]
    assert len(first[0]) < 106 and not first[1] and 7 in conn.streams
    conn.data_received(_frame(8, 0, 7, (1 << 16).to_bytes(4, "big")))  # WINDOW_UPDATE: the rest
    rest = [f for f in wire.frames() if f[2] == 7]
    assert b"".join(p for t, _, _, p in rest if t == 0) and rest[-1][0] == 1 and rest[-1][1] & 0x1
    assert conn.streams == {} and server._active == 0


async def test_refused_at_its_headers_before_the_hook() -> None:
    seen = Seen()
    server, wire, conn = await _connection(seen)
    asked = len(seen.hook_tasks)
    server.check_headers = lambda path, metadata: (Status.UNAUTHENTICATED, "no key")
    conn.data_received(_call(3, b"m"))
    message, trailers = _answers(wire.frames())[3]  # (trailers-only: one HEADERS frame)
    assert message == b"" and (trailers[b"grpc-status"], trailers[b"grpc-message"]) == (b"16", b"no key")
    assert len(seen.hook_tasks) == asked and conn.streams == {}


async def test_a_declined_call_is_opened_from_its_checks_once_as_the_usual_path_opens_it() -> None:
    """A call the hook declines is opened from what ``_at_once`` decoded (``_open``): its path,
    metadata and deadline as the usual path sets them, counted in progress, the header check run
    once for it, and its handler sees the same call as one that took the usual path."""
    seen = Seen()
    server, wire, conn = await _connection(seen)
    checked: list[tuple[str, Any]] = []
    server.check_headers = lambda path, metadata: checked.append((path, metadata))  # type: ignore[assignment,func-returns-value]
    block = _BLOCK + literal(b"x-tenant", b"t1")
    conn.data_received(_call(3, b"", block))  # (the usual path: this block is decoded here)
    await eventually_async(lambda: seen.handled == [b""] and server._active == 0)
    assert _answers(wire.frames())[3] == (b"task:", {b"grpc-status": b"0"})
    usual = conn._on_headers
    opened: list[int] = []
    conn._on_headers = lambda flags, sid, block: (opened.append(sid), usual(flags, sid, block))[1]  # type: ignore[method-assign]
    asked = len(seen.hook_tasks)
    conn.data_received(_call(5, b"", block))  # the same block, now known: at once, declined
    assert opened == [] and len(seen.hook_tasks) == asked + 1  # (the hook once, no second pass over the headers)
    st = conn.streams[5]
    assert (st.path, st.metadata, st.remote_ended, st.handler) == (PLAIN, (("x-tenant", "t1"),), True,
                                                                   server._methods[PLAIN])
    assert st.deadline is not None and st.due is not None and st.task is not None and server._active == 1
    assert checked == [(PLAIN, (("x-tenant", "t1"),))] * 2 and conn.last_sid == 5
    await eventually_async(lambda: seen.handled == [b"", b""] and server._active == 0)
    assert _answers(wire.frames())[5] == (b"task:", {b"grpc-status": b"0"}) and conn.streams == {}


_NO_HOOK_BLOCK = (b"".join(literal(k, v) for k, v in (
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", f"/{SERVICE}/Bare".encode()), (b":authority", b"t"),
    (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"grpc-timeout", b"10S"))))


@pytest.mark.skipif(COMPILED, reason="watches which method of the connection runs (pure-Python internals)")
@pytest.mark.parametrize("named", [True, False])
async def test_a_path_without_a_hook_is_opened_from_its_two_frames_unless_a_tenant_is_to_be_counted(named: bool) -> None:
    """A unary call to a path without a hook (the gateway's ModelInfer without the cache), its two
    frames in one read, is opened as a declined hook's (``_open``: no second pass over its headers,
    its Task at once) with what the usual path would give it; on a connection that still has a
    tenant to count (``named`` False: ``_claim`` at its headers) it takes the usual path."""
    seen = Seen()
    server, wire, conn = await _connection(seen)
    server.add_methods(SERVICE, {"Bare": server._methods[PLAIN]})
    conn.data_received(_call(3, b"one", _NO_HOOK_BLOCK))  # (its block decoded the usual way)
    await eventually_async(lambda: seen.handled == [b"one"] and server._active == 0)
    assert _answers(wire.frames())[3] == (b"task:one", {b"grpc-status": b"0"})
    conn.named = named
    opened: list[int] = []
    usual = conn._on_headers
    conn._on_headers = lambda flags, sid, block: (opened.append(sid), usual(flags, sid, block))[1]  # type: ignore[method-assign]
    claimed: list[int] = []
    conn._claim = lambda st, holds: claimed.append(st.sid) or False  # type: ignore[method-assign,func-returns-value]
    asked = len(seen.hook_tasks)
    call = _call(5, b"two", _NO_HOOK_BLOCK)
    head = 9 + len(_NO_HOOK_BLOCK)  # (grpc's C++ client writes the stream's WINDOW_UPDATE between the two)
    conn.data_received(call[:head] + _frame(8, 0, 5, (1280).to_bytes(4, "big")) + call[head:])
    st = conn.streams[5]
    assert (st.path, st.remote_ended, st.handler, server._active) == (f"/{SERVICE}/Bare", True,
                                                                     server._methods[PLAIN], 1)
    assert st.deadline is not None and st.due is not None and st.task is not None
    assert st.send_window == conn.peer_initial_window + 1280
    assert (opened, claimed) == (([], []) if named else ([5], [5])) and len(seen.hook_tasks) == asked
    await eventually_async(lambda: seen.handled == [b"one", b"two"] and server._active == 0)
    assert _answers(wire.frames())[5] == (b"task:two", {b"grpc-status": b"0"}) and conn.streams == {}


@pytest.mark.skipif(COMPILED, reason="watches which method of the connection runs (pure-Python internals)")
async def test_a_stream_window_update_between_the_two_frames_is_taken_with_them() -> None:
    """The hook answers a call whose HEADERS and DATA have the stream's WINDOW_UPDATE between
    them (grpc's C++ client), without a stream; a WINDOW_UPDATE of another stream, or of another
    length, leaves the frames to the usual path (test_h2grpc.py: a bad length is a connection error)."""
    seen = Seen()
    server, wire, conn = await _connection(seen)
    opened: list[int] = []
    usual = conn._on_headers
    conn._on_headers = lambda flags, sid, block: (opened.append(sid), usual(flags, sid, block))[1]  # type: ignore[method-assign]
    head = 9 + len(_BLOCK)

    def between(sid: int, message: bytes, update: bytes) -> bytes:
        call = _call(sid, message)
        return call[:head] + update + call[head:]

    conn.data_received(between(3, b"m3", _frame(8, 0, 3, (5).to_bytes(4, "big"))))
    assert _answers(wire.frames()) == {3: (b"plain:m3", {b"grpc-status": b"0"})}
    assert opened == [] and conn.streams == {} and conn.last_sid == 3
    conn.data_received(between(5, b"m5", _frame(8, 0, 1, (5).to_bytes(4, "big"))))  # (another stream's)
    assert _answers(wire.frames()) == {5: (b"plain:m5", {b"grpc-status": b"0"})} and opened == [5]
    bad = between(7, b"m7", _frame(8, 0, 7, (5).to_bytes(5, "big")))  # (5 bytes: the usual path refuses it)
    assert conn._at_once(7, bad, 9, head) == 0 and conn.last_sid == 5


# ---- a client's reads yield the loop past READ_BURST (H2Endpoint._yield_reads) -------------------------

class _Pausing(_Wire):
    """A transport that records the server's pause_reading / resume_reading calls."""

    def __init__(self) -> None:
        super().__init__()
        self.reading: list[str] = []

    def pause_reading(self) -> None:
        self.reading.append("pause")

    def resume_reading(self) -> None:
        self.reading.append("resume")


async def test_a_client_s_reads_past_the_read_burst_pause_reading_until_the_next_loop_pass() -> None:
    """A client sending at loopback speed is read at most READ_BURST bytes (and the read that
    passes it) per loop pass: past them reading pauses once and resumes on the next pass (the
    data in hand is still read: its call is answered), so other connections' callbacks come
    between (libuv would read one readable socket up to 32 times, 256 KiB each, in one pass)."""
    from meshserve.server.limits import READ_BURST
    seen = Seen()
    server = _server(seen)
    conn = ServerConnection(server)
    wire = _Pausing()
    conn.connection_made(wire)  # type: ignore[arg-type]
    settings = (4).to_bytes(2, "big") + (1 << 24).to_bytes(4, "big")
    conn.data_received(PREFACE + _frame(4, 0, 0, settings) + _frame(8, 0, 0, (1 << 24).to_bytes(4, "big")))
    conn.data_received(_call(1, b"small"))
    assert wire.reading == []  # (a few hundred bytes: nothing to yield)
    message = b"m" * (READ_BURST // 2)
    conn.data_received(_call(3, message))
    assert wire.reading == []  # (half the burst)
    conn.data_received(_call(5, message))  # passes READ_BURST in this pass
    assert wire.reading == ["pause"]
    await asyncio.sleep(0)  # the loop's next pass
    assert wire.reading == ["pause", "resume"]
    conn.data_received(_call(7, b"after"))  # the count starts again: no pause
    assert wire.reading == ["pause", "resume"]
    got: set[int] = set()

    def answered() -> bool:
        got.update(_answers(wire.frames()))
        return {1, 3, 5, 7} <= got

    await eventually_async(answered, 5, "every call answered")
