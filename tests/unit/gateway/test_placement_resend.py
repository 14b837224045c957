"""Placement.resend (docs/model-mesh.md, "Lazy loading", item 5) on a recorded placement whose
send evicts the model by hand: a send answered "unknown model" (the replica dropped the model after
the gateway's table was read: the request never ran) is placed again (``ensure(stale=True)``) and
sent again, at most PLACE_ATTEMPTS sends in all. Evicted before every send: UNAVAILABLE with
Retry-After ("evicted again before its request ran"), never another error; evicted fewer times
than the attempts: answered; any other error: answered at once, not placed nor sent again.

What reaches resend in a running mesh: an eviction after the service's --eviction-grace (a request
that arrived later than that after its load), an explicit unload, or the replicas serving the
model leaving the pool (``Placement.lost``, not exercised here). The thrash that first showed this
answer (the mesh bench's smoke at 4 MiB budgets: loads evicting each other's models before their
requests arrived) is now refused at the service instead, by the grace of a fresh version
(tests/integration/test_mesh_fresh_loads.py)."""
from __future__ import annotations

import pytest

from gateway.placement import EVICTED, PLACE_ATTEMPTS, Policy
from meshserve.protocol.errors import Code, InferError
from tests.unit.gateway.test_ensemble_placement import RecordedPlacement


def _evicting(placement: RecordedPlacement, times: int, sends: list[int]):  # type: ignore[no-untyped-def]
    """A send whose replica evicted the model ``times`` times before the request reached it."""
    async def send() -> str:
        sends.append(1)
        if len(sends) <= times:
            placement.served.discard("m")  # another model's load took its room
            raise InferError(Code.NOT_FOUND, f"{EVICTED} 'm'")
        return "answer"
    return send


async def test_evicted_before_every_send_ends_unavailable_with_retry_after() -> None:
    placement = RecordedPlacement(Policy(lazy_all=True))
    sends: list[int] = []
    with pytest.raises(InferError) as err:
        await placement.resend("m", "", lambda: 5.0, _evicting(placement, PLACE_ATTEMPTS, sends))
    assert err.value.code is Code.UNAVAILABLE and "evicted again before its request ran" in err.value.message
    assert err.value.retry_after_s == placement.policy.retry_after_s
    assert len(sends) == PLACE_ATTEMPTS  # bounded: no load loop
    assert placement.ensured == [("m", True)] * (PLACE_ATTEMPTS - 1)  # placed again before each resend


async def test_evicted_fewer_times_than_the_attempts_is_answered() -> None:
    placement = RecordedPlacement(Policy(lazy_all=True))
    sends: list[int] = []
    assert await placement.resend("m", "", lambda: 5.0, _evicting(placement, PLACE_ATTEMPTS - 1, sends)) == "answer"
    assert len(sends) == PLACE_ATTEMPTS


async def test_another_error_is_not_sent_again() -> None:
    placement = RecordedPlacement(Policy(lazy_all=True))
    calls: list[int] = []

    async def send() -> str:
        calls.append(1)
        raise InferError(Code.INVALID_ARG, "unexpected shape")

    with pytest.raises(InferError) as err:
        await placement.resend("m", "", lambda: 5.0, send)
    assert err.value.code is Code.INVALID_ARG and calls == [1] and placement.ensured == []
