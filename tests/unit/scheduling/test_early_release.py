"""Early release in the DynamicBatcher: a batch whose expected clients (K, learned by a probe: a
batch released by its full delay) are all queued runs before max_queue_delay. The fake clock
stands still unless the test moves it, so a batch that runs without it moving was released early;
assertions are on grouping, never wall time."""
from __future__ import annotations

import asyncio

from services.base.scheduling import BatchingPolicy, DynamicBatcher, QueuedRequest
from tests.support import eventually_async
from tests.unit.scheduling.support import MS, Executor, FakeClock, past_the_loop_timers, request, settle

DELAY = 20 * MS


def batcher(ex: Executor, clock: FakeClock, early: bool = True) -> DynamicBatcher:
    return DynamicBatcher(BatchingPolicy(max_batch_size=8, max_queue_delay_ns=DELAY), ex, clock=clock,
                          name="m", early_release=early)


def send(b: DynamicBatcher, clock: FakeClock, at: int, *names: str, members: int = 1) -> list[QueuedRequest]:
    clock.now = at
    reqs = [request(n, arrival_ns=at) for n in names]
    for r in reqs:
        r.members = members
        b.enqueue(r)
    return reqs


async def still_waiting(ex: Executor, batches: int) -> None:
    await settle()
    await past_the_loop_timers()  # the batcher's real timers fire; the fake clock says not yet
    assert len(ex.batches) == batches


async def full_wait(b: DynamicBatcher, ex: Executor, clock: FakeClock, at: int, *names: str) -> None:
    """``names`` arrive at ``at``, wait, and run together once the delay expires (a probe)."""
    reqs = send(b, clock, at, *names)
    await still_waiting(ex, len(ex.batches))
    clock.now = at + DELAY
    await asyncio.wait_for(asyncio.gather(*(r.future for r in reqs)), 1.0)
    assert ex.batches[-1] == list(names)


async def test_a_closed_loop_round_runs_as_soon_as_its_clients_are_back() -> None:
    clock, ex = FakeClock(), Executor()
    b = batcher(ex, clock)
    await full_wait(b, ex, clock, 0, "a", "b", "c")  # the first batch waits, as in Triton: K = 3
    assert b.early_releases == 0
    send(b, clock, 30 * MS, "a1", "b1")
    await still_waiting(ex, 1)  # 2 of 3: wait
    send(b, clock, 30 * MS, "c1")
    await eventually_async(lambda: ex.batches[-1] == ["a1", "b1", "c1"])  # the clock never moved
    assert b.early_releases == 1
    # a gateway's merged request counts its client requests: 2 + 1 members are the 3 clients
    merged = send(b, clock, 40 * MS, "ab2", members=2)
    await still_waiting(ex, 2)
    single = send(b, clock, 40 * MS, "c2")
    await asyncio.wait_for(asyncio.gather(merged[0].future, single[0].future), 1.0)
    assert ex.batches == [["a", "b", "c"], ["a1", "b1", "c1"], ["ab2", "c2"]]
    assert b.early_releases == 2
    await b.stop()


async def test_switched_off_every_batch_waits_its_delay() -> None:
    clock, ex = FakeClock(), Executor()
    b = batcher(ex, clock, early=False)
    await full_wait(b, ex, clock, 0, "a", "b", "c")
    await full_wait(b, ex, clock, 30 * MS, "a1", "b1", "c1")  # all three back: still waits
    assert b.early_releases == 0
    await b.stop()


async def test_fewer_clients_than_expected_relearn_k_after_two_misses() -> None:
    """Two batches in a row that expired while K was in force (fewer came) make the next batch a
    probe: the smaller K is learned from a full wait, not from the expiries themselves (which
    only happen below K: learning from them would ratchet K down under random arrivals)."""
    clock, ex = FakeClock(), Executor()
    b = batcher(ex, clock)
    await full_wait(b, ex, clock, 0, "a", "b", "c")  # K = 3
    await full_wait(b, ex, clock, 30 * MS, "a1", "b1")  # a client left: 2 < 3 wait the delay
    await full_wait(b, ex, clock, 60 * MS, "a2", "b2")  # again: the next batch probes
    await full_wait(b, ex, clock, 90 * MS, "a3", "b3")  # the probe: waits, K = 2
    send(b, clock, 120 * MS, "a4", "b4")
    await eventually_async(lambda: ex.batches[-1] == ["a4", "b4"])
    assert b.early_releases == 1
    await b.stop()


