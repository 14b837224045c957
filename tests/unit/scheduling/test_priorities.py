"""Priority levels and queue policies (Triton's schedule-policy semantics) in the batcher."""
from __future__ import annotations

import asyncio

import pytest

from services.base.scheduling import BatchingPolicy, DynamicBatcher, QueuedRequest, QueueFullError
from services.base.scheduling.errors import DeadlineExceededError
from services.base.scheduling.policy import QueuePolicy
from tests.support import eventually_async


def req(loop: asyncio.AbstractEventLoop, name: str, level: int, **kw: object) -> QueuedRequest:
    return QueuedRequest(rows=1, arrival_ns=kw.pop("arrival_ns", 0), payload=name,  # type: ignore[arg-type]
                         future=loop.create_future(), priority=level, **kw)  # type: ignore[arg-type]


async def _run_order(policy: BatchingPolicy, reqs: list[QueuedRequest], loop: asyncio.AbstractEventLoop
                     ) -> list[list[str]]:
    batches: list[list[str]] = []
    gate = asyncio.Event()

    async def execute(batch: list[QueuedRequest]) -> None:
        batches.append([str(q.payload) for q in batch])
        if len(batches) == 1:
            await gate.wait()  # hold the only instance while the rest queue up
        for q in batch:
            q.future.set_result(q.payload)

    b = DynamicBatcher(policy, execute)
    blocker = req(loop, "blocker", policy.levels)
    b.enqueue(blocker)
    await eventually_async(lambda: len(batches) == 1, what="the blocker running")
    for r in reqs:
        b.enqueue(r)
    gate.set()
    await asyncio.gather(*(r.future for r in [blocker, *reqs]), return_exceptions=True)
    await b.stop()
    return batches


async def test_higher_priority_runs_first_and_fills_the_batch_first() -> None:
    loop = asyncio.get_running_loop()
    policy = BatchingPolicy(max_batch_size=2, priority_levels=2, default_priority_level=2)
    reqs = [req(loop, "low1", 2), req(loop, "low2", 2), req(loop, "high1", 1), req(loop, "low3", 2),
            req(loop, "high2", 1)]
    batches = await _run_order(policy, reqs, loop)
    assert batches[1:] == [["high1", "high2"], ["low1", "low2"], ["low3"]]


async def test_level_for_maps_zero_and_above_the_levels_to_the_default_and_rejects_negative() -> None:
    policy = BatchingPolicy(max_batch_size=4, priority_levels=3, default_priority_level=2)
    # (Triton: core's infer_request.cc, InferenceRequest::SetPriority)
    assert [policy.level_for(p) for p in (0, 1, 3, 4, 2**64 - 1)] == [2, 1, 3, 2, 2]
    with pytest.raises(ValueError, match="expected value >= 0, got -1"):
        policy.level_for(-1)
    assert BatchingPolicy(max_batch_size=4).level_for(7) == 1  # no priorities: one queue
    with pytest.raises(ValueError, match="expected value >= 0"):
        BatchingPolicy(max_batch_size=4).level_for(-1)


async def test_max_queue_size_per_level() -> None:
    loop = asyncio.get_running_loop()
    policy = BatchingPolicy(max_batch_size=1, priority_levels=2, default_priority_level=2,
                            priority_queue_policies=((1, QueuePolicy(max_queue_size=1)),))
    gate = asyncio.Event()
    started: list[QueuedRequest] = []

    async def execute(batch: list[QueuedRequest]) -> None:
        started.extend(batch)
        await gate.wait()
        for q in batch:
            q.future.set_result(None)

    b = DynamicBatcher(policy, execute)
    b.enqueue(req(loop, "running", 2))
    await eventually_async(lambda: started, what="'running' running")
    b.enqueue(req(loop, "h1", 1))
    with pytest.raises(QueueFullError):
        b.enqueue(req(loop, "h2", 1))
    for i in range(5):  # level 2 has no limit
        b.enqueue(req(loop, f"l{i}", 2))
    gate.set()
    await b.stop()


async def test_delay_action_moves_timed_out_requests_behind_the_others() -> None:
    loop = asyncio.get_running_loop()
    policy = BatchingPolicy(max_batch_size=1)
    # "late" timed out (delay_at in the past): it runs after "fresh" although it arrived first
    reqs = [req(loop, "late", 1, delay_at_ns=1), req(loop, "fresh", 1)]
    batches = await _run_order(policy, reqs, loop)
    assert batches[1:] == [["fresh"], ["late"]]


