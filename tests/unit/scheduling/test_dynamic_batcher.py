"""DynamicBatcher with a fake execute: grouping, timing from the oldest, slots, and that
every request resolves exactly once. Assertions are on grouping and order, never wall time."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from services.base.scheduling import (
    BatchingPolicy,
    DeadlineExceededError,
    DynamicBatcher,
    InternalBatchError,
    QueuedRequest,
    QueueFullError,
    UnavailableError,
)
from tests.support import eventually_async
from tests.unit.scheduling.support import MS, Executor, FakeClock, past_the_loop_timers, request, settle


def batcher(policy: BatchingPolicy, execute: Executor, instances: int = 1,
            clock: Callable[[], int] | None = None) -> DynamicBatcher:
    return DynamicBatcher(policy, execute, instance_count=instances,
                          clock=clock or FakeClock(), name="resnet")


async def test_batches_group_up_to_max_batch_size_while_the_instance_is_busy() -> None:
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=4), ex)
    reqs = [request(i) for i in range(10)]
    b.enqueue(reqs[0])
    await settle()
    assert ex.batches == [[0]]  # delay 0: the first request runs alone at once
    for r in reqs[1:]:
        b.enqueue(r)
    await settle()
    assert ex.batches == [[0]]  # one instance: the rest accumulate meanwhile
    assert b.inflight() == 10
    ex.open()
    assert await asyncio.gather(*(r.future for r in reqs)) == list(range(10))
    assert ex.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert b.inflight() == 0
    await b.stop()


async def test_concurrent_clients_are_batched_by_rows() -> None:
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=4), ex)

    async def client(i: int, rows: int) -> object:
        r = request(i, rows=rows)
        b.enqueue(r)
        return await r.future

    blocker = request("first")
    b.enqueue(blocker)
    await settle()
    clients = [asyncio.create_task(client(i, rows)) for i, rows in enumerate([2, 1, 3, 1, 4])]
    await settle()
    ex.open()
    assert await asyncio.gather(*clients) == [0, 1, 2, 3, 4]
    # 2+1 fit, 3 would overflow; 3+1 fill a batch; 4 alone.
    assert ex.batches == [["first"], [0, 1], [2, 3], [4]]
    await b.stop()


async def test_delay_is_measured_from_the_oldest_request() -> None:
    clock = FakeClock(0)
    ex = Executor()
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=20 * MS), ex, clock=clock)
    first = request("a", arrival_ns=0)
    b.enqueue(first)
    await settle()
    clock.now = 15 * MS
    second = request("b", arrival_ns=15 * MS)
    b.enqueue(second)
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert ex.batches == []
    # 20 ms after the oldest (only 5 ms after the newest) the batch is due.
    clock.now = 20 * MS
    await asyncio.wait_for(asyncio.gather(first.future, second.future), 1.0)
    assert ex.batches == [["a", "b"]]
    await b.stop()


async def test_delay_counts_time_already_waited_upstream() -> None:
    """A request that waited in a gateway's coalescer (waited_ns) is as old as its arrival
    there: max_queue_delay is timed from the front door, so no second full delay is paid."""
    clock = FakeClock(100 * MS)
    ex = Executor()
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=20 * MS), ex, clock=clock)
    fresh = request("fresh", arrival_ns=100 * MS)
    b.enqueue(fresh)
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert ex.batches == []  # a fresh request waits for its delay
    clock.now = 105 * MS
    waited = request("waited", arrival_ns=105 * MS)
    waited.waited_ns = 19 * MS  # arrived at the gateway at 86 ms: older than "fresh"
    b.enqueue(waited)
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert ex.batches == []  # due at 86 + 20 = 106 ms, not yet
    clock.now = 106 * MS
    await asyncio.wait_for(asyncio.gather(fresh.future, waited.future), 1.0)
    assert ex.batches == [["fresh", "waited"]]
    await b.stop()


async def test_reaching_a_preferred_size_wakes_the_batcher_before_the_delay() -> None:
    ex = Executor()
    b = batcher(BatchingPolicy(max_batch_size=8, preferred_batch_sizes=(4,),
                               max_queue_delay_ns=10_000 * MS), ex)
    reqs = [request(i) for i in range(5)]
    for r in reqs[:3]:
        b.enqueue(r)
    await settle()
    assert ex.batches == []  # 3 rows: not preferred, delay far away
    b.enqueue(reqs[3])
    await asyncio.wait_for(asyncio.gather(*(r.future for r in reqs[:4])), 1.0)
    assert ex.batches == [[0, 1, 2, 3]]
    b.enqueue(reqs[4])
    await b.stop(drain=True)  # draining does not wait for the delay
    assert ex.batches == [[0, 1, 2, 3], [4]]
    assert reqs[4].future.result() == 4


async def test_instance_count_limits_concurrent_batches() -> None:
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(), ex, instances=2)  # batching off: one request per batch
    reqs = [request(i) for i in range(5)]
    for r in reqs:
        b.enqueue(r)
    await settle()
    assert ex.active == 2
    assert ex.batches == [[0], [1]]
    assert b.inflight() == 5
    ex.open()
    assert await asyncio.gather(*(r.future for r in reqs)) == [0, 1, 2, 3, 4]
    assert ex.max_active == 2
    assert ex.batches == [[0], [1], [2], [3], [4]]
    await b.stop()


async def test_cancelled_requests_never_reach_execute() -> None:
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=8), ex)
    a, x, c, d = request("a"), request("x"), request("c"), request("d")
    b.enqueue(a)
    await settle()
    for r in (x, c, d):
        b.enqueue(r)
    c.future.cancel()  # the client went away
    ex.open()
    await asyncio.gather(a.future, x.future, d.future)
    assert ex.batches == [["a"], ["x", "d"]]
    assert c.future.cancelled()
    await b.stop()


async def test_expired_requests_fail_with_deadline_exceeded_and_never_run() -> None:
    clock = FakeClock(0)
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=8), ex, clock=clock)
    a = request("a")
    late = request("late", deadline_ns=10 * MS)
    ok = request("ok", deadline_ns=1000 * MS)
    b.enqueue(a)
    await settle()
    b.enqueue(late)
    b.enqueue(ok)
    clock.now = 20 * MS
    ex.open()
    with pytest.raises(DeadlineExceededError, match="resnet"):
        await late.future
    assert await ok.future == "ok"
    assert ex.batches == [["a"], ["ok"]]
    await b.stop()


async def test_deadline_fails_promptly_while_waiting_for_the_delay() -> None:
    clock = FakeClock(0)
    ex = Executor()
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=10_000 * MS), ex, clock=clock)
    r = request("r", deadline_ns=5 * MS)
    b.enqueue(r)
    await settle()
    clock.now = 6 * MS
    # The loop sleeps until the earlier of the delay and the nearest deadline (5 ms real).
    with pytest.raises(DeadlineExceededError):
        await asyncio.wait_for(r.future, 1.0)
    assert ex.batches == []
    await b.stop()


async def test_failing_batch_fails_only_its_members_and_the_batcher_keeps_serving() -> None:
    ex = Executor(fail_on="bad")
    b = batcher(BatchingPolicy(max_batch_size=2), ex)
    ok1, bad, other, ok2 = request("ok1"), request("bad"), request("other"), request("ok2")
    b.enqueue(ok1)
    await settle()
    b.enqueue(bad)
    b.enqueue(other)
    b.enqueue(ok2)
    results = await asyncio.gather(ok1.future, bad.future, other.future, ok2.future,
                                   return_exceptions=True)
    assert ex.batches == [["ok1"], ["bad", "other"], ["ok2"]]
    assert results[0] == "ok1" and results[3] == "ok2"
    for err in results[1:3]:
        assert isinstance(err, InternalBatchError)
        assert isinstance(err.__cause__, RuntimeError)
    later = request("later")
    b.enqueue(later)
    assert await later.future == "later"
    await b.stop()


async def test_execute_that_forgets_a_future_fails_it_with_internal_batch_error() -> None:
    ex = Executor(forget="lost")
    b = batcher(BatchingPolicy(max_batch_size=4), ex)
    kept, lost = request("kept"), request("lost")
    b.enqueue(kept)
    b.enqueue(lost)
    assert await kept.future == "kept"
    with pytest.raises(InternalBatchError, match="without a result"):
        await lost.future
    await b.stop()


async def test_queue_full_raises_and_names_model_and_limit() -> None:
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=4, max_queue_size=2), ex)
    running = request("running")
    b.enqueue(running)
    await settle()  # dispatched: it no longer counts as queued
    b.enqueue(request(1))
    b.enqueue(request(2))
    with pytest.raises(QueueFullError, match=r"model 'resnet'.*maximum queue size \(2"):
        b.enqueue(request(3))
    ex.open()
    await b.stop()


async def test_stop_with_drain_runs_queued_requests_then_refuses_new_ones() -> None:
    ex = Executor()
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=10_000 * MS), ex)
    reqs = [request(i) for i in range(3)]
    for r in reqs:
        b.enqueue(r)
    await b.stop(drain=True)
    assert [r.future.result() for r in reqs] == [0, 1, 2]
    assert ex.batches == [[0, 1, 2]]
    with pytest.raises(UnavailableError, match="resnet"):
        b.enqueue(request("late"))


async def test_stop_without_drain_fails_queued_and_waits_for_executing() -> None:
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=8), ex)
    running, q1, q2 = request("running"), request("q1"), request("q2")
    b.enqueue(running)
    await settle()
    b.enqueue(q1)
    b.enqueue(q2)
    stopping = asyncio.create_task(b.stop(drain=False))
    await settle()
    for r in (q1, q2):
        with pytest.raises(UnavailableError):
            r.future.result()
    assert not stopping.done()  # the executing batch is still running
    ex.open()
    await asyncio.wait_for(stopping, 1.0)
    assert running.future.result() == "running"
    assert ex.batches == [["running"]]
    assert b.inflight() == 0


async def test_stop_before_any_request_returns_at_once() -> None:
    b = batcher(BatchingPolicy(max_batch_size=8), Executor())
    await b.stop()
    with pytest.raises(UnavailableError):
        b.enqueue(request("late"))


async def test_crashed_loop_fails_the_queue_and_later_enqueues() -> None:
    class BrokenClock:
        broken = False

        def __call__(self) -> int:
            if self.broken:
                raise RuntimeError("clock broke")
            return 0

    clock = BrokenClock()
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=8), ex, clock=clock)
    running, queued = request("running"), request("queued")
    b.enqueue(running)
    await settle()
    b.enqueue(queued)
    clock.broken = True
    ex.open()  # the batch finishes, the loop wakes, reads the clock and crashes
    with pytest.raises(UnavailableError, match="scheduler failed"):
        await asyncio.wait_for(queued.future, 1.0)
    assert await running.future == "running"
    with pytest.raises(UnavailableError, match="scheduler failed"):
        b.enqueue(request("late"))
    await b.stop()


async def test_request_needs_at_least_one_row() -> None:
    b = batcher(BatchingPolicy(max_batch_size=8), Executor())
    with pytest.raises(ValueError):
        b.enqueue(request("empty", rows=0))
    await b.stop()


def test_instance_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="instance_count"):
        DynamicBatcher(BatchingPolicy(), Executor(), instance_count=0)


async def test_release_lets_the_next_batch_start_before_results_are_delivered() -> None:
    """An executor that calls release() when its compute is done frees the instance slot: with
    one instance, the next batch starts while the first is still delivering its results."""
    delivered = asyncio.Event()
    started: list[list[object]] = []
    b: DynamicBatcher

    async def execute(batch: list[QueuedRequest]) -> None:
        started.append([r.payload for r in batch])
        b.release(batch)
        b.release(batch)  # idempotent
        if len(started) == 1:
            await delivered.wait()  # the first batch is slow to deliver
        for r in batch:
            r.future.set_result(r.payload)

    b = DynamicBatcher(BatchingPolicy(max_batch_size=1), execute, instance_count=1, clock=FakeClock(), name="m")
    first, second = request("a"), request("b")
    b.enqueue(first)
    b.enqueue(second)
    await eventually_async(lambda: len(started) == 2, 1.0)  # "b" started though "a" has not finished
    assert not first.future.done()
    delivered.set()
    assert await asyncio.wait_for(asyncio.gather(first.future, second.future), 1.0) == ["a", "b"]
    await b.stop()


async def test_one_client_at_a_time_pays_the_delay_once() -> None:
    """c1: the first request waits for company (Triton's delay); once a batch of one request ran with
    nothing arriving meanwhile, the next lone request runs at once. A request that arrives while
    one runs ends that: it waits for its delay as Triton's does."""
    clock = FakeClock(0)
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=20 * MS), ex, clock=clock)
    first = request("first", arrival_ns=0)
    b.enqueue(first)
    await settle()
    assert ex.batches == []  # no batch ran yet: wait for the delay
    clock.now = 20 * MS
    await eventually_async(lambda: ex.batches == [["first"]])
    ex.open()
    await first.future
    await settle()
    second = request("second", arrival_ns=30 * MS)
    clock.now = 30 * MS  # the clock stands still from here: only "alone" can run it
    ex.gate.clear()
    b.enqueue(second)
    await eventually_async(lambda: ex.batches == [["first"], ["second"]])
    third = request("third", arrival_ns=30 * MS)
    b.enqueue(third)  # arrives while "second" runs
    ex.open()
    await second.future
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert ex.batches == [["first"], ["second"]]  # company came: third waits for its delay
    clock.now = 50 * MS
    await asyncio.wait_for(third.future, 1.0)
    assert ex.batches == [["first"], ["second"], ["third"]]
    await b.stop()


