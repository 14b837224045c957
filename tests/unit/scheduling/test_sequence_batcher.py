"""SequenceBatcher and its pure decisions, with a fake clock and a fake executor.

Assertions are on batch composition, order and state handling, never wall time."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from services.base.scheduling import IDLE, QueuedRequest, Run, UnavailableError, Wait
from services.base.scheduling.sequence import (
    SequenceBatch,
    SequenceBatcher,
    SequenceControl,
    SequencePolicy,
    SequenceStartError,
    direct_action,
    idle_expired,
    oldest_action,
)
from tests.unit.scheduling.support import MS, FakeClock, settle


class Executor:
    """Records batches as [(corrid, payload, start, end) or None for filler]; the state of a
    sequence counts the requests it has executed (reset on START)."""

    def __init__(self, gated: bool = False) -> None:
        self.batches: list[list[tuple[object, object, bool, bool] | None]] = []
        self.instances: list[int] = []
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()

    async def __call__(self, batch: SequenceBatch) -> None:
        rows: list[tuple[object, object, bool, bool] | None] = []
        for r in batch.rows:
            if r.request is None:
                rows.append(None)
                continue
            assert r.control is not None
            rows.append((r.control.corrid, r.request.payload, r.control.start, r.control.end))
        self.batches.append(rows)
        self.instances.append(batch.instance)
        await self.gate.wait()
        for r in batch.rows:
            if r.request is None or r.sequence is None:
                continue
            assert r.control is not None
            prev = 0 if r.control.start else int(r.sequence.state or 0)  # type: ignore[call-overload]
            r.sequence.state = prev + 1
            r.request.future.set_result((r.request.payload, r.sequence.state))


def request(payload: object, arrival_ns: int = 0) -> QueuedRequest:
    fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    return QueuedRequest(rows=1, arrival_ns=arrival_ns, payload=payload, future=fut)


def make(policy: SequencePolicy, ex: Executor, clock: Callable[[], int] | None = None) -> SequenceBatcher:
    return SequenceBatcher(policy, ex, clock=clock or FakeClock(), name="acc")


# ---- pure decisions ----------------------------------------------------------------------

def test_oldest_action_times_like_the_dynamic_batcher() -> None:
    p = SequencePolicy("oldest", slots_per_instance=4, max_queue_delay_ns=10 * MS, preferred_batch_sizes=(2,))
    assert oldest_action([], 0, p) is IDLE
    assert oldest_action([0], 1 * MS, p) == Wait(10 * MS)
    assert oldest_action([0, 1], 1 * MS, p) == Run(2)  # preferred size reached
    assert oldest_action([0], 10 * MS, p) == Run(1)  # delay expired from the oldest head
    assert oldest_action([0, 0, 0, 0, 0], 0, p) == Run(2)
    no_delay = SequencePolicy("oldest", slots_per_instance=4)
    assert oldest_action([0, 0, 0, 0, 0, 0], 0, no_delay) == Run(4)
    unbatched = SequencePolicy("oldest", slots_per_instance=1)
    assert oldest_action([0, 0], 0, unbatched) == Run(1)


def test_direct_action_runs_through_the_highest_ready_slot() -> None:
    p = SequencePolicy("direct", slots_per_instance=4)
    assert direct_action([None, None, None, None], 0, 0, p) is IDLE
    assert direct_action([None, 5, None, None], 2, 5, p) == Run(2)  # slot 0 becomes filler
    delayed = SequencePolicy("direct", slots_per_instance=4, max_queue_delay_ns=10 * MS)
    assert direct_action([0, None, None, None], 2, 1 * MS, delayed) == Wait(10 * MS)
    assert direct_action([0, 2 * MS, None, None], 2, 3 * MS, delayed) == Run(2)  # every active slot ready
    assert direct_action([0, None, None, None], 2, 10 * MS, delayed) == Run(1)
    util = SequencePolicy("direct", slots_per_instance=4, max_queue_delay_ns=10 * MS, minimum_slot_utilization=0.5)
    assert direct_action([0, None, 0, None], 4, 0, util) == Run(3)
    assert direct_action([0, None, None, None], 4, 0, util) == Wait(10 * MS)


def test_idle_expired() -> None:
    assert idle_expired({"a": 0, "b": 5 * MS}, 10 * MS, 10 * MS) == (["a"], 15 * MS)
    assert idle_expired({}, 0, 1) == ([], None)


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        SequencePolicy("newest")
    assert SequencePolicy("direct", slots_per_instance=4, instance_count=2).capacity == 8
    assert SequencePolicy("oldest", max_candidate_sequences=3).capacity == 3


# ---- batcher -----------------------------------------------------------------------------

async def test_requests_of_one_sequence_run_in_order_one_per_batch() -> None:
    ex = Executor(gated=True)
    b = make(SequencePolicy("oldest", slots_per_instance=4), ex)
    reqs = []
    for i in range(3):
        for sid in (1, 2):
            r = request(f"{sid}.{i}")
            b.enqueue(r, SequenceControl(sid, start=i == 0, end=i == 2))
            reqs.append(r)
    await settle()
    assert ex.batches == [[(1, "1.0", True, False)]]  # the first request runs at once
    ex.gate.set()
    results = await asyncio.gather(*(r.future for r in reqs))
    assert [r[1] for r in results] == [1, 1, 2, 2, 3, 3]  # per-sequence state, in order
    flat = [row for batch in ex.batches for row in batch if row is not None]
    for sid in (1, 2):
        assert [p for c, p, _, _ in flat if c == sid] == [f"{sid}.0", f"{sid}.1", f"{sid}.2"]
    for batch in ex.batches:
        ids = [row[0] for row in batch if row is not None]
        assert len(ids) == len(set(ids)), "a batch holds at most one request per sequence"
    assert b.inflight() == 0 and b.active_sequences() == 0  # END released both
    await b.stop()


async def test_missing_start_is_refused_and_names_the_sequence() -> None:
    b = make(SequencePolicy(), Executor())
    with pytest.raises(SequenceStartError, match="sequence 9 to model 'acc' must specify the START flag"):
        b.enqueue(request("x"), SequenceControl(9))
    r = request("a")
    b.enqueue(r, SequenceControl("s", start=True, end=True))
    await r.future
    with pytest.raises(SequenceStartError, match="sequence s"):
        b.enqueue(request("b"), SequenceControl("s"))  # ended
    await b.stop()


async def test_string_and_integer_ids_are_different_sequences() -> None:
    ex = Executor()
    b = make(SequencePolicy(), ex)
    r1, r2 = request("int"), request("str")
    b.enqueue(r1, SequenceControl(7, start=True))
    b.enqueue(r2, SequenceControl("7", start=True))
    await asyncio.gather(r1.future, r2.future)
    assert b.active_sequences() == 2
    await b.stop()


async def test_idle_sequences_are_reaped() -> None:
    clock = FakeClock(0)
    b = make(SequencePolicy(idle_ns=100 * MS), Executor(), clock=clock)
    r = request("a")
    b.enqueue(r, SequenceControl(1, start=True))
    await r.future
    clock.now = 50 * MS
    r = request("b")
    b.enqueue(r, SequenceControl(1))  # still alive: activity resets the idle clock
    await r.future
    clock.now = 200 * MS
    other = request("c")
    b.enqueue(other, SequenceControl(2, start=True))  # any decision reaps
    await other.future
    with pytest.raises(SequenceStartError):
        b.enqueue(request("d"), SequenceControl(1))
    await b.stop()


async def test_restart_resets_state_after_queued_requests() -> None:
    ex = Executor(gated=True)
    b = make(SequencePolicy(), ex)
    reqs = [request(i) for i in range(4)]
    b.enqueue(reqs[0], SequenceControl(1, start=True))
    b.enqueue(reqs[1], SequenceControl(1))
    b.enqueue(reqs[2], SequenceControl(1, start=True))  # a new sequence with the same id
    b.enqueue(reqs[3], SequenceControl(1, end=True))
    ex.gate.set()
    assert [s for _, s in await asyncio.gather(*(r.future for r in reqs))] == [1, 2, 1, 2]  # type: ignore[misc]
    await b.stop()


async def test_direct_strategy_pins_slots_fills_idle_slots_and_backlogs() -> None:
    ex = Executor(gated=True)
    b = make(SequencePolicy("direct", slots_per_instance=2, instance_count=1), ex)
    first = request("a0")
    b.enqueue(first, SequenceControl("a", start=True))  # slot 0
    await settle()
    ex.gate.set()
    await first.future
    r_b = request("b0")
    b.enqueue(r_b, SequenceControl("b", start=True))  # slot 1; slot 0 idle -> filler
    await r_b.future
    assert ex.batches[-1] == [None, ("b", "b0", True, False)]
    r_c = request("c0")
    b.enqueue(r_c, SequenceControl("c", start=True))  # no slot free: backlog
    await settle()
    assert not r_c.future.done()
    r_a = request("a1")
    b.enqueue(r_a, SequenceControl("a", end=True))  # a ends, c takes slot 0
    await asyncio.gather(r_a.future, r_c.future)
    assert ex.batches[-1] == [("c", "c0", True, False)]
    await b.stop()


async def test_oldest_candidates_limit_and_instances() -> None:
    ex = Executor(gated=True)
    b = make(SequencePolicy("oldest", slots_per_instance=4, instance_count=2, max_candidate_sequences=2), ex)
    reqs = {sid: request(sid) for sid in (1, 2, 3)}
    for sid, r in reqs.items():
        b.enqueue(r, SequenceControl(sid, start=True, end=True))
    await settle()
    # No delay: each runs at once on its own instance; 3 waits for a candidate place.
    assert ex.batches == [[(1, 1, True, True)], [(2, 2, True, True)]]
    assert ex.instances == [0, 1]
    ex.gate.set()
    await asyncio.gather(*(r.future for r in reqs.values()))
    assert ex.batches[-1] == [(3, 3, True, True)]
    await b.stop()


async def test_stop_refuses_new_requests_and_fails_unscheduled_ones() -> None:
    ex = Executor(gated=True)
    b = make(SequencePolicy("oldest", max_candidate_sequences=1), ex)
    running, backlogged = request("a"), request("b")
    b.enqueue(running, SequenceControl(1, start=True))
    b.enqueue(backlogged, SequenceControl(2, start=True))
    await settle()
    stopping = asyncio.create_task(b.stop())
    await settle()
    with pytest.raises(UnavailableError):
        b.enqueue(request("c"), SequenceControl(3, start=True))
    ex.gate.set()
    await stopping
    assert running.future.result() == ("a", 1)
    with pytest.raises(UnavailableError):
        backlogged.future.result()


async def test_cancelled_start_still_resets_the_state() -> None:
    ex = Executor(gated=True)
    b = make(SequencePolicy(), ex)
    r0 = request(0)
    b.enqueue(r0, SequenceControl(1, start=True))
    await settle()
    r1, r2 = request(1), request(2)
    b.enqueue(r1, SequenceControl(1, start=True))
    b.enqueue(r2, SequenceControl(1))
    r1.future.cancel()
    ex.gate.set()
    assert (await r2.future)[1] == 1  # type: ignore[index]
    await b.stop()


async def test_a_requeued_request_runs_again_and_finish_ends_its_sequence() -> None:
    """An iterative sequence (services/python/model.py): the executor queues its request again
    while the batch runs (``requeued``: the batch's end leaves its future alone) and it runs in
    the next batch; ``finish`` then ends the sequence as END would, freeing its slot for a
    backlogged one."""
    passes: list[str] = []

    async def execute(batch: SequenceBatch) -> None:
        for r in batch.rows:
            if r.request is None:
                continue
            passes.append(r.request.payload)
            if len(passes) == 1:  # the first pass: again, without START
                r.request.requeued = True
                b.enqueue(r.request, SequenceControl(7, start=False))
            else:
                r.request.future.set_result(len(passes))
                b.finish(7 if r.request.payload == "x" else 8)

    b = SequenceBatcher(SequencePolicy("direct", slots_per_instance=1, instance_count=1), execute,
                        clock=FakeClock(), name="iter")
    first, second = request("x"), request("y")
    b.enqueue(first, SequenceControl(7, start=True))
    b.enqueue(second, SequenceControl(8, start=True))  # backlogged: the one slot is 7's
    assert await first.future == 2
    assert await second.future == 3
    assert passes == ["x", "x", "y"]
    assert b.inflight() == 0 and b.active_sequences() == 0
    await b.stop()
