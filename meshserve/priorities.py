"""Triton's priority levels (``dynamic_batching { priority_levels default_priority_level
priority_queue_policy default_queue_policy }``): the one rule of which queue a request waits in
and which ModelQueuePolicy that queue keeps, followed by the services' queues
(``services/base/scheduling/policy.py:BatchingPolicy``) and by the gateway's shares of them
(``gateway/auth.py:queue_room``, ``QueueRooms``). ``levels`` is ``priority_levels`` (0: one queue,
level 1), ``default_level`` its ``default_priority_level``; a policy is whatever the caller keeps
(the config's ModelQueuePolicy, the services' QueuePolicy).

Standard library only: the services' schedulers import nothing else (docs/architecture.md,
"Layers and their import rules"; tests/unit/test_import_rules.py)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

_Policy = TypeVar("_Policy")


def priority_level(priority: int, levels: int, default_level: int) -> int:
    """The queue (priority level, 1 the highest) of a request whose ``priority`` parameter is
    ``priority`` (0: none): the priority itself inside 1..levels, else (0, or above the levels)
    the default level; level 1 without priority levels. Triton's rule (core's infer_request.cc,
    InferenceRequest::SetPriority: ``p == 0 || p > MaxPriorityLevel()`` queues at
    DefaultPriorityLevel()). A negative priority is the caller's to refuse first (Triton's
    frontends answer INVALID_ARG "expected value >= 0": server's grpc infer_handler.cc); here it
    counts at the default level too."""
    if not levels:
        return 1
    return priority if 1 <= priority <= levels else default_level


def default_level(levels: int, configured: int) -> int:
    """The queue (priority level) of a request without a priority: ``configured``
    (``default_priority_level``; unset, 0, is level 1) with priority levels, level 1 without (one
    queue). Within 1..levels is the config's to hold (meshserve/repository/config.py refuses a
    config otherwise, as Triton does, and so does the services' ``BatchingPolicy``): a level past
    them is not moved into range here, so that it is still refused."""
    return (configured or 1) if levels else 1


def level_queue_policy(level: int, levels: int, policies: Mapping[int, _Policy], default: _Policy) -> _Policy:
    """The queue policy of priority ``level``: its own ``priority_queue_policy`` entry
    (``policies``), else ``default_queue_policy`` (``default``); without priority levels the
    default policy whatever the entries say (Triton's PriorityQueue: core's scheduler_utils.cc
    keeps only the default policy's queue when priority_levels is 0)."""
    if not levels:
        return default
    found = policies.get(level)
    return default if found is None else found