async def test_one_late_client_is_forgiven() -> None:
    """A round that expired because one client was late keeps K: the late request joins the next
    round, which runs as soon as all K are queued (no extra full wait)."""
    clock, ex = FakeClock(), Executor()
    b = batcher(ex, clock)
    await full_wait(b, ex, clock, 0, "a", "b", "c")  # K = 3
    await full_wait(b, ex, clock, 30 * MS, "a1", "b1")  # c1 is late: the delay expires
    send(b, clock, 55 * MS, "c1")
    await still_waiting(ex, 2)
    send(b, clock, 55 * MS, "a2", "b2")
    await eventually_async(lambda: ex.batches[-1] == ["c1", "a2", "b2"])
    assert b.early_releases == 1
    await b.stop()


async def test_a_periodic_probe_learns_more_clients() -> None:
    """Early batches hold at least K, so more clients than K show only in a probe: one comes again
    max(100 ms, 20 delays) after the last (here 400 ms)."""
    clock, ex = FakeClock(), Executor()
    b = batcher(ex, clock)
    await full_wait(b, ex, clock, 0, "a", "b")  # K = 2, learned at 20 ms: the next probe at 420 ms
    send(b, clock, 400 * MS, "a1", "b1")
    await eventually_async(lambda: ex.batches[-1] == ["a1", "b1"])  # early: before the probe is due
    await full_wait(b, ex, clock, 430 * MS, "a2", "b2", "c2")  # due: waits the delay, K = 3
    send(b, clock, 460 * MS, "a3", "b3")
    await still_waiting(ex, 3)  # 2 is not the company any more
    send(b, clock, 460 * MS, "c3")
    await eventually_async(lambda: ex.batches[-1] == ["a3", "b3", "c3"])
    assert b.early_releases == 2
    await b.stop()


async def test_one_client_learns_nothing_and_a_second_is_learned_next() -> None:
    """K below 2 releases nothing (one client at a time is the ``alone`` rule's), so every batch
    stays a probe until a full wait gathers two."""
    clock, ex = FakeClock(), Executor()
    b = batcher(ex, clock)
    await full_wait(b, ex, clock, 0, "a")
    ex.gate.clear()  # hold the next batch so that "b" finds "a1" executing: no ``alone``
    a1 = send(b, clock, 30 * MS, "a1")
    clock.now = 50 * MS
    await eventually_async(lambda: ex.batches[-1] == ["a1"])
    reqs = send(b, clock, 50 * MS, "b")
    ex.open()
    await a1[0].future
    await still_waiting(ex, 2)  # "b" waits for its delay (K is 1)
    reqs += send(b, clock, 55 * MS, "c")
    clock.now = 70 * MS
    await asyncio.wait_for(asyncio.gather(*(r.future for r in reqs)), 1.0)
    assert ex.batches[-1] == ["b", "c"]  # that wait was a probe: K = 2
    send(b, clock, 80 * MS, "b1", "c1")
    await eventually_async(lambda: ex.batches[-1] == ["b1", "c1"])
    assert b.early_releases == 1
    await b.stop()


async def test_a_batch_that_expired_behind_a_busy_instance_teaches_nothing() -> None:
    """Compute longer than the delay: the requests that queued meanwhile have expired when the
    instance frees and run at once (as in Triton), but they are only the clients that came during
    the compute, not who comes within a delay at a free instance: no K from them."""
    clock, ex = FakeClock(), Executor(gated=True)
    b = batcher(ex, clock)
    first = send(b, clock, 0, "first")
    clock.now = DELAY
    await eventually_async(lambda: ex.batches == [["first"]])
    behind = send(b, clock, 25 * MS, "a", "b")  # queued while "first" computes
    clock.now = 50 * MS  # their delay passed behind the busy instance
    ex.open()
    await asyncio.wait_for(asyncio.gather(*(r.future for r in [*first, *behind])), 1.0)
    assert ex.batches[-1] == ["a", "b"]
    send(b, clock, 60 * MS, "a1", "b1")
    await still_waiting(ex, 2)  # not released early: K was not learned
    clock.now = 80 * MS
    await eventually_async(lambda: ex.batches[-1] == ["a1", "b1"])  # that wait was the probe: K = 2
    send(b, clock, 90 * MS, "a2", "b2")
    await eventually_async(lambda: ex.batches[-1] == ["a2", "b2"])
    assert b.early_releases == 1
    await b.stop()
