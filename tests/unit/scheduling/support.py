"""Helpers of the scheduling unit tests: time in nanoseconds, a clock the test moves, a fake
execute and queued requests."""
from __future__ import annotations

import asyncio

from services.base.scheduling import QueuedRequest
from tests.support.waiting import loop_passes

MS = 1_000_000  # nanoseconds


class FakeClock:
    """A ``clock`` for the batchers: returns ``now`` (ns), which only the test changes."""

    def __init__(self, now: int = 0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class Executor:
    """Records each batch's payloads; resolves futures with the payload unless told not to.

    With ``gated`` every batch blocks until :meth:`open` is called.
    """

    def __init__(self, gated: bool = False, fail_on: object = None, forget: object = None) -> None:
        self.batches: list[list[object]] = []
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.fail_on = fail_on
        self.forget = forget
        self.active = 0
        self.max_active = 0

    def open(self) -> None:
        self.gate.set()

    async def __call__(self, batch: list[QueuedRequest]) -> None:
        payloads = [r.payload for r in batch]
        self.batches.append(payloads)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self.gate.wait()
            if self.fail_on in payloads:
                raise RuntimeError("runtime exploded")
            for r in batch:
                if r.payload != self.forget:
                    r.future.set_result(r.payload)
        finally:
            self.active -= 1


def request(payload: object, rows: int = 1, arrival_ns: int = 0,
            deadline_ns: int | None = None) -> QueuedRequest:
    fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    return QueuedRequest(rows=rows, arrival_ns=arrival_ns, payload=payload, future=fut,
                         deadline_ns=deadline_ns)


async def past_the_loop_timers(seconds: float = 0.025) -> None:
    """Move the event loop's own clock ``seconds`` on (the batcher's FakeClock stays put) and let
    every loop timer due by then run: the batcher's real timers fire as though ``seconds`` had
    passed, without the test waiting for them. A check after this sees what a timer firing
    early, against a clock that says "not yet", does."""
    loop = asyncio.get_running_loop()
    before = loop.time
    loop.time = lambda: before() + seconds  # type: ignore[method-assign]
    await settle()


settle = loop_passes  # let the batcher loop and batch tasks run without advancing any clock
