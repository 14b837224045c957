"""The one rule of a request's priority level and its queue policy
(meshserve/priorities.py:priority_level, level_queue_policy), which the services' queues
(services/base/scheduling/policy.py:BatchingPolicy) and the gateway's shares of them
(gateway/auth.py:queue_room, QueueRooms) both follow."""
from __future__ import annotations

from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.priorities import level_queue_policy, priority_level


def test_without_priority_levels_every_request_queues_at_level_1() -> None:
    for priority in (0, 1, 2, 7, 2**63):
        assert priority_level(priority, 0, 0) == 1


def test_no_priority_is_the_default_level() -> None:
    assert priority_level(0, 3, 2) == 2
    assert priority_level(0, 1, 1) == 1


def test_a_priority_inside_the_levels_is_its_own_level() -> None:
    assert [priority_level(p, 3, 2) for p in (1, 2, 3)] == [1, 2, 3]


def test_a_priority_above_the_levels_is_the_default_level() -> None:
    # Triton (core's infer_request.cc, InferenceRequest::SetPriority): p > MaxPriorityLevel()
    # queues at DefaultPriorityLevel(), as 0 does
    assert priority_level(4, 3, 2) == 2
    assert priority_level(99, 2, 1) == 1
    assert priority_level(2**64 - 1, 3, 2) == 2
    assert priority_level(-1, 3, 2) == 2  # (a signed parameter: the service refuses it first)


def test_a_level_keeps_its_own_policy_else_the_default() -> None:
    db = text_format.Parse("""
      priority_levels: 3 default_priority_level: 2
      default_queue_policy { max_queue_size: 4 default_timeout_microseconds: 100 }
      priority_queue_policy { key: 1 value { max_queue_size: 1 allow_timeout_override: true } }
      priority_queue_policy { key: 3 value { max_queue_size: 0 default_timeout_microseconds: 9 timeout_action: DELAY } }
    """, mc.ModelDynamicBatching())

    def policy(level: int) -> mc.ModelQueuePolicy:
        return level_queue_policy(level, db.priority_levels, db.priority_queue_policy, db.default_queue_policy)

    assert (policy(1).max_queue_size, policy(1).allow_timeout_override, policy(1).default_timeout_microseconds) \
        == (1, True, 0)  # the level's entry whole, not merged with the default
    assert policy(2) == db.default_queue_policy  # no entry: the default policy
    assert (policy(3).max_queue_size, policy(3).default_timeout_microseconds, policy(3).timeout_action) \
        == (0, 9, mc.ModelQueuePolicy.DELAY)  # an entry that unbounds its level
    assert 2 not in db.priority_queue_policy  # (looking a level up adds no entry to the config)


def test_without_priority_levels_the_default_policy_whatever_the_entries() -> None:
    db = text_format.Parse("""
      default_queue_policy { max_queue_size: 4 }
      priority_queue_policy { key: 1 value { max_queue_size: 1 allow_timeout_override: true } }
    """, mc.ModelDynamicBatching())
    got = level_queue_policy(1, db.priority_levels, db.priority_queue_policy, db.default_queue_policy)
    assert got == db.default_queue_policy
    # the same with the services' own values (a mapping of any policy type)
    assert level_queue_policy(1, 0, {1: "own"}, "default") == "default"
    assert level_queue_policy(1, 2, {1: "own"}, "default") == "own"
    assert level_queue_policy(2, 2, {1: "own"}, "default") == "default"
