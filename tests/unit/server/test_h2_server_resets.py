"""Streams the server ends on its own (MadeYouReset, CVE-2025-8671): a client's protocol error
after a whole request, a message over the limit or one left incomplete on a streaming call. The
call's status (or RST_STREAM) goes out, and its handler is cancelled as a client's own
RST_STREAM cancels it: no call runs on after its client has been answered, outside the stream's
place under MAX_CONCURRENT_STREAMS. The resets a client makes the server send are charged as its
own are (--stream-reset-burst / --stream-reset-rate). Hand-built frames over a real loopback
connection (docs/security.md, "Session 20: streams the server ends")."""
from __future__ import annotations

import struct
from typing import Any

import hpack

from meshserve.server.h2 import ErrorCode
from tests.support import eventually_async as until
from tests.unit.server.h2_support import MiB
from tests.unit.server.test_h2_limits import ENHANCE_YOUR_CALM, limits
from tests.unit.server.test_h2grpc import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    RST_STREAM,
    Env,
    Frame,
    RawConn,
    frame,
    goaway_code,
    grpc_message,
    request_headers,
    responses,
    serving,
    settings,
    still_serving,
    stream_ended,
    waited,
)

STREAM_CLOSED = int(ErrorCode.STREAM_CLOSED)


def reset_of(sid: int) -> Any:
    return lambda frames: any(t == RST_STREAM and s == sid for t, _, s, _ in frames)


def reset_code(frames: list[Frame], sid: int) -> int | None:
    for t, _, s, p in frames:
        if t == RST_STREAM and s == sid:
            return int.from_bytes(p, "big")
    return None


async def a_sleep_call_running(env: Env, enc: hpack.Encoder) -> RawConn:
    """Stream 1: a whole unary request (the Sleep handler, 30 s) whose handler has started."""
    raw = await RawConn.open(env.port)
    raw.send(PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Sleep"))
             + frame(DATA, END_STREAM, 1, grpc_message(b"30")))
    await waited(env.probe.started)
    assert env.server._active == 1
    return raw


async def test_data_after_the_clients_end_of_stream_resets_the_stream_and_cancels_its_call() -> None:
    """On the code before: the extra DATA was taken as a second message, the call answered
    INVALID_ARGUMENT ("exactly one request message") and its handler left sleeping, uncounted."""
    async with serving(limits=limits()) as env:
        raw = await a_sleep_call_running(env, hpack.Encoder())
        raw.send(frame(DATA, 0, 1, grpc_message(b"more")))
        got = await raw.read_until(reset_of(1))
        assert reset_code(got, 1) == STREAM_CLOSED, got
        await waited(env.probe.cancelled, 2.0)
        assert env.probe.cancelled_in == ["sleep"]
        await until(lambda: env.server._active == 0)
        assert goaway_code(got) is None and not raw.eof  # a stream error, not the connection's
        raw.close()
        await still_serving(env)


async def test_headers_after_the_clients_end_of_stream_reset_the_stream_and_cancel_its_call() -> None:
    async with serving(limits=limits()) as env:
        enc = hpack.Encoder()
        raw = await a_sleep_call_running(env, enc)
        raw.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, enc.encode([("x-late", "trailer")])))
        got = await raw.read_until(reset_of(1))
        assert reset_code(got, 1) == STREAM_CLOSED, got
        await waited(env.probe.cancelled, 2.0)
        assert env.probe.cancelled_in == ["sleep"]
        await until(lambda: env.server._active == 0)
        raw.close()
        await still_serving(env)


def bidi_opened(enc: hpack.Encoder) -> bytes:
    """Stream 1: the Bidi handler (it echoes each message) with one message sent, stream open."""
    return (PREFACE + settings() + frame(HEADERS, END_HEADERS, 1, request_headers(enc, "Bidi"))
            + frame(DATA, 0, 1, grpc_message(b"one")))


def echoed(frames: list[Frame]) -> bool:
    return responses(frames)[1].get(1, b"").startswith(grpc_message(b"one"))


async def test_a_streaming_call_failed_for_a_message_over_the_limit_is_cancelled() -> None:
    """On the code before: the handler saw its requests end and went on as if the client had
    finished (``bidi`` never cancelled), with its status already sent."""
    async with serving(limits=limits(max_request_bytes=1 * MiB)) as env:
        raw = await RawConn.open(env.port)
        raw.send(bidi_opened(hpack.Encoder()))
        await raw.read_until(echoed)
        raw.send(frame(DATA, 0, 1, struct.pack(">BI", 0, 400 * 10**6) + b"x" * 100))
        got = await raw.read_until(stream_ended(1))
        assert responses(got)[0][1][-1][b"grpc-status"] == b"8"
        await waited(env.probe.cancelled, 2.0)
        assert env.probe.cancelled_in == ["bidi"]
        await until(lambda: env.server._active == 0)
        raw.close()
        await still_serving(env)


async def test_a_streaming_call_ended_mid_message_is_cancelled() -> None:
    async with serving(limits=limits()) as env:
        raw = await RawConn.open(env.port)
        raw.send(bidi_opened(hpack.Encoder()))
        await raw.read_until(echoed)
        raw.send(frame(DATA, END_STREAM, 1, grpc_message(b"cut short")[:7]))
        got = await raw.read_until(stream_ended(1))
        status = responses(got)[0][1][-1]
        assert status[b"grpc-status"] == b"3" and status[b"grpc-message"] == b"incomplete message at end of stream"
        await waited(env.probe.cancelled, 2.0)
        assert env.probe.cancelled_in == ["bidi"]
        await until(lambda: env.server._active == 0)
        raw.close()
        await still_serving(env)


async def test_resets_a_client_makes_the_server_send_are_charged_as_its_own() -> None:
    """200 whole requests, each followed by DATA after its end, against a burst of 100 resets:
    GOAWAY(ENHANCE_YOUR_CALM) and the connection closed, as 200 RST_STREAMs of its own would be
    (on the code before: 200 answers, no GOAWAY)."""
    async with serving(limits=limits(stream_reset_burst=100, stream_reset_rate=10.0)) as env:
        raw = await RawConn.open(env.port)
        enc = hpack.Encoder()
        out = PREFACE + settings()
        for sid in range(1, 400, 2):
            out += (frame(HEADERS, END_HEADERS, sid, request_headers(enc, "Echo"))
                    + frame(DATA, END_STREAM, sid, grpc_message(b"x")) + frame(DATA, 0, sid, grpc_message(b"y")))
        raw.send(out)
        got = await raw.read_to_eof(10.0)
        assert raw.eof, "the connection was left open"
        assert goaway_code(got) == ENHANCE_YOUR_CALM
        await until(lambda: not env.server._conns and env.server._active == 0)
        await still_serving(env)
