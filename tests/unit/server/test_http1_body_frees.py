"""A request body that failed (a 413, a lost connection) raises a copy of its stored error, so no
reader's frame is kept in a cycle through it (tests/support/cycles.py; docs/security.md,
"Session 11: error cycles")."""
from __future__ import annotations

import asyncio

import pytest

from meshserve.protocol.errors import InferError
from meshserve.server.http1.request import Body, BodyError
from tests.support.cycles import collector_off, cyclic_frames


class _Conn:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()

    def consumed(self, n: int) -> None:
        pass


async def _handler(body: Body) -> bytes:
    held = bytearray(1 << 20)  # (what a handler's frame holds: the request)
    return bytes(held[:0]) + await body.read()


@pytest.mark.parametrize("make", [lambda: InferError.too_large("the request body is larger than the limit"),
                                  lambda: BodyError("the connection was lost before the request body ended")])
async def test_a_failed_body_leaves_no_frame_in_a_cycle(make) -> None:  # type: ignore[no-untyped-def]
    text, kind = str(make()), type(make())
    with collector_off():
        for late in (False, True):  # failed before the read, and while it waits
            body = Body(_Conn())  # type: ignore[arg-type]
            if not late:
                body.fail(make())
            reading = asyncio.ensure_future(_handler(body))
            await asyncio.sleep(0)
            if late:
                body.fail(make())
            with pytest.raises(kind) as raised:
                await reading
            assert str(raised.value) == text
            del body, reading, raised
        assert cyclic_frames() == []
