"""meshserve/server/inflate.py: a compressed gRPC message inflated in slices, one message at a
time, each slice charged to the process's budget before it is made; refusals give back what
they held; a cancelled inflation gives back its bytes and its turn. With tenants: a tenant holds
at most its share of the budget (and of the HTTP front door's decoded bytes), a caller that is
no tenant is refused before anything is inflated, and the turns go round by tenant."""
from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from meshserve.protocol.errors import Code, InferError
from meshserve.server import inflate
from meshserve.server.http1.request import ReceiveBudget

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    budget, turns = inflate.INFLATING, inflate.INFLATING_NOW
    saved, tenant_of = budget.limit, inflate.tenant_of
    assert budget.used == 0 and turns.busy == 0 and not turns.waiting and not budget.tenants.held
    yield
    budget.limit, inflate.tenant_of = saved, tenant_of
    assert budget.used == 0, "every test gives back what it held"
    assert not budget.tenants.held, "every tenant too"
    assert turns.busy == 0 and not turns.waiting, "and its turn"


async def inflated(inflation: inflate.Inflation, data: bytes, done: list[str], name: str) -> None:
    """``data`` (gzip) inflated whole by ``inflation``, then ``name`` noted in ``done``; released."""
    try:
        await inflation.run(b"gzip", data, 64 * MiB)
        done.append(name)
    finally:
        inflation.release()


def waiting() -> int:
    """Messages waiting for a turn, all tenants' lines together."""
    return sum(map(len, inflate.INFLATING_NOW.waiting.values()))


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

        def one(name: str) -> asyncio.Task[None]:
            return asyncio.create_task(inflated(inflate.Inflation(), big, order, name))

        a = one("a")
        await asyncio.sleep(0)  # a has the turn and its first slice
        b, c = one("b"), one("c")
        await asyncio.sleep(0)
        assert inflate.INFLATING_NOW.busy == 1 and waiting() == 2
        b.cancel()  # waiting: leaves the line
        a.cancel()  # inflating: gives back its bytes and its turn
        await asyncio.gather(a, b, c, return_exceptions=True)
        assert order == ["c"]

    asyncio.run(run())


# ---- with tenants: a share of the inflated bytes, turns round-robin by tenant ------------------

SHARES = {"key-a": ("a", 0.5), "key-b": ("b", 0.25)}


def named(headers: Mapping[str, Any]) -> tuple[str, float]:
    """A gateway's tenant look-up (gateway/auth.py:Admission.caller) in small: a key names its
    tenant, no key is the anonymous callers (share 0.5), any other key is refused."""
    key = headers.get("x-api-key")
    if key is None:
        return "", 0.5
    if key not in SHARES:
        raise InferError(Code.UNAUTHENTICATED, "unknown API key")
    return SHARES[key]


def of(key: str | None) -> inflate.Inflation:
    return inflate.Inflation(() if key is None else (("x-api-key", key),))


def test_a_tenants_cap_is_its_share_of_the_limit_and_never_below_one_slice() -> None:
    shares = inflate.Tenancy(inflate.STEP)
    assert shares.cap(4 * MiB, 0.5) == 2 * MiB and shares.cap(4 * MiB, 1.0) == 4 * MiB
    assert shares.cap(MiB, 0.01) == inflate.STEP  # (a message always gets one slice in)
    assert shares.refusal(("a", 0.5), 2 * MiB, 4 * MiB, "x") is None
    shares.charge("a", MiB)
    assert shares.refusal(("a", 0.5), MiB, 4 * MiB, "x") is None  # (up to exactly its share)
    text = shares.refusal(("a", 0.5), MiB + 1, 4 * MiB, "decompressed request messages")
    assert text == ("tenant 'a' holds 1048576 bytes of decompressed request messages; 1048577 more would pass "
                    "its share (0.5 of --max-receive-bytes 4194304: 2097152), retry later")
    shares.charge("a", MiB)
    assert "anonymous callers holds 0" in str(shares.refusal(("", 0.1), MiB, 4 * MiB, "x"))
    assert shares.refusal(("b", 0.5), 2 * MiB, 4 * MiB, "x") is None  # another tenant: its own share
    shares.refund("a", MiB)
    assert shares.held == {"a": MiB}
    shares.refund("a", MiB)
    assert shares.held == {}  # (a tenant holding nothing is forgotten)


