"""A few slots shared fairly between tenants: ``Slots``.

Three of the process's shared resources are handed out this way:

- the turns of the process's inflating and decoding (``meshserve/server/inflate.py:INFLATING_NOW``:
  one slot; a holder passes it on between two slices while another tenant waits);
- the body worker processes (``meshserve/server/body_worker.py:BodyWorker``: a slot per worker,
  and a tenant holds at most its share of them);
- a gateway's ensemble step calls in flight (``gateway/ensemble/executor.py:StepSlots``:
  --ensemble-max-inflight-steps slots, a tenant at most its share of them).

A waiter waits in its tenant's line (None: without tenants, one line); the lines are served
round-robin, so one tenant's many waiters hold another tenant back by one turn each round,
however many they are.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Hashable


class Slots:
    """``n`` slots (by index), a holder of ``tenant`` at most ``cap`` of them at once. The others
    wait in a line per tenant, and a freed slot goes to the first tenant in the round that may take
    one more (then to the end of the round); a tenant at its cap lets the next one go first. A
    waiter cancelled while it waits leaves its line; one cancelled after its slot was handed over
    gives it back. A holder may pass its slot on (``pass_on``, ``between``) and wait for one
    again at the head of its own tenant's line, that line last in the round."""

    __slots__ = ("n", "free", "held", "waiting")

    def __init__(self, n: int) -> None:
        self.n = n
        self.free = list(range(n - 1, -1, -1))  # (the lowest index first: worker 0 is the one usually started)
        self.held: collections.Counter[Hashable] = collections.Counter()
        # tenant -> its line of (waiter, its cap), in the order of the round (the next served first)
        self.waiting: dict[Hashable, collections.deque[tuple[asyncio.Future[int], int]]] = {}

    @property
    def busy(self) -> int:
        """Slots held now."""
        return self.n - len(self.free)

    async def take(self, tenant: Hashable, cap: int) -> int:
        """A slot's index for a holder of ``tenant``, which may hold ``cap`` at once."""
        if self.free and self.held[tenant] < cap:  # (a waiter that could take a free slot has it already)
            return self._grant(tenant)
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        line = self.waiting.get(tenant)
        if line is None:
            line = self.waiting[tenant] = collections.deque()
        line.append((waiter, cap))
        return await self._wait(tenant, waiter, cap)

    def wanted(self, tenant: Hashable) -> bool:
        """Another tenant than ``tenant`` waits for a slot (never without tenants)."""
        waiting = self.waiting
        return bool(waiting) and (len(waiting) > 1 or tenant not in waiting)

    async def between(self, index: int, tenant: Hashable, cap: int) -> int:
        """Between two slices of a holder of slot ``index`` for ``tenant``: the event loop runs
        other calls, and while another tenant waits the slot goes to it first (``pass_on``).
        Returns the slot the holder holds; raising, it holds none."""
        if not self.wanted(tenant):
            try:
                await asyncio.sleep(0)
            except BaseException:
                self.give(index, tenant)
                raise
            return index
        return await self.pass_on(index, tenant, cap)

    async def pass_on(self, index: int, tenant: Hashable, cap: int) -> int:
        """The holder's slot ``index`` to the next tenant in the round; the holder waits at the
        head of its own tenant's line, that line last in the round. Returns the slot it holds
        again; raising, it holds none."""
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        line = self.waiting.pop(tenant, None)
        if line is None:
            line = collections.deque()
        line.appendleft((waiter, cap))
        self.waiting[tenant] = line  # (last)
        self.give(index, tenant)
        return await self._wait(tenant, waiter, cap)

    async def _wait(self, tenant: Hashable, waiter: asyncio.Future[int], cap: int) -> int:
        try:
            return await waiter  # (give() counted this holder in when it set the result)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give(waiter.result(), tenant)  # (handed over, then cancelled: passed on)
            else:
                line = self.waiting.get(tenant)
                if line is not None:
                    with contextlib.suppress(ValueError):
                        line.remove((waiter, cap))
                    if not line:
                        del self.waiting[tenant]
            raise

    def give(self, index: int, tenant: Hashable) -> None:
        """Slot ``index``, held for ``tenant``, is free: to the next waiter in the round that may take it."""
        held = self.held
        held[tenant] -= 1
        if not held[tenant]:
            del held[tenant]
        self.free.append(index)
        waiting = self.waiting
        while self.free and waiting:
            for who, line in waiting.items():
                if held[who] < line[0][1]:
                    break
            else:
                return  # (every tenant waiting is at its cap)
            waiter, _ = line.popleft()
            del waiting[who]
            if line:
                waiting[who] = line  # (to the end of the round)
            if not waiter.done():
                waiter.set_result(self._grant(who))

    def _grant(self, tenant: Hashable) -> int:
        self.held[tenant] += 1
        return self.free.pop()