async def test_a_merged_request_alone_in_its_batch_is_not_one_client() -> None:
    """A gateway's merged request carries several client requests: a batch of it alone says
    nothing about one client at a time, so the next lone request still waits for its delay."""
    clock = FakeClock(0)
    ex = Executor()
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=20 * MS), ex, clock=clock)
    merged = request("merged", rows=3, arrival_ns=0)
    merged.members = 3
    b.enqueue(merged)
    clock.now = 20 * MS
    await asyncio.wait_for(merged.future, 1.0)
    later = request("later", arrival_ns=30 * MS)
    clock.now = 30 * MS
    b.enqueue(later)
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert ex.batches == [["merged"]]
    clock.now = 50 * MS
    await asyncio.wait_for(later.future, 1.0)
    await b.stop()


async def test_a_lone_request_that_found_the_model_busy_is_not_one_client() -> None:
    """Only a request that found nothing queued or executing, ran alone and met nobody turns the
    rule on: one that queued behind a running batch (a gateway spreading a wave of clients) does
    not, so the next lone request still waits for its delay."""
    clock = FakeClock(0)
    ex = Executor(gated=True)
    b = batcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=20 * MS), ex, clock=clock)
    first = request("first", arrival_ns=0)
    b.enqueue(first)
    clock.now = 20 * MS
    await eventually_async(lambda: ex.batches == [["first"]])
    behind = request("behind", arrival_ns=20 * MS)
    b.enqueue(behind)  # queued while "first" runs
    clock.now = 40 * MS
    ex.open()
    await asyncio.wait_for(asyncio.gather(first.future, behind.future), 1.0)
    assert ex.batches == [["first"], ["behind"]]  # "behind" ran alone and nothing came meanwhile
    later = request("later", arrival_ns=50 * MS)
    clock.now = 50 * MS
    b.enqueue(later)
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert ex.batches == [["first"], ["behind"]]  # waits for its delay
    clock.now = 70 * MS
    await asyncio.wait_for(later.future, 1.0)
    await b.stop()