def test_a_tenant_holds_at_most_its_share_of_the_inflated_bytes_and_the_others_keep_theirs() -> None:
    inflate.INFLATING.limit = 4 * MiB
    inflate.tenant_of = named

    async def run() -> None:
        first = of("key-a")
        await first.run(b"gzip", gzip.compress(bytes(MiB + MiB // 2)), 64 * MiB)  # 1.5 of a's 2 MiB
        refused = of("key-a")
        with pytest.raises(inflate.Refused) as info:
            await refused.run(b"gzip", gzip.compress(bytes(MiB)), 64 * MiB)
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert "tenant 'a'" in info.value.message and "share (0.5 of --max-receive-bytes 4194304: 2097152)" \
            in info.value.message
        assert refused.held == 0 and inflate.INFLATING.tenants.held == {"a": MiB + MiB // 2}  # (given back)
        # the budget has room for the others: b (0.25: 1 MiB) and the anonymous callers (0.5)
        b, anonymous = of("key-b"), of(None)
        assert await b.run(b"gzip", gzip.compress(bytes(MiB - 1000)), 64 * MiB) == bytes(MiB - 1000)
        assert await anonymous.run(b"deflate", zlib.compress(bytes(MiB)), 64 * MiB) == bytes(MiB)
        with pytest.raises(inflate.Refused) as info:  # b past its own, smaller share
            await of("key-b").run(b"gzip", gzip.compress(bytes(100_000)), 64 * MiB)
        assert "tenant 'b'" in info.value.message and "share (0.25 of" in info.value.message
        assert inflate.INFLATING.tenants.held == {"a": MiB + MiB // 2, "b": MiB - 1000, "": MiB}
        assert inflate.INFLATING.used == 3 * MiB + MiB // 2 - 1000
        first.release()
        again = of("key-a")  # a's bytes given back: it has its share again
        await again.run(b"gzip", gzip.compress(bytes(2 * MiB)), 64 * MiB)
        for held in (again, b, anonymous):
            held.release()

    asyncio.run(run())


def test_an_unknown_key_is_refused_before_anything_is_inflated() -> None:
    inflate.INFLATING.limit = 4 * MiB
    inflate.tenant_of = named

    async def run() -> None:
        held = of("stolen")
        with pytest.raises(inflate.Refused) as info:
            await held.run(b"gzip", gzip.compress(bytes(MiB)), 64 * MiB)
        assert (info.value.code, info.value.message) == ("UNAUTHENTICATED", "unknown API key")
        assert held.held == 0 and inflate.INFLATING.used == 0 and inflate.INFLATING_NOW.busy == 0

    asyncio.run(run())


def test_without_tenants_nothing_is_counted_per_tenant() -> None:
    inflate.INFLATING.limit = 4 * MiB
    inflate.tenant_of = None

    async def run() -> None:
        held = of("key-a")  # (a key means nothing here)
        await held.run(b"gzip", gzip.compress(bytes(3 * MiB)), 64 * MiB)  # past a's share, were there one
        assert inflate.INFLATING.used == 3 * MiB and not inflate.INFLATING.tenants.held
        held.release()

    asyncio.run(run())


@pytest.mark.parametrize("tenants", [True, False])
def test_turns_go_round_by_tenant_so_one_tenants_line_holds_another_back_one_slice(tenants: bool) -> None:
    """Tenant a has three 8 MiB messages (128 slices each) inflating or waiting when b's small one
    comes: b's waits for one slice of a's, not for a's line. Without tenants, one line in order."""
    inflate.tenant_of = named if tenants else None
    big = gzip.compress(bytes(8 * MiB))

    async def run() -> None:
        done: list[str] = []
        held: list[inflate.Inflation] = []

        async def one(key: str, data: bytes) -> None:
            inflation = of(key)
            held.append(inflation)
            try:
                await inflation.run(b"gzip", data, 64 * MiB)
                done.append(f"{key[-1]} after {slices()} of a's slices")
            finally:
                inflation.release()

        def slices() -> int:
            return sum(h.held for h in held if h.metadata == (("x-api-key", "key-a"),)) // inflate.STEP

        a = [asyncio.create_task(one("key-a", big)) for _ in range(3)]
        await asyncio.sleep(0)  # the first of a's has the turn and its first slice, the others wait
        await asyncio.sleep(0)
        assert inflate.INFLATING_NOW.busy == 1 and waiting() == 2 and slices() == 2
        await one("key-b", gzip.compress(b"small"))
        await asyncio.gather(*a)
        if tenants:
            assert done[0] == "b after 3 of a's slices"  # (the one a's was making when b's came)
        else:
            assert [d[0] for d in done] == ["a", "a", "a", "b"]

    asyncio.run(run())


def test_a_holder_cancelled_while_it_waits_for_its_turn_back_leaves_the_line() -> None:
    inflate.tenant_of = named
    big = gzip.compress(bytes(8 * MiB))

    async def run() -> None:
        done: list[str] = []

        def one(key: str) -> asyncio.Task[None]:
            return asyncio.create_task(inflated(of(key), big, done, key))

        a = one("key-a")
        await asyncio.sleep(0)
        b = one("key-b")
        anonymous = one("none")  # (refused: an unknown key, at once)
        for _ in range(4):  # a passes its turn to b and waits for it back
            await asyncio.sleep(0)
        assert waiting() == 1 and "a" in inflate.INFLATING_NOW.waiting
        a.cancel()  # waiting for its turn back: leaves the line
        await asyncio.gather(a, b, anonymous, return_exceptions=True)
        assert done == ["key-b"] and a.cancelled() and isinstance(anonymous.exception(), inflate.Refused)

    asyncio.run(run())


class _Request:
    """What the HTTP front door's budget reads of a request."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = 0


def test_the_http_budget_holds_a_tenants_body_bytes_to_its_share() -> None:
    """meshserve/server/http1/request.py:ReceiveBudget: with tenants a body's bytes, on the wire
    and decoded, count against its tenant's share of --max-receive-bytes as well as the whole,
    given back with the request's; a refund gives back to the tenant too."""
    budget = ReceiveBudget()
    budget.limit = 8 * MiB
    r1, r2, r3 = _Request(), _Request(), _Request()
    a, b = ("a", 0.25), ("b", 0.25)  # 2 MiB each
    for _ in range(2):
        budget.charge(r1, MiB, a)  # type: ignore[arg-type]
    with pytest.raises(InferError) as info:
        budget.charge(r2, MiB, a)  # type: ignore[arg-type]
    assert info.value.http_status == 429 and info.value.retry_after_s
    assert "tenant 'a' holds 2097152 bytes of request bodies" in info.value.message
    assert "share (0.25 of --max-receive-bytes 8388608: 2097152)" in info.value.message
    assert budget.used == 2 * MiB and r2.held == 0  # (refused: nothing charged)
    budget.charge(r3, MiB, b)  # type: ignore[arg-type]  # (another tenant: its own share)
    budget.charge(r2, 3 * MiB)  # type: ignore[arg-type]  # (no tenant named: the whole only)
    budget.refund(r1, MiB // 2)  # type: ignore[arg-type]
    assert budget.tenants.held == {"a": MiB + MiB // 2, "b": MiB} and budget.used == 5 * MiB + MiB // 2
    budget.release(r1)  # type: ignore[arg-type]
    assert budget.tenants.held == {"b": MiB} and budget.used == 4 * MiB
    budget.release(r2)  # type: ignore[arg-type]
    budget.release(r3)  # type: ignore[arg-type]
    assert budget.used == 0 and not budget.tenants.held and not budget.held_by
