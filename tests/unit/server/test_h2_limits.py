"""The HTTP/2 front door's limits (ServerLimits, docs/grpc.md "Limits"): each one is driven over
a real loopback connection by a client that misbehaves in exactly that way (hand-built frames,
or the `h2` package as a strict client), with small limit values so every test is quick and
every loop bounded. Each test checks what the client sees (RST_STREAM, GOAWAY and its code, a
closed connection, a gRPC status) and what the server holds afterwards, then that it still
serves."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import grpc
import hpack
import pytest

from meshserve.server import access, connections
from meshserve.server.grpc_frontend import methods
from meshserve.server.h2 import ErrorCode
from meshserve.server.h2.connection import FRAMES_PER_PASS
from meshserve.server.h2.frames import MAX_HEADER_LIST, SETTINGS_MAX_HEADER_LIST_SIZE
from meshserve.server.h2.requests import MESSAGES_PER_PASS
from meshserve.server.h2.server import KEEPALIVE_PING, ServerConnection
from meshserve.server.health import HealthServicer, HealthState
from meshserve.server.limits import ServerLimits
from tests.support import eventually_async as until
from tests.unit.server.h2_support import MiB
from tests.unit.server.test_h2grpc import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Env,
    Frame,
    H2Client,
    RawConn,
    frame,
    goaway_code,
    grpc_message,
    needs_h2,
    path,
    request_headers,
    responses,
    rpc_error,
    serving,
    settings,
    still_serving,
    stream_ended,
    waited,
)

ENHANCE_YOUR_CALM = int(ErrorCode.ENHANCE_YOUR_CALM)
REFUSED_STREAM = int(ErrorCode.REFUSED_STREAM)
FLOW_CONTROL_ERROR = int(ErrorCode.FLOW_CONTROL_ERROR)
NO_TIMEOUTS = {"header_timeout_s": 0.0, "read_timeout_s": 0.0, "idle_timeout_s": 0.0,
               "keepalive_interval_s": 0.0}


def limits(**changes: Any) -> ServerLimits:
    return ServerLimits(**{**NO_TIMEOUTS, **changes})


def server_settings(frames: list[Frame]) -> dict[int, int]:
    for typ, flags, _sid, payload in frames:
        if typ == SETTINGS and not flags & 1:
            return {k: v for k, v in (struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6))}
    raise AssertionError("no SETTINGS from the server")


def resets(frames: list[Frame]) -> dict[int, int]:
    return {sid: int.from_bytes(p, "big") for typ, _, sid, p in frames if typ == RST_STREAM}


def the_connection(env: Env) -> ServerConnection:
    (conn,) = env.server._conns
    return conn


def watch(monkeypatch: pytest.MonkeyPatch) -> list[ServerConnection]:
    """Every connection the server opens, remembered (one may come and go between two polls):
    each is told to the connection table (meshserve/server/connections.py:ConnectionTable.opened) as it opens, in
    pure Python and compiled alike (a compiled server adds to its own set with the C call)."""
    seen: list[ServerConnection] = []
    opened = connections.ConnectionTable.opened

    def watching(table: connections.ConnectionTable, conn: Any) -> bool:
        seen.append(conn)
        return opened(table, conn)

    monkeypatch.setattr(connections.ConnectionTable, "opened", watching)
    return seen


# ---- SETTINGS_MAX_CONCURRENT_STREAMS ---------------------------------------------------------
async def test_max_concurrent_streams_is_advertised_and_excess_streams_are_refused() -> None:
    async with serving(limits=limits(max_concurrent_streams=4)) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        out = PREFACE + settings()
        for sid in (1, 3, 5, 7, 9, 11):  # 4 Sleep calls in progress, then two more
            out += frame(HEADERS, END_HEADERS, sid, request_headers(enc, "Sleep"))
            out += frame(DATA, END_STREAM, sid, grpc_message(b"5"))
        raw.send(out)
        got = await raw.read_until(lambda fs: len(resets(fs)) >= 2)
        assert server_settings(got)[0x3] == 4
        assert resets(got) == {9: REFUSED_STREAM, 11: REFUSED_STREAM}
        assert len(the_connection(env).streams) == 4
        raw.send(frame(PING, 0, 0, b"stillopn"))  # the connection itself goes on
        got = await raw.read_until(lambda fs: any(t == PING and f & 1 for t, f, _, _ in fs))
        assert not raw.eof
        raw.close()
        await still_serving(env)


async def test_our_client_keeps_within_max_concurrent_streams_while_calls_keep_arriving() -> None:
    """meshserve's h2 client waits for a free stream under the server's limit. A call woken for
    a freed stream resumes a loop step or two later; calls arriving in between took that stream
    and the woken one went over the limit: REFUSED_STREAM, which the load generator's flood saw
    as UNAVAILABLE (about 1 run in 4 of tests/adversarial/test_overload.py)."""
    from meshserve.server.h2.client import GrpcError, connect

    async with serving(limits=limits(max_concurrent_streams=4)) as env:
        conn = await connect(f"127.0.0.1:{env.port}", timeout=5)
        await until(lambda: conn.peer_max_streams == 4)
        codes: list[int] = []

        async def call() -> None:
            try:
                await conn.unary(path("Sleep"), b"0.002", timeout=20)
            except GrpcError as exc:
                codes.append(exc.code)

        try:
            calls = []
            for i in range(300):  # bounded: calls keep arriving while earlier ones wait for streams
                calls.append(asyncio.ensure_future(call()))
                if i % 3 == 0:
                    await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(*calls), 30)
        finally:
            conn.close()
        assert codes == []


async def test_a_flood_of_headers_only_streams_is_refused_then_the_connection_closed() -> None:
    """50k HEADERS-only streams stalled the gateway: now at most max_concurrent_streams are
    open, the rest are refused, and refusals spend the rapid-reset budget: GOAWAY."""
    async with serving(limits=limits(max_concurrent_streams=8, stream_reset_burst=200)) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        headers = request_headers(enc, "Echo")  # indexed after the first: the same bytes each time
        raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, headers))
        headers = request_headers(enc, "Echo")
        flood = b"".join(frame(HEADERS, END_HEADERS, sid, headers) for sid in range(3, 2 * 5000, 2))
        raw.send(flood)
        got = await raw.read_to_eof(10.0)
        assert raw.eof and goaway_code(got) == ENHANCE_YOUR_CALM
        # the refusals of the last batch may be dropped: the GOAWAY replaces what was queued
        assert set(resets(got).values()) <= {REFUSED_STREAM}
        await until(lambda: not env.server._conns)
        assert env.server._active == 0  # the 8 admitted streams' handlers are gone too
        await still_serving(env)


# ---- rapid reset (CVE-2023-44487) ------------------------------------------------------------
def reset_storm(enc: hpack.Encoder, streams: int) -> bytes:
    """The preface, then `streams` x (HEADERS + RST_STREAM(CANCEL))."""
    out = PREFACE + settings()
    for sid in range(1, 2 * streams, 2):
        out += frame(HEADERS, END_HEADERS, sid, request_headers(enc, "Sleep"))
        out += frame(RST_STREAM, 0, sid, struct.pack(">I", 8))
    return out


async def test_rapid_reset_gets_goaway_enhance_your_calm_and_close() -> None:
    async with serving(limits=limits(stream_reset_burst=100, stream_reset_rate=10.0)) as env:
        raw = await RawConn.open(env.port)
        raw.send(reset_storm(hpack.Encoder(), 1000))
        got = await raw.read_to_eof(10.0)
        assert raw.eof, "the connection was left open"
        assert goaway_code(got) == ENHANCE_YOUR_CALM
        await until(lambda: not env.server._conns and env.server._active == 0)
        await still_serving(env)


async def test_resets_within_the_budget_are_fine() -> None:
    async with serving(limits=limits(stream_reset_burst=100, stream_reset_rate=10.0)) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        out = reset_storm(enc, 90)
        out += frame(HEADERS, END_HEADERS, 181, request_headers(enc, "Echo"))
        out += frame(DATA, END_STREAM, 181, grpc_message(b"after the resets"))
        raw.send(out)
        got = await raw.read_until(stream_ended(181))
        assert goaway_code(got) is None and not raw.eof
        blocks, data = responses(got)
        assert blocks[181][-1][b"grpc-status"] == b"0" and data[181] == grpc_message(b"after the resets")
        raw.close()


# ---- maximum receive message size ------------------------------------------------------------
async def test_an_oversized_message_is_refused_from_its_length_prefix_before_it_is_buffered() -> None:
    """A 400 MB partial message used to be buffered: now its 5-byte prefix is enough for
    RESOURCE_EXHAUSTED, the stream is reset, and what follows is dropped, not held."""
    async with serving(limits=limits(max_request_bytes=1 * MiB)) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Echo"))
                 + frame(DATA, 0, 1, struct.pack(">BI", 0, 400 * 10**6) + b"x" * 16000))
        got = await raw.read_until(stream_ended(1))
        blocks, _ = responses(got)
        assert blocks[1][-1][b"grpc-status"] == b"8"
        assert b"400000000 vs. 1048576" in blocks[1][-1][b"grpc-message"]
        assert resets(got).get(1) == 0  # RST_STREAM(NO_ERROR): stop sending
        conn = the_connection(env)
        assert 1 not in conn.streams and conn.held == 0
        raw.send(frame(DATA, 0, 1, b"y" * 60000) * 10)  # the rest of it, sent anyway: dropped
        raw.send(frame(PING, 0, 0, b"afterwrd"))
        await raw.read_until(lambda fs: any(t == PING and f & 1 for t, f, _, _ in fs))
        assert conn.held == 0 and not raw.eof
        raw.close()


async def test_max_request_bytes_through_grpcio() -> None:
    async with serving(limits=limits(max_request_bytes=1 * MiB)) as env:
        assert await env.unary("Echo")(b"x" * (1 * MiB), timeout=10) == b"x" * (1 * MiB)
        err = await rpc_error(env.unary("Echo")(b"x" * (1 * MiB + 1), timeout=10))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1048577 vs. 1048576" in (err.details() or "")


async def test_large_messages_still_arrive_with_a_small_receive_budget() -> None:
    """A receive budget smaller than a message is raised to fit one largest message."""
    async with serving(limits=limits(max_request_bytes=32 * MiB, conn_receive_buffer_bytes=1 * MiB)) as env:
        payload = bytes(range(256)) * (20 * MiB // 256)
        assert await env.unary("Echo")(payload, timeout=30) == payload
        got = [m async for m in env.stream_stream("Bidi")(iter([b"a" * MiB, b"b" * (5 * MiB), b"c"]), timeout=30)]
        assert got == [b"a" * MiB, b"b" * (5 * MiB), b"c"]
        assert the_connection(env).held == 0


# ---- the receive budget (connection window) ---------------------------------------------------
@needs_h2
async def test_the_connection_window_comes_back_only_as_handlers_take_messages() -> None:
    """Partly sent messages on several streams fill the connection's receive budget: the
    window is not given back for them; the newest is failed (RESOURCE_EXHAUSTED) so that the
    others can complete, and everything held is released at the end."""
    async with serving(limits=limits(max_request_bytes=1 * MiB, conn_receive_buffer_bytes=1)) as env:
        budget = env.server.conn_window
        assert budget < 4 * MiB  # raised from 1 byte to one largest message and some slack
        c = await H2Client.connect(env.port)
        try:
            await c.until(lambda: c.conn.outbound_flow_control_window >= budget, 5)
            part = 900 * 1024
            sids = []
            for _ in range(4):
                sid = c.request("Echo", None, end_stream=False)
                sids.append(sid)
                body = struct.pack(">BI", 0, MiB) + b"p" * (part - 5)
                n = min(len(body), c.conn.local_flow_control_window(sid))
                c.conn.send_data(sid, body[:n])
                c.flush()
            conn = the_connection(env)
            await c.until(lambda: c.streams[sids[-1]].ended or c.streams[sids[-1]].reset is not None, 5)
            assert c.streams[sids[-1]].status() == b"8"
            assert b"connection receive buffer full" in c.streams[sids[-1]].trailers.get(
                b"grpc-message", c.streams[sids[-1]].headers.get(b"grpc-message", b""))
            assert conn.held <= budget
            for sid in sids[:-1]:  # the others finish their messages
                rest = b"p" * (MiB + 5 - part)
                c.conn.send_data(sid, rest, end_stream=True)
                c.flush()
            await c.until(lambda: all(c.streams[s].ended for s in sids[:-1]), 10)
            assert [c.streams[s].status() for s in sids[:-1]] == [b"0"] * 3
            assert conn.held == 0
        finally:
            c.close()


async def test_data_beyond_the_connection_window_is_a_flow_control_error() -> None:
    async with serving(limits=limits(max_request_bytes=1 * MiB, conn_receive_buffer_bytes=1)) as env:
        budget = env.server.conn_window
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Hold")))
        chunk = frame(DATA, 0, 1, grpc_message(b"m" * (256 * 1024 - 5)))  # whole messages, never read
        for _ in range(budget // (256 * 1024) + 8):  # more than the window: a client ignoring it
            raw.send(chunk)
        got = await raw.read_to_eof(10.0)
        assert raw.eof and goaway_code(got) == FLOW_CONTROL_ERROR
        await until(lambda: not env.server._conns)


# ---- the send budget and write backpressure ----------------------------------------------------
async def unread_connection(port: int) -> asyncio.StreamWriter:
    """A connection whose reader never reads (and a small receive buffer, so the server's
    output backs up quickly)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    _, writer = await asyncio.open_connection(sock=sock)
    return writer


