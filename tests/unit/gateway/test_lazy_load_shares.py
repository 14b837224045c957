"""Placement's load shares (docs/model-mesh.md, "Lazy loading"; docs/security.md, "Session 14:
lazy loads by tenant"): with tenants, the loads a tenant's requests started that are in flight
(queued at --max-concurrent-loads or running) are at most max(1, max_loads x its share); a
request that would start one more waits in its tenant's own line within its deadline (no load
starts for it meanwhile; past the deadline DEADLINE_EXCEEDED naming the share), and starts its
load when one of its tenant's ends; a request joining a load in flight never waits for a share;
a load's count is given back when the load ends (loaded, failed), not when a request that waits
for it gives up; without tenants nothing is counted. The loads here are held by hand (``_place``
waits for the test)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.auth import CALLER
from gateway.placement import Placement, Policy
from meshserve.protocol.errors import Code, InferError


class HeldPlacement(Placement):
    """Each load waits until the test ends it (``finish``); nothing is served before."""

    def __init__(self, max_loads: int = 4) -> None:
        super().__init__(SimpleNamespace(discovery=None), Policy(lazy_all=True, max_loads=max_loads))  # type: ignore[arg-type]
        self.ends: dict[str, asyncio.Future[None]] = {}
        self.started: list[str] = []

    def serving(self, name: str, version: str) -> bool:
        return False

    async def _place(self, name: str, started: float) -> None:
        self.started.append(name)
        await self.ends.setdefault(name, asyncio.get_running_loop().create_future())

    def finish(self, name: str, error: InferError | None = None) -> None:
        end = self.ends.setdefault(name, asyncio.get_running_loop().create_future())
        if error is None:
            end.set_result(None)
        else:
            end.set_exception(error)


async def _as(who: tuple[str, float] | None, placement: Placement, name: str,
              timeout: float | None = 10.0) -> asyncio.Task[None]:
    """A request of ``who`` (None: a gateway without tenants) for ``name``, started and run until
    it waits for the load (or is answered)."""
    async def request() -> None:
        CALLER.set(who)
        await placement.ensure(name, timeout)

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return task


MALLORY = ("mallory", 0.5)
ACME = ("acme", 0.5)


async def _turns() -> None:
    """Let every ready task run (a load's end, its done callbacks, the waiters it wakes)."""
    for _ in range(6):
        await asyncio.sleep(0)


async def test_a_tenant_runs_at_most_its_share_of_the_loads_and_another_tenant_still_starts_its_own() -> None:
    placement = HeldPlacement(max_loads=4)
    first = [await _as(MALLORY, placement, f"m{i}") for i in range(2)]
    line = [await _as(MALLORY, placement, f"m{i}") for i in range(2, 5)]
    await _turns()
    assert placement.started == ["m0", "m1"] and dict(placement.loads_held) == {"mallory": 2}
    assert not any(t.done() for t in first + line) and placement.waiting == 5
    assert placement.share_waits == {"mallory": 3}
    # acme's own load starts at once (mallory holds 2 of the 4)
    acme = await _as(ACME, placement, "a0")
    assert placement.started == ["m0", "m1", "a0"] and not acme.done()
    # a request joining a load in flight waits for it, whoever started it and whatever its tenant holds
    joiner = await _as(MALLORY, placement, "a0")
    placement.finish("a0")
    await asyncio.gather(acme, joiner)
    assert dict(placement.loads_held) == {"mallory": 2} and placement.started[-1] == "a0"
    # a load of mallory's that ends lets the first of its line start its own, one for one
    placement.finish("m0")
    await first[0]
    await _turns()
    assert placement.started == ["m0", "m1", "a0", "m2"] and placement.loads_held["mallory"] == 2
    # another tenant starting a model mallory's line waits for: that request joins it at once
    other = await _as(ACME, placement, "m4")
    await _turns()
    assert placement.started[-1] == "m4" and dict(placement.loads_held) == {"mallory": 2, "acme": 1}
    placement.finish("m4")
    await asyncio.gather(other, line[2])
    for name in ("m1", "m2", "m3"):
        placement.finish(name)
        await _turns()
    await asyncio.gather(first[1], *line)
    assert placement.started == ["m0", "m1", "a0", "m2", "m4", "m3"]
    assert not placement.loads_held and not placement._loads and placement.waiting == 0


async def test_a_deadline_in_the_line_starts_no_load_and_a_failed_load_gives_its_count_back() -> None:
    placement = HeldPlacement(max_loads=2)  # share 0.5: one load each
    gone = await _as(MALLORY, placement, "m0", timeout=0.05)
    with pytest.raises(InferError) as err:
        await gone
    assert err.value.code is Code.DEADLINE_EXCEEDED and "still loading" in err.value.message
    # the load goes on without its request, and counts for mallory until it ends
    assert "m0" in placement._loads and placement.loads_held["mallory"] == 1
    with pytest.raises(InferError) as err:
        await (await _as(MALLORY, placement, "m1", timeout=0.05))
    assert err.value.code is Code.DEADLINE_EXCEEDED
    assert err.value.message == ("model 'm1' was not loaded when the request's deadline passed: tenant 'mallory' "
                                 "has 1 lazy model loads in flight, its share (0.5 of --max-concurrent-loads 2: 1)")
    assert placement.started == ["m0"] and "m1" not in placement._loads  # nothing started for it
    cancelled = await _as(MALLORY, placement, "m1")  # waits in the line; its client goes away
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert placement.loads_held["mallory"] == 1 and placement.waiting == 0 and placement.started == ["m0"]
    waiting = await _as(MALLORY, placement, "m1")
    placement.finish("m0", InferError(Code.UNAVAILABLE, "no room"))
    await _turns()
    assert placement.started == ["m0", "m1"] and dict(placement.loads_held) == {"mallory": 1}
    placement.finish("m1")
    await waiting
    assert not placement.loads_held and not placement._loads


async def test_anonymous_callers_share_one_line_and_without_tenants_nothing_is_counted() -> None:
    placement = HeldPlacement(max_loads=4)
    anonymous = ("", 0.25)  # max(1, 4 x 0.25) = 1
    first = await _as(anonymous, placement, "x0")
    with pytest.raises(InferError) as err:
        await (await _as(anonymous, placement, "x1", timeout=0.02))
    assert err.value.code is Code.DEADLINE_EXCEEDED
    assert err.value.message.endswith("anonymous callers have 1 lazy model loads in flight, its share (0.25 of "
                                      "--max-concurrent-loads 4: 1)")
    # no tenants (CALLER unset): every load starts, none counted (the process's gate is _place's)
    free = [await _as(None, placement, f"y{i}") for i in range(6)]
    assert placement.started == ["x0", *[f"y{i}" for i in range(6)]] and dict(placement.loads_held) == {"": 1}
    for name in ["x0", *[f"y{i}" for i in range(6)]]:
        placement.finish(name)
    await asyncio.gather(first, *free)
    assert not placement.loads_held and placement.share_waits == {"(anonymous)": 1}
