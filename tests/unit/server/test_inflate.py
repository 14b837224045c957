"""meshserve/server/inflate.py: a compressed gRPC message inflated in slices, one message at a
time, each slice charged to the process's budget before it is made; refusals give back what
they held; a cancelled inflation gives back its bytes and its turn."""
from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Iterator

import pytest

from meshserve.server import inflate

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    budget, turns = inflate.INFLATING, inflate.INFLATING_NOW
    saved = budget.limit
    assert budget.used == 0 and turns.running == 0 and not turns.waiting
    yield
    budget.limit = saved
    assert budget.used == 0, "every test gives back what it held"
    assert turns.running == 0 and not turns.waiting, "and its turn"


def test_a_message_is_inflated_whole_in_slices_and_charged_until_released() -> None:
    data = bytes(range(256)) * (4 * MiB // 256)

    async def run() -> None:
        passes = [0]

        async def count() -> None:
            while True:
                passes[0] += 1
                await asyncio.sleep(0)

        counter = asyncio.create_task(count())
        held, small = inflate.Inflation(), inflate.Inflation()
        assert await held.run(b"gzip", gzip.compress(data), 64 * MiB) == data
        assert await small.run(b"deflate", zlib.compress(b"small"), 64 * MiB) == b"small"
        counter.cancel()
        assert passes[0] >= len(data) // inflate.STEP - 1  # the loop ran between the slices
        assert inflate.INFLATING.used == held.held + small.held == len(data) + 5  # held until released
        held.release()
        held.release()  # idempotent
        assert inflate.INFLATING.used == 5
        small.release()

    asyncio.run(run())


@pytest.mark.parametrize(("encoding", "data", "code", "text"), [
    (b"gzip", gzip.compress(bytes(3 * MiB), mtime=0), "RESOURCE_EXHAUSTED", "Received message larger than max"),
    (b"gzip", gzip.compress(bytes(MiB), mtime=0)[:-20], "INVALID_ARGUMENT", "incomplete or truncated"),
    (b"gzip", b"not gzip at all", "INVALID_ARGUMENT", "cannot decompress the request"),
    (None, gzip.compress(b"x", mtime=0), "INVALID_ARGUMENT", "without a grpc-encoding"),
])
def test_refusals_name_the_fault_and_give_back_what_they_held(encoding: bytes | None, data: bytes, code: str,
                                                              text: str) -> None:
    async def run() -> None:
        held = inflate.Inflation()
        with pytest.raises(inflate.Refused) as info:
            await held.run(encoding, data, 2 * MiB)
        assert info.value.code == code and text in info.value.message
        assert held.held == 0

    asyncio.run(run())


def test_a_message_that_does_not_fit_the_budget_is_refused_before_its_slice_is_made() -> None:
    inflate.INFLATING.limit = 2 * MiB

    async def run() -> None:
        first = inflate.Inflation()
        await first.run(b"gzip", gzip.compress(bytes(MiB + MiB // 2)), 64 * MiB)  # 1.5 MiB held
        with pytest.raises(inflate.Refused) as info:
            await inflate.Inflation().run(b"gzip", gzip.compress(bytes(MiB)), 64 * MiB)
        assert info.value.code == "RESOURCE_EXHAUSTED" and "--max-receive-bytes" in info.value.message
        assert inflate.INFLATING.used == first.held == MiB + MiB // 2  # the refused one holds nothing
        first.release()
        again = inflate.Inflation()
        assert await again.run(b"gzip", gzip.compress(b"ok"), 64 * MiB) == b"ok"
        again.release()

    asyncio.run(run())


def test_one_message_inflates_at_a_time_in_order_and_a_cancelled_one_passes_its_turn() -> None:
    big = gzip.compress(bytes(8 * MiB))

    async def run() -> None:
        order: list[str] = []

        async def one(name: str) -> None:
            held = inflate.Inflation()
            try:
                await held.run(b"gzip", big, 64 * MiB)
                order.append(name)
            finally:
                held.release()

        a = asyncio.create_task(one("a"))
        await asyncio.sleep(0)  # a has the turn and its first slice
        b, c = asyncio.create_task(one("b")), asyncio.create_task(one("c"))
        await asyncio.sleep(0)
        assert inflate.INFLATING_NOW.running == 1 and len(inflate.INFLATING_NOW.waiting) == 2
        b.cancel()  # waiting: leaves the line
        a.cancel()  # inflating: gives back its bytes and its turn
        await asyncio.gather(a, b, c, return_exceptions=True)
        assert order == ["c"]

    asyncio.run(run())
