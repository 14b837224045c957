"""Helpers of the scheduling unit tests: time in nanoseconds, a clock the test moves, a fake
execute and queued requests."""
from __future__ import annotations

import asyncio

from services.base.scheduling import QueuedRequest

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


async def settle(times: int = 20) -> None:
    """Let the batcher loop and batch tasks run without advancing any clock."""
    for _ in range(times):
        await asyncio.sleep(0)
