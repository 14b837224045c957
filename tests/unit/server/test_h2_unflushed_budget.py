"""The send budget (--conn-send-buffer-bytes) also bounds the answers a connection writes within
one read or one loop pass, before anything is flushed to the socket (session 10 review).

A peer that grants large windows (SETTINGS_INITIAL_WINDOW_SIZE, a connection WINDOW_UPDATE,
SETTINGS_MAX_FRAME_SIZE 16 MiB) lets every answer take the unary fast path (``_reply``: HEADERS,
DATA and trailers into the write buffer, the stream closed at once). An at-once hook
(``H2GrpcServer.at_once``: the gateway's cache hits) answers in the connection's own read, so a
stream never stays open: SETTINGS_MAX_CONCURRENT_STREAMS did not bound how many answers one read
made, and the budget was checked only once the socket was backed up, after the read. 300 small
requests in one TCP write made 300 answers in the write buffer (here 1 MiB each, fresh bytes
each, as the cache's answer with the request's id spliced in is). Now the bytes written since the
last flush count against the budget: past it the connection is closed (GOAWAY
ENHANCE_YOUR_CALM), the rest of the read's streams are refused, and every call ends once."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from meshserve.server.h2 import Call, H2GrpcServer, unary_unary
from meshserve.server.limits import ServerLimits
from tests.adversarial import h2raw
from tests.adversarial.h2raw import RawH2

SERVICE = "t.Flood"
PATH = f"/{SERVICE}/Ask"
ANSWER = 1 << 20
BUDGET = 4 << 20
REQUESTS = 300


def _server(seen: dict[str, Any]) -> tuple[H2GrpcServer, Callable[[bytes, None], bytes]]:
    """The server, and a hook that wants no call (held here: a compiled server takes no attribute it
    does not declare)."""
    def answer(message: bytes, call: Any, counter: str) -> bytes:
        held = sum(len(b) for b in call._conn.wbuf)  # what the connection holds unflushed right now
        seen["peak"] = max(seen["peak"], held)
        seen[counter] += 1
        return message * (ANSWER // len(message))  # fresh bytes per call (the id spliced in)

    async def handler(request: bytes, call: Call) -> bytes:
        return answer(request, call, "tasks")

    def hook(message: bytes, call: Any) -> bytes:
        return answer(message, call, "hook")

    def frames_hook(message: bytes, call: None) -> bytes:  # no call: ServerConnection._at_once's path
        seen["frames"] += 1
        return message * (ANSWER // len(message))

    server = H2GrpcServer(limits=ServerLimits(conn_send_buffer_bytes=BUDGET, max_concurrent_streams=100))
    server.add_methods(SERVICE, {"Ask": unary_unary(handler)})
    server.at_once[PATH] = (hook, True)
    return server, frames_hook


def _flood(port: int) -> RawH2:
    """Open a connection with every window wide open, then send REQUESTS calls in one write and
    read nothing (the answers pile up on the server's side)."""
    raw = RawH2(f"127.0.0.1:{port}", read=False,
                client_settings={h2raw.INITIAL_WINDOW_SIZE: 0x7FFFFFFF, h2raw.MAX_FRAME_SIZE: (1 << 24) - 1})
    raw.send(h2raw.window_update(0, 0x7FFFFFFF - 65535))
    block = h2raw.grpc_headers(raw.authority, PATH)
    body = h2raw.grpc_message(b"abcdefgh")
    burst = b"".join(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, sid, block) + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, body)
                     for sid in range(1, 2 * REQUESTS, 2))
    raw.send(burst)
    return raw


async def _attack(via: str) -> tuple[dict[str, Any], RawH2, H2GrpcServer]:
    seen = {"peak": 0, "hook": 0, "tasks": 0, "frames": 0}
    server, frames_hook = _server(seen)
    if via == "task":
        server.at_once.clear()
    elif via == "frames":  # a hook that wants no call: answered from the two frames, no stream made
        server.at_once[PATH] = (frames_hook, False)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    loop = asyncio.get_running_loop()
    raw = await loop.run_in_executor(None, _flood, port)

    async def ended() -> None:
        while server._active:
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(ended(), 20)
        await loop.run_in_executor(None, raw.wait_closed_unread, 10.0)
    finally:
        raw.close()
        await server.stop(0)
    return seen, raw, server


async def test_at_once_answers_in_one_read_stay_within_the_send_budget() -> None:
    seen, raw, server = await _attack("hook")
    # the connection was closed for its budget, not served 300 MiB of answers it did not read
    assert raw.seen.eof or raw.seen.goaway == h2raw.ENHANCE_YOUR_CALM, raw.seen  # (aborted: the GOAWAY may be lost)
    assert seen["peak"] <= BUDGET + ANSWER + (1 << 16), seen
    assert seen["hook"] <= BUDGET // ANSWER + 2, seen  # the rest of the read's streams refused
    assert server._active == 0  # every call ended exactly once


async def test_task_answers_in_one_pass_stay_within_the_send_budget() -> None:
    """The same class without the hook: up to SETTINGS_MAX_CONCURRENT_STREAMS (100 here) calls
    answered by their Tasks in one loop pass (the flush runs after all of them)."""
    seen, raw, server = await _attack("task")
    assert raw.seen.eof or raw.seen.goaway == h2raw.ENHANCE_YOUR_CALM, raw.seen  # (aborted: the GOAWAY may be lost)
    assert seen["peak"] <= BUDGET + ANSWER + (1 << 16), seen
    assert server._active == 0


async def test_answers_from_the_two_frames_stay_within_the_send_budget() -> None:
    """The same class on the path that answers a call from its HEADERS and DATA frames before a
    stream is made (``ServerConnection._at_once``, a hook that wants no call): once the bytes
    written since the last flush pass the budget, the rest go the usual way (``_reply``'s check)."""
    seen, raw, server = await _attack("frames")
    assert raw.seen.eof or raw.seen.goaway == h2raw.ENHANCE_YOUR_CALM, raw.seen  # (aborted: the GOAWAY may be lost)
    assert 0 < seen["frames"] <= BUDGET // ANSWER + 2, seen  # not 300 answers of 1 MiB held unflushed
    assert server._active == 0
