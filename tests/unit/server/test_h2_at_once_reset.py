"""An at-once answer (H2GrpcServer.at_once: the gateway's cache hits) larger than the peer's
window waits in the stream's queue; a client that resets the stream then (a reset mid-answer)
ends the call exactly once, and what was queued is dropped and uncounted (session 10 review)."""
from __future__ import annotations

import asyncio
from typing import Any

from meshserve.server.h2 import Call, H2GrpcServer, unary_unary
from tests.adversarial import h2raw
from tests.adversarial.h2raw import RawH2

PATH = "/t.Reset/Ask"
ANSWER = 1 << 20


async def test_a_reset_mid_answer_ends_the_call_once_and_drops_what_waited() -> None:
    async def handler(request: bytes, call: Call) -> bytes:
        return b"task"

    def hook(message: bytes, call: Any) -> bytes:
        return bytes(ANSWER) if message == b"big" else b"small"

    server = H2GrpcServer()
    server.add_methods("t.Reset", {"Ask": unary_unary(handler)})
    server.at_once[PATH] = (hook, False)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    loop = asyncio.get_running_loop()
    raw = RawH2(f"127.0.0.1:{port}", give_window=False)  # reads, but never gives window back
    block = h2raw.grpc_headers(raw.authority, PATH)

    def call(sid: int, message: bytes) -> None:
        raw.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, sid, block)
                 + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, h2raw.grpc_message(message)))

    async def until(check: Any) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"not reached: {raw.seen}")

    try:
        await loop.run_in_executor(None, call, 1, b"big")
        await until(lambda: server._conns and any(c.queued_out for c in server._conns))
        conn = next(iter(server._conns))
        assert server._active == 1 and 1 in conn.streams  # its answer waits for window
        await loop.run_in_executor(None, raw.send, h2raw.rst(1))
        await until(lambda: server._active == 0)
        assert conn.queued_out == 0 and 1 not in conn.streams  # dropped, and uncounted
        await loop.run_in_executor(None, raw.send, h2raw.window_update(0, 1 << 21))
        await loop.run_in_executor(None, call, 3, b"x")  # the connection goes on
        await until(lambda: raw.seen.statuses.get(3) == "0")
        assert 1 not in raw.seen.statuses  # the reset call got no trailers: it ended once, by the reset
        assert server._active == 0
    finally:
        raw.close()
        await server.stop(0)
