"""Request scheduling for a service: queues, batching decisions and instance slots.

Imports neither grpc nor the server nor the runtime; requests are opaque payloads whose
results travel through their futures.
"""
from .dynamic import IDLE, Action, DynamicBatcher, Idle, Run, Wait, next_action
from .errors import (
    DeadlineExceededError,
    InternalBatchError,
    QueueFullError,
    SchedulingError,
    UnavailableError,
)
from .policy import BatchingPolicy
from .request import QueuedRequest, Scheduler, SequenceControl

__all__ = [
    "IDLE",
    "Action",
    "BatchingPolicy",
    "DeadlineExceededError",
    "DynamicBatcher",
    "Idle",
    "InternalBatchError",
    "QueueFullError",
    "QueuedRequest",
    "Run",
    "Scheduler",
    "SchedulingError",
    "SequenceControl",
    "UnavailableError",
    "Wait",
    "next_action",
]
