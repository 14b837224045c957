"""The unit the schedulers queue (an opaque payload, its row count and its result future) and
the interface both schedulers (dynamic and sequence batching) offer a model version."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class SequenceControl:
    """The sequence parameters of one request: correlation id and START / END flags."""

    corrid: int | str
    start: bool = False
    end: bool = False


@dataclass(slots=True, eq=False)
class QueuedRequest(Generic[P]):
    """One inference request waiting for (or running in) a batch.

    ``rows`` is the batch dimension the request contributes (≥ 1); ``arrival_ns`` and
    ``deadline_ns`` use the scheduler's clock (``time.monotonic_ns`` by default).
    ``payload`` is opaque to the scheduler. ``future`` carries the result: the executor
    sets it, or the scheduler fails it (deadline, shutdown, failed batch). Cancelling the
    future (the client went away) removes the request before it joins a batch.
    """

    rows: int
    arrival_ns: int
    payload: P
    future: asyncio.Future[object]
    priority: int = 0  # queue level, 1 = highest (0/1 when the model has no priorities)
    deadline_ns: int | None = None  # fail with DeadlineExceededError once passed (REJECT)
    delay_at_ns: int | None = None  # once passed, move behind all other requests (DELAY)
    delayed: bool = False
    # time already spent queued before this scheduler saw it (a gateway's coalescer): the
    # batcher's max_queue_delay is timed from the request's arrival at the front door
    waited_ns: int = 0
    sequence: SequenceControl | None = None  # the request's sequence (sequence batching only)
    members: int = 1  # client requests it carries (a gateway's coalescer merges several into one)
    # queued again by its model while its batch ran (an iterative sequence's request rescheduled,
    # services/python/model.py): the batch's end leaves its future alone
    requeued: bool = False

    def done(self) -> bool:
        """True once the result, an error, or a cancellation is set."""
        return self.future.done()


class Scheduler(Protocol[P]):
    """What a model version asks of its scheduler (DynamicBatcher, SequenceBatcher)."""

    def enqueue(self, req: QueuedRequest[P]) -> None:
        """Queue ``req``; its future resolves exactly once. Raises a SchedulingError
        (QueueFullError, UnavailableError, SequenceStartError) when it cannot be queued."""
        ...

    def inflight(self) -> int:
        """Requests queued or executing."""
        ...

    async def stop(self, drain: bool = True) -> None:
        """Refuse new requests; run (``drain``) or fail the queued ones; return once no batch runs."""
        ...