@needs_h2
async def test_a_zero_window_reader_is_closed_after_the_send_budget_and_its_memory_freed() -> None:
    async with serving(limits=limits(conn_send_buffer_bytes=2 * MiB)) as env:
        c = await H2Client.connect(env.port, initial_window_size=0)
        try:
            await c.until(lambda: env.server._conns and the_connection(env).peer_initial_window == 0, 5)
            conn = the_connection(env)
            sids = [c.request("Fill", b"%d" % (256 * 1024)) for _ in range(40)]  # 10 MiB of answers
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not conn.closed and loop.time() < deadline:
                with contextlib.suppress(AssertionError, ConnectionError):
                    await c.until(lambda: False, 0.05)
            assert conn.closed, "the connection holding unsent answers was left open"
            assert conn.queued_out == 0 and not conn.streams
            assert all(not c.streams[s].data for s in sids)  # a zero window: nothing was sent
            await until(lambda: env.server._active == 0)
        finally:
            c.close()
        await still_serving(env)


async def test_a_client_that_does_not_read_its_socket_is_closed_after_the_send_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(limits=limits(conn_send_buffer_bytes=2 * MiB)) as env:
        seen = watch(monkeypatch)
        writer = await unread_connection(env.port)
        enc = hpack.Encoder()
        writer.write(PREFACE + settings(initial_window_size=2**31 - 1)
                     + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535)))
        for sid in range(1, 2 * 200, 2):  # 200 MiB of answers asked for, none read
            writer.write(frame(HEADERS, END_HEADERS, sid, request_headers(enc, "Fill"))
                         + frame(DATA, END_STREAM, sid, grpc_message(b"%d" % MiB)))
        await until(lambda: seen)
        conn = seen[0]
        await until(lambda: conn.closed, 15)
        assert conn.queued_out == 0 and not conn.streams and not conn.wbuf
        await until(lambda: env.server._active == 0)
        writer.transport.abort()
        await still_serving(env)