async def test_reject_action_fails_timed_out_requests() -> None:
    loop = asyncio.get_running_loop()
    policy = BatchingPolicy(max_batch_size=1)
    reqs = [req(loop, "expired", 1, deadline_ns=1), req(loop, "ok", 1)]
    batches = await _run_order(policy, reqs, loop)
    assert batches[1:] == [["ok"]]
    with pytest.raises(DeadlineExceededError):
        reqs[0].future.result()


def test_policy_from_config_reads_priorities_and_queue_policies() -> None:
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc

    dyn = text_format.Parse("""
      priority_levels: 3 default_priority_level: 2
      default_queue_policy { max_queue_size: 4 default_timeout_microseconds: 100 timeout_action: DELAY }
      priority_queue_policy { key: 1 value { max_queue_size: 1 allow_timeout_override: true } }
    """, mc.ModelDynamicBatching())
    p = BatchingPolicy.from_config(8, dyn)
    assert (p.priority_levels, p.default_priority_level) == (3, 2)
    assert p.queue_policy(2) == QueuePolicy(4, 100_000, True, False)
    assert p.queue_policy(1) == QueuePolicy(1, 0, False, True)


def test_without_priority_levels_a_level_1_entry_is_not_the_queues_policy() -> None:
    """One queue, the default policy's, as Triton's (scheduler_utils.cc) and the gateway's queue
    shares (gateway/auth.py:queue_room) read it: a ``priority_queue_policy`` entry without
    ``priority_levels`` sets neither the queue's size nor its timeouts."""
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc

    dyn = text_format.Parse("""
      default_queue_policy { max_queue_size: 4 default_timeout_microseconds: 100 }
      priority_queue_policy { key: 1 value { max_queue_size: 1 default_timeout_microseconds: 7 allow_timeout_override: true } }
    """, mc.ModelDynamicBatching())
    p = BatchingPolicy.from_config(8, dyn)
    assert p.level_for(0) == p.level_for(1) == p.level_for(5) == 1
    assert p.queue_policy(1) == QueuePolicy(4, 100_000, False, False) and p.max_queue_size == 4


@pytest.mark.parametrize(("dynamic_batching", "default"), [
    ("max_queue_delay_microseconds: 100 default_queue_policy { max_queue_size: 2 }", 1),  # one queue
    ("priority_levels: 3 default_priority_level: 2 default_queue_policy { max_queue_size: 2 }", 2),
    ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 2 value { max_queue_size: 1 } }", 1),
])
def test_the_services_and_the_gateway_read_one_default_level(dynamic_batching: str, default: int) -> None:
    """meshserve/priorities.py:default_level is the one rule: the services' queues
    (BatchingPolicy.from_config) and the gateway's shares of them (gateway/auth.py:queue_room)
    put a request without a priority at the same level."""
    from google.protobuf import text_format

    from gateway.auth import queue_room
    from meshserve._proto import model_config_pb2 as mc

    config = text_format.Parse(f"max_batch_size: 4 dynamic_batching {{ {dynamic_batching} }}", mc.ModelConfig())
    rooms = queue_room(config, replicas=1)
    assert rooms is not None
    policy = BatchingPolicy.from_config(4, config.dynamic_batching)
    assert rooms.default == policy.default_priority_level == policy.level_for(0) == default
    assert rooms.level_of(0) == default


def test_the_default_level_is_level_1_without_levels_and_never_moved_into_range() -> None:
    """An out-of-range default_priority_level is refused, not clamped: the config's check
    (meshserve/repository/config.py) refuses it first, and the services' BatchingPolicy again."""
    from meshserve._proto import model_config_pb2 as mc
    from meshserve.priorities import default_level

    assert [default_level(0, 5), default_level(0, 0), default_level(3, 0), default_level(3, 2), default_level(3, 9)
            ] == [1, 1, 1, 2, 9]
    bad = mc.ModelDynamicBatching(priority_levels=3, default_priority_level=9)
    with pytest.raises(ValueError, match="default_priority_level 9 must be between 1 and priority_levels 3"):
        BatchingPolicy.from_config(4, bad)
