"""Errors the scheduler raises from ``enqueue`` or sets on a request's future.

They are plain exceptions so that scheduling stays free of grpc; the service maps them to
protocol codes: QueueFullError → RESOURCE_EXHAUSTED, DeadlineExceededError →
DEADLINE_EXCEEDED, UnavailableError → UNAVAILABLE, InternalBatchError → INTERNAL.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable


class SchedulingError(Exception):
    """Base class of every error the scheduler produces."""


class QueueFullError(SchedulingError):
    """The model's queue already holds ``max_queue_size`` requests."""

    def __init__(self, model: str, max_queue_size: int) -> None:
        super().__init__(model, max_queue_size)
        self.model = model
        self.max_queue_size = max_queue_size

    def __str__(self) -> str:
        return (f"model '{self.model}': exceeds maximum queue size "
                f"({self.max_queue_size} requests already queued); retry later")


class DeadlineExceededError(SchedulingError):
    """The request's deadline passed while it waited in the queue."""


class UnavailableError(SchedulingError):
    """The scheduler is stopping, stopped, or its loop failed; the request never ran."""


class InternalBatchError(SchedulingError):
    """The batch the request belonged to failed, or finished without resolving the request."""


def fail_unresolved(futures: Iterable[asyncio.Future[object]], model: str, exc: BaseException) -> None:
    """An ``execute`` that raised fails only its own members: every one not yet resolved."""
    for fut in futures:
        if not fut.done():
            err = InternalBatchError(f"model '{model}': batch execution failed: {exc!r}")
            err.__cause__ = exc
            fut.set_exception(err)