# ---- control-frame floods ----------------------------------------------------------------------
async def test_a_ping_flood_that_is_not_read_gets_goaway_enhance_your_calm(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(limits=limits(max_pending_control_frames=100)) as env:
        seen = watch(monkeypatch)
        writer = await unread_connection(env.port)
        writer.write(PREFACE + settings())
        pings = frame(PING, 0, 0, b"floodpng") * 10000
        for _ in range(30):  # 300k PINGs (5 MB), none of the ACKs read
            writer.write(pings)
        await until(lambda: seen)
        conn = seen[0]
        await until(lambda: conn.closed, 15)
        writer.transport.abort()
        await still_serving(env)


async def test_a_settings_frame_with_too_many_entries_is_enhance_your_calm() -> None:
    """Each INITIAL_WINDOW_SIZE entry walks every stream: 32 entries per frame at most (nghttp2)."""
    async with serving() as env:
        raw = await RawConn.open(env.port)
        entries = b"".join(struct.pack(">HI", 4, 65535 + i) for i in range(33))
        raw.send(PREFACE + settings() + frame(SETTINGS, 0, 0, entries))
        got = await raw.read_to_eof(5.0)
        assert raw.eof and goaway_code(got) == ENHANCE_YOUR_CALM
        await still_serving(env)


async def test_pings_that_are_read_are_answered() -> None:
    """500 PINGs, fewer than the cap of them per write, from a peer that reads: every one answered."""
    async with serving(limits=limits(max_pending_control_frames=10)) as env:
        raw = await RawConn.open(env.port)
        raw.send(PREFACE + settings())
        for sent in range(5, 501, 5):
            raw.send(frame(PING, 0, 0, b"12345678") * 5)
            got = await raw.read_until(lambda fs, n=sent: sum(t == PING for t, _, _, _ in fs) == n)
        assert sum(t == PING for t, _, _, _ in got) == 500 and goaway_code(got) is None
        raw.close()


async def test_more_control_frames_in_one_read_than_the_cap_is_a_flood() -> None:
    """One read that queues more PING/SETTINGS ACKs than the cap is a flood even from a peer that
    reads (nghttp2 counts its outbound queue the same way): the cap stops it within one read
    instead of after the socket backs up, so the event loop is not held by a read's worth of
    control frames (a 256 KiB read is ~17k SETTINGS frames)."""
    async with serving(limits=limits(max_pending_control_frames=10)) as env:
        raw = await RawConn.open(env.port)
        raw.send(PREFACE + settings() + frame(PING, 0, 0, b"12345678") * 11)
        got = await raw.read_to_eof(5.0)
        assert raw.eof and goaway_code(got) == ENHANCE_YOUR_CALM
        assert sum(t == PING for t, _, _, _ in got) == 0  # the ACKs of the flooding read are dropped
        await still_serving(env)


# ---- timeouts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sent", [
    b"",  # nothing at all
    PREFACE[:10],  # half a preface
    PREFACE + settings() + frame(HEADERS, 0, 1, b"\x83"),  # HEADERS whose CONTINUATION never comes
    PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, b"\x83" * 100)[:50],  # half a HEADERS frame
], ids=["silent", "half-preface", "no-continuation", "half-frame"])
async def test_header_timeout_closes_connections_whose_headers_never_complete(sent: bytes) -> None:
    async with serving(limits=limits(header_timeout_s=0.3)) as env:
        raw = await RawConn.open(env.port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        raw.send(sent)
        await raw.read_to_eof(5.0)
        assert raw.eof and loop.time() - t0 < 3.0
        await until(lambda: not env.server._conns)
        await still_serving(env)


async def test_idle_connections_get_goaway_and_are_closed_busy_ones_are_not() -> None:
    async with serving(limits=limits(idle_timeout_s=0.4)) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Sleep"))
                 + frame(DATA, END_STREAM, 1, grpc_message(b"1.0")))  # busy for 1 s, then idle
        got = await raw.read_to_eof(5.0)
        assert raw.eof and goaway_code(got) == 0
        blocks, data = responses(got)
        assert blocks[1][-1][b"grpc-status"] == b"0" and data[1] == grpc_message(b"slept")
        await still_serving(env)


