"""meshserve/server/slots.py: a few slots shared fairly between tenants (the inflating turns,
the body workers, the ensemble step slots)."""
from __future__ import annotations

import asyncio

import pytest

from meshserve.server.slots import Slots


def test_slots_give_a_tenant_at_most_its_cap_round_robin() -> None:
    """Slots: a tenant at its cap waits while a slot is free for another; a freed slot goes to
    the first tenant of the round that may take one more, which then goes to the end of the
    round; without a cap's limit (None, cap n) in arrival order."""

    async def main() -> None:
        slots = Slots(2)
        granted: list[tuple[str, int]] = []

        async def take(who: str, cap: int) -> int:
            index = await slots.take(who, cap)
            granted.append((who, index))
            return index

        assert await take("m", 1) == 0
        m2 = asyncio.ensure_future(take("m", 1))
        await asyncio.sleep(0)
        assert not m2.done() and slots.free == [1]  # at its cap, with a slot free
        assert await take("a", 1) == 1
        slots.give(0, "m")
        assert await m2 == 0
        # both held (m: 0, a: 1); m with cap 2 and a queue behind, round m, a
        waiters = [asyncio.ensure_future(take(who, 2)) for who in ("m", "m", "a")]
        await asyncio.sleep(0)
        slots.give(1, "a")  # -> m (first in the round), which goes to the end
        await asyncio.sleep(0)
        slots.give(0, "m")  # -> a
        await asyncio.sleep(0)
        assert granted[-2:] == [("m", 1), ("a", 0)]
        slots.give(1, "m")  # -> the last m
        await asyncio.gather(*waiters)
        assert granted[-1] == ("m", 1)
        for index, who in ((0, "a"), (1, "m")):
            slots.give(index, who)
        assert sorted(slots.free) == [0, 1] and not slots.held and not slots.waiting

    asyncio.run(main())


def test_slots_a_cancelled_waiter_leaves_its_line_or_passes_its_slot_on() -> None:
    async def main() -> None:
        slots = Slots(1)
        assert await slots.take(None, 1) == 0
        gone = asyncio.ensure_future(slots.take(None, 1))
        kept = asyncio.ensure_future(slots.take(None, 1))
        await asyncio.sleep(0)
        gone.cancel()  # while it waits: it leaves the line
        await asyncio.sleep(0)
        slots.give(0, None)
        assert await kept == 0
        handed = asyncio.ensure_future(slots.take("t", 1))
        await asyncio.sleep(0)
        slots.give(0, None)  # handed over to ``handed`` ...
        handed.cancel()  # ... which is cancelled before it runs: the slot is given back
        with pytest.raises(asyncio.CancelledError):
            await handed
        assert slots.free == [0] and not slots.held and not slots.waiting

    asyncio.run(main())


def test_a_holder_passes_its_slot_to_the_next_tenant_that_may_take_it() -> None:
    """pass_on: the slot goes to another tenant's waiter first, and the holder waits at the head
    of its own line, last in the round; a tenant waiting at its cap is passed over, so the slot
    comes straight back to the holder."""

    async def main() -> None:
        slots = Slots(2)
        assert await slots.take("m", 1) == 0
        assert await slots.take("a", 2) == 1
        m2 = asyncio.ensure_future(slots.take("m", 1))  # m at its cap
        await asyncio.sleep(0)
        assert slots.wanted("a") and not m2.done()
        assert await slots.pass_on(1, "a", 2) == 1  # m may not take it: back to a at once
        assert not m2.done() and slots.held == {"m": 1, "a": 1}
        slots.give(0, "m")  # m's own slot: to its waiter
        assert await m2 == 0
        # a's waiter and b's: a passes on to b, then gets the next slot given
        b = asyncio.ensure_future(slots.take("b", 2))
        await asyncio.sleep(0)
        passed = asyncio.ensure_future(slots.between(1, "a", 2))
        await asyncio.sleep(0)
        assert await b == 1 and not passed.done() and list(slots.waiting) == ["a"]
        slots.give(0, "m")
        assert await passed == 0
        assert await slots.between(0, "a", 2) == 0  # nobody else waits: kept, the loop ran once
        for index, who in ((0, "a"), (1, "b")):
            slots.give(index, who)
        assert sorted(slots.free) == [0, 1] and not slots.held and not slots.waiting and slots.busy == 0

    asyncio.run(main())


def test_a_holder_cancelled_between_slices_holds_nothing() -> None:
    """between: cancelled while the loop runs others (nobody waiting) or while it waits for its
    turn back (another tenant waiting), the holder gives back or leaves what it had."""

    async def main() -> None:
        slots = Slots(1)
        assert await slots.take("a", 1) == 0
        alone = asyncio.ensure_future(slots.between(0, "a", 1))
        await asyncio.sleep(0)
        alone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await alone
        assert slots.busy == 0 and not slots.held
        assert await slots.take("a", 1) == 0
        b = asyncio.ensure_future(slots.take("b", 1))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(slots.between(0, "a", 1))
        await asyncio.sleep(0)
        assert await b == 0 and not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not slots.waiting and slots.held == {"b": 1}
        slots.give(0, "b")
        assert slots.busy == 0 and not slots.held

    asyncio.run(main())
