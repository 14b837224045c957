"""One sequence's requests go through the gateway one at a time, in the order they arrived.

A stateful model needs a sequence's requests in order (START first, END last), and a client
may send them back to back on one gRPC stream without waiting for answers. Inside the gateway
a request can wait on Redis (tenant quotas) or on a discovery refresh, so a later request of
the sequence could otherwise overtake an earlier one and reach the service first. The service
runs a sequence's requests one at a time anyway (one batch slot per sequence, as Triton's
sequence batcher does), so holding the next one until the previous has its answer costs a
pipelining client one gateway-to-service round trip per request, and nothing else.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from typing import TypeVar

T = TypeVar("T")


class SequenceTurns:
    def __init__(self) -> None:
        self._tails: dict[Hashable, asyncio.Future[None]] = {}  # key -> the last arrival's turn

    def __len__(self) -> int:
        return len(self._tails)

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` once every earlier request under ``key`` has finished (answered, failed
        or cancelled)."""
        async with self.turn(key):
            return await call()

    @asynccontextmanager
    async def turn(self, key: Hashable) -> AsyncIterator[None]:
        """The body runs once every earlier request under ``key`` has finished; the next one
        waits until it has (a streamed request: until its last answer)."""
        prev = self._tails.get(key)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tails[key] = mine
        try:
            if prev is not None and not prev.done():
                await asyncio.shield(prev)  # our own cancellation must not cancel the turn before us
            yield
        finally:
            if prev is None or prev.done():
                self._finish(key, mine)
            else:  # cancelled while waiting: whoever comes next still waits for the one before us
                prev.add_done_callback(lambda _: self._finish(key, mine))

    def _finish(self, key: Hashable, turn: asyncio.Future[None]) -> None:
        if not turn.done():
            turn.set_result(None)
        if self._tails.get(key) is turn:
            del self._tails[key]