async def test_keepalive_pings_a_silent_connection_and_closes_it_without_an_ack() -> None:
    async with serving(limits=limits(keepalive_interval_s=0.2, keepalive_timeout_s=0.2)) as env:
        raw = await RawConn.open(env.port)
        loop = asyncio.get_running_loop()
        raw.send(PREFACE + settings() + frame(SETTINGS, 1, 0))
        t0 = loop.time()
        got = await raw.read_to_eof(5.0)
        assert raw.eof and loop.time() - t0 < 3.0
        assert (PING, 0, 0, KEEPALIVE_PING) in got  # it asked first
        await still_serving(env)


@needs_h2
async def test_keepalive_keeps_a_connection_whose_peer_answers() -> None:
    async with serving(limits=limits(keepalive_interval_s=0.1, keepalive_timeout_s=0.1)) as env:
        c = await H2Client.connect(env.port)  # h2 acknowledges PINGs
        try:
            with contextlib.suppress(AssertionError):
                await c.until(lambda: False, 1.0)
            assert c.terminated is None and env.server._conns
            sid = c.request("Echo", b"alive")
            await c.until(lambda: c.streams[sid].ended)
            assert c.streams[sid].data == grpc_message(b"alive")
        finally:
            c.close()


# ---- what must keep working ------------------------------------------------------------------------
async def test_20_mib_messages_and_streams_work_with_the_default_limits() -> None:
    async with serving(limits=ServerLimits()) as env:
        payload = bytes(range(256)) * (20 * MiB // 256)
        assert await env.unary("Echo")(payload, timeout=30) == payload
        got = [m async for m in env.unary_stream("Count")(b"1000", timeout=30)]
        assert got == [b"%d" % i for i in range(1000)]
        got = [m async for m in env.stream_stream("Bidi")(iter([b"%d" % i for i in range(500)]), timeout=30)]
        assert got == [b"%d" % i for i in range(500)]
        await env.unary("Sleep")(b"0.01", timeout=10)
        await waited(env.probe.started)
        assert path("Echo").startswith("/")


# ---- client mistakes are client errors (INVALID_ARGUMENT, never INTERNAL/UNKNOWN) ----------------------
async def test_malformed_requests_are_invalid_argument() -> None:
    async with serving() as env:
        health = HealthState()
        env.server.add_methods(access.HEALTH_SERVICE, methods(HealthServicer(health), access.HEALTH_METHODS))
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        check = [(":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
                 (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")]
        raw.send(PREFACE + settings()
                 # two messages on a unary call
                 + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Echo"))
                 + frame(DATA, END_STREAM, 1, grpc_message(b"one") + grpc_message(b"two"))
                 # a message cut short by END_STREAM
                 + frame(HEADERS, END_HEADERS, 3, request_headers(enc, "Echo"))
                 + frame(DATA, 0, 3, struct.pack(">BI", 0, 100) + b"short")
                 + frame(DATA, END_STREAM, 3, b"")
                 # no message at all
                 + frame(HEADERS, END_HEADERS | END_STREAM, 5, request_headers(enc, "Echo"))
                 # bytes that are not the method's request message
                 + frame(HEADERS, END_HEADERS, 7, enc.encode(check))
                 + frame(DATA, END_STREAM, 7, grpc_message(b"\xff\xff\xff not a protobuf")))
        got = await raw.read_until(lambda fs: all(stream_ended(s)(fs) for s in (1, 3, 5, 7)))
        blocks, _ = responses(got)
        assert {sid: b[-1][b"grpc-status"] for sid, b in blocks.items()} == {1: b"3", 3: b"3", 5: b"3", 7: b"3"}
        raw.close()


# ---- frames one loop pass takes from a connection -----------------------------------------------
async def test_a_read_of_many_frames_is_taken_over_several_loop_passes_in_order() -> None:
    """100,000 frames that carry nothing (an unknown type, ignored), then an Echo call, in one
    write: the server takes at most FRAMES_PER_PASS of them per pass of the loop (reading paused
    for the rest), so the loop runs other work at least 100,000 / FRAMES_PER_PASS times before the
    call is answered; the call after them is answered, its frames taken in order. (On the code
    before, each read's ~29,000 frames were taken in one pass: ~10 passes in all.)"""
    async with serving(limits=limits()) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        junk = 100_000
        raw.send(PREFACE + settings() + frame(0x20, 0, 0, b"") * junk
                 + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Echo"))
                 + frame(DATA, END_STREAM, 1, grpc_message(b"after the junk")))
        passes = 0
        answered = asyncio.ensure_future(raw.read_until(stream_ended(1), timeout=30.0))
        while not answered.done():
            await asyncio.sleep(0)  # one pass of the loop each
            passes += 1
        got = answered.result()
        blocks, data = responses(got)
        assert blocks[1][-1][b"grpc-status"] == b"0" and data[1] == grpc_message(b"after the junk")
        assert passes >= junk // FRAMES_PER_PASS, passes
        assert goaway_code(got) is None and not raw.eof
        conn = the_connection(env)
        assert not conn.frames_waiting and not conn.chunks
        raw.close()
        await still_serving(env)


async def test_a_read_of_many_header_fields_is_taken_over_several_loop_passes() -> None:
    """100 Echo calls in one write, each block ~1,000 fields (one table entry referenced again and
    again, and a field of its own: no block is the one before, so each is decoded): each decoded
    field counts as a frame of the pass's FRAMES_PER_PASS, so the loop runs other work about once
    per call. (On the code before, one pass decoded every block of the read: a few passes in all.)
    The server advertises its MAX_HEADER_LIST."""
    async with serving(limits=limits()) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        calls, fields = 100, 1000
        raw.send(PREFACE + settings() + b"".join(
            frame(HEADERS, END_HEADERS, 2 * i + 1, request_headers(
                enc, "Echo", extra=(("x-a", "b"),) * fields + (hpack.NeverIndexedHeaderTuple("x-n", str(i)),)))
            + frame(DATA, END_STREAM, 2 * i + 1, grpc_message(b"%d" % i)) for i in range(calls)))
        passes = 0
        last = 2 * calls - 1
        answered = asyncio.ensure_future(raw.read_until(stream_ended(last), timeout=60.0))
        while not answered.done():
            await asyncio.sleep(0)  # one pass of the loop each
            passes += 1
        got = answered.result()
        blocks, data = responses(got)
        assert all(blocks[2 * i + 1][-1][b"grpc-status"] == b"0" for i in range(calls))
        # (a block is decoded whole: a pass may end one block past its FRAMES_PER_PASS)
        assert passes >= calls * fields // (FRAMES_PER_PASS + fields), passes
        advertised = {struct.unpack_from(">H", p, i)[0]: struct.unpack_from(">I", p, i + 2)[0]
                      for t, f, _, p in got if t == SETTINGS and not f & 1 for i in range(0, len(p), 6)}
        assert advertised[SETTINGS_MAX_HEADER_LIST_SIZE] == MAX_HEADER_LIST
        raw.close()
        await still_serving(env)


async def test_a_header_list_over_max_header_list_is_a_compression_error() -> None:
    """A block that decodes to more than MAX_HEADER_LIST (names, values and 32 bytes a field:
    RFC 9113's SETTINGS_MAX_HEADER_LIST_SIZE, which the server advertises) ends the connection
    with COMPRESSION_ERROR, as one over MAX_HEADER_BLOCK did; one under it is served. 29,000
    1-byte references to one table entry (29 KB on the wire) were ~85 ms of the loop each."""
    async with serving(limits=limits()) as env:
        under = MAX_HEADER_LIST // (len("x-a") + len("b") + 32) - 20  # (with the call's own fields)
        for fields, served in ((under, True), (under + 40, False), (29_000, False)):
            raw = await RawConn.open(env.port)
            enc = hpack.Encoder()
            raw.send(PREFACE + settings()
                     + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Echo", extra=(("x-a", "b"),) * fields))
                     + frame(DATA, END_STREAM, 1, grpc_message(b"x")))
            got = await raw.read_until(lambda frames: stream_ended(1)(frames) or goaway_code(frames) is not None,
                                       timeout=30.0)
            if served:
                assert responses(got)[0][1][-1][b"grpc-status"] == b"0", fields
            else:
                assert goaway_code(got) == ErrorCode.COMPRESSION_ERROR, fields
            raw.close()
        await still_serving(env)


async def test_a_connections_streaming_handlers_take_at_most_messages_per_pass_together() -> None:
    """10 request-streaming calls (Bidi: it echoes each message) of one connection, 300 messages
    each, all in one write: the connection's handlers take at most MESSAGES_PER_PASS messages
    in one pass of the loop, all its streams together, so the loop runs other work at least
    3,000 / MESSAGES_PER_PASS times before the last echo; every message is echoed, each stream's
    in order. (On the code before, each stream's queued messages were all taken in one pass: ~7
    passes; with the allowance counted per stream, ~10 x fewer than here.)"""
    async with serving(limits=limits()) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        streams, each = 10, 300
        bodies = {2 * k + 1: b"".join(grpc_message(b"%d:%d" % (k, i)) for i in range(each)) for k in range(streams)}
        raw.send(PREFACE + settings() + b"".join(
            frame(HEADERS, END_HEADERS, sid, request_headers(enc, "Bidi")) + frame(DATA, END_STREAM, sid, body)
            for sid, body in bodies.items()))
        passes = 0
        answered = asyncio.ensure_future(raw.read_until(
            lambda frames: all(stream_ended(sid)(frames) for sid in bodies), timeout=30.0))
        while not answered.done():
            await asyncio.sleep(0)  # one pass of the loop each
            passes += 1
        blocks, data = responses(answered.result())
        for sid, body in bodies.items():
            assert blocks[sid][-1][b"grpc-status"] == b"0" and data[sid] == body
        assert passes >= streams * each // MESSAGES_PER_PASS, passes
        raw.close()
