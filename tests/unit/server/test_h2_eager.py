"""A unary call's first step runs at once, without a Task (ServerConnection._start_unary): each
call still has its own context, a call that then waits goes on in a Task (deadlines and resets
cancel it as before), and a method whose calls wait is started in a Task again."""
from __future__ import annotations

import asyncio
import contextvars

import pytest

from meshserve.server.h2 import H2GrpcServer, Status, unary_unary
from meshserve.server.h2 import connect as h2_connect
from meshserve.server.h2.client import GrpcError
from meshserve.server.h2.server import EAGER_MAX, EAGER_PROBE

VAR: contextvars.ContextVar[bytes] = contextvars.ContextVar("VAR", default=b"unset")


async def _serve(methods: dict) -> tuple[H2GrpcServer, int]:
    server = H2GrpcServer()
    server.add_methods("e.Eager", methods)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    return server, port


async def test_each_call_has_its_own_context_and_a_sync_method_stays_eager() -> None:
    seen: list[bytes] = []

    async def tag(req: bytes, ctx: object) -> bytes:
        seen.append(VAR.get())
        VAR.set(req)  # must not be seen by the next call on the connection
        return req

    server, port = await _serve({"Tag": unary_unary(tag)})
    conn = await h2_connect(f"127.0.0.1:{port}")
    try:
        for i in range(EAGER_MAX + 4):
            assert await conn.unary("/e.Eager/Tag", b"call %d" % i) == b"call %d" % i
        assert seen == [b"unset"] * (EAGER_MAX + 4)
        assert server._eager["/e.Eager/Tag"] == EAGER_MAX  # answered at once every time
    finally:
        conn.close()
        await server.stop(None)


async def test_a_call_that_waits_is_cancelled_by_its_deadline_and_the_method_goes_back_to_tasks() -> None:
    cancelled: list[bool] = []
    gate = asyncio.Event()

    async def wait(req: bytes, ctx: object) -> bytes:
        if req == b"now":
            return b"answered at once"
        try:
            await asyncio.wait_for(gate.wait(), 5) if req == b"hold" else await asyncio.sleep(0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return req

    server, port = await _serve({"Wait": unary_unary(wait)})
    conn = await h2_connect(f"127.0.0.1:{port}")
    path = "/e.Eager/Wait"
    try:
        # first call: started at once, then waits: carried on in a Task that the deadline cancels
        with pytest.raises(GrpcError) as err:
            await conn.unary(path, b"hold", timeout=0.2)
        assert err.value.code == Status.DEADLINE_EXCEEDED
        for _ in range(100):
            if cancelled:
                break
            await asyncio.sleep(0.01)
        assert cancelled == [True]
        assert server._eager[path] == 0  # it waited: the next calls start in a Task
        for i in range(EAGER_PROBE - 1):
            assert await conn.unary(path, b"later %d" % i) == b"later %d" % i
        assert server._eager[path] == -(EAGER_PROBE - 1)
        # the probe: tried at once again, answers without waiting, and the method is eager again
        assert await conn.unary(path, b"now") == b"answered at once"
        assert server._eager[path] == 1
        assert await conn.unary(path, b"yield") == b"yield"  # waits one loop pass: a Task again
        assert server._eager[path] == 0
    finally:
        gate.set()
        conn.close()
        await server.stop(None)
