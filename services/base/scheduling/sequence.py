"""Sequence batching with Triton's semantics (``src/sequence_batch_scheduler.cc``).

A stateful model sees requests grouped by correlation id. The :class:`SequenceBatcher`

* keeps one record per live sequence (its queue, whether a request is executing, the
  opaque per-sequence ``state`` the executor reads and writes, last activity);
* runs the requests of one sequence strictly in arrival order: at most one request of a
  sequence is queued for or inside a batch at any time, and a batch holds at most one
  request per sequence;
* ``oldest``: batches across the oldest ``max_candidate_sequences`` sequences that have a
  request ready, timed like the dynamic batcher (:func:`oldest_action` reuses
  :func:`~services.base.scheduling.dynamic.next_action`); any free instance runs it;
* ``direct``: each sequence owns one batch slot of one instance for its lifetime; a batch
  for an instance lays its slots out in order and fills slots without a ready request
  (below the highest ready slot) with READY=0 filler rows (:func:`direct_action`);
* sequences beyond the candidates (oldest) or the slots (direct) wait in an ordered backlog
  and are admitted when a sequence ends or is reaped;
* frees a sequence that has had nothing queued or executing for ``idle_ns``
  (``max_sequence_idle_microseconds``): a later request without START is refused.

Decisions are pure functions of the queue and a clock; the class only applies them.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from .dynamic import IDLE, Action, Run, Wait, next_action
from .errors import (
    DeadlineExceededError,
    InternalBatchError,
    SchedulingError,
    UnavailableError,
    fail_unresolved,
)
from .policy import BatchingPolicy
from .request import P, QueuedRequest, SequenceControl

__all__ = [
    "BatchRow",
    "SequenceBatch",
    "SequenceBatcher",
    "SequenceControl",
    "SequencePolicy",
    "SequenceRecord",
    "SequenceStartError",
    "direct_action",
    "idle_expired",
    "oldest_action",
]

_log = logging.getLogger(__name__)
_NEVER = sys.maxsize


class SequenceStartError(SchedulingError):
    """A request of a sequence that is not active (never started, ended or reaped) lacks START."""


@dataclass(frozen=True, slots=True)
class SequencePolicy:
    """Sequence batching settings, taken once from ``sequence_batching`` at load time.

    ``slots_per_instance``: rows one batch may hold (``max_batch_size``, or 1 without
    batching). ``max_candidate_sequences`` (oldest) bounds the sequences batched together;
    0 = as many as there are. ``preferred_batch_sizes`` / ``max_queue_delay_ns`` time
    oldest batches as the dynamic batcher does; for direct, ``max_queue_delay_ns`` and
    ``minimum_slot_utilization`` decide when a partly filled instance batch runs.
    """

    strategy: str = "oldest"  # "oldest" | "direct"
    slots_per_instance: int = 1
    instance_count: int = 1
    max_candidate_sequences: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    minimum_slot_utilization: float = 0.0
    idle_ns: int = 1_000_000_000

    def __post_init__(self) -> None:
        if self.strategy not in ("oldest", "direct"):
            raise ValueError(f"sequence strategy must be 'oldest' or 'direct', got {self.strategy!r}")
        if self.slots_per_instance < 1 or self.instance_count < 1:
            raise ValueError("slots_per_instance and instance_count must be >= 1")
        if self.idle_ns <= 0:
            raise ValueError(f"idle_ns must be > 0, got {self.idle_ns}")

    @property
    def batching(self) -> BatchingPolicy:
        """The dynamic-batching policy oldest batches are timed with."""
        preferred = tuple(s for s in self.preferred_batch_sizes if s <= self.slots_per_instance)
        return BatchingPolicy(max_batch_size=self.slots_per_instance if self.slots_per_instance > 1 else 0,
                              preferred_batch_sizes=preferred if self.slots_per_instance > 1 else (),
                              max_queue_delay_ns=self.max_queue_delay_ns)

    @property
    def capacity(self) -> int:
        """Sequences that can be active at once (the rest wait in the backlog); 0 = unbounded."""
        if self.strategy == "direct":
            return self.slots_per_instance * self.instance_count
        return self.max_candidate_sequences


@dataclass(eq=False)
class SequenceRecord:
    """One live sequence. ``state`` is the executor's (implicit state tensors); opaque here."""

    key: Hashable
    corrid: int | str
    queue: deque[tuple[QueuedRequest, SequenceControl]] = field(default_factory=deque)
    executing: bool = False
    open: bool = True  # no END enqueued since the last START
    admitted: bool = False  # a candidate (oldest) or holds a slot (direct)
    slot: int = -1  # direct: global slot index (instance = slot // slots_per_instance)
    last_ns: int = 0
    state: object = None


@dataclass(slots=True)
class BatchRow:
    """One row of a sequence batch. ``request`` None = a READY=0 filler row (direct)."""

    request: QueuedRequest | None
    sequence: SequenceRecord | None
    control: SequenceControl | None


@dataclass(slots=True)
class SequenceBatch:
    """What the executor runs: rows in slot order on instance ``instance``."""

    instance: int
    rows: list[BatchRow]

    @property
    def requests(self) -> list[QueuedRequest]:
        return [r.request for r in self.rows if r.request is not None]


# ---- pure decisions --------------------------------------------------------------------

def oldest_action(ready_arrivals: Sequence[int], now_ns: int, policy: SequencePolicy) -> Action:
    """Decide on the ready heads of the candidate sequences (arrival times, oldest first).

    Each sequence contributes one row; the timing is the dynamic batcher's (preferred
    sizes, delay from the oldest head)."""
    if not ready_arrivals:
        return IDLE
    return next_action([1] * len(ready_arrivals), ready_arrivals[0], now_ns, policy.batching)


def direct_action(slot_arrivals: Sequence[int | None], occupied: int, now_ns: int,
                  policy: SequencePolicy) -> Action:
    """Decide for one instance: ``slot_arrivals[i]`` is the head arrival of slot i's sequence
    (None: no ready request). Runs now when every occupied slot is ready, when
    ``ready / slots >= minimum_slot_utilization`` (with a positive minimum), when there is no
    delay, or once the delay from the oldest ready head expired; ``Run(count)`` then
    covers slots ``0..count-1`` (idle ones become filler)."""
    ready = [(i, a) for i, a in enumerate(slot_arrivals) if a is not None]
    if not ready:
        return IDLE
    count = ready[-1][0] + 1
    oldest = min(a for _, a in ready)
    delay = policy.max_queue_delay_ns
    util = len(ready) / policy.slots_per_instance
    min_util = policy.minimum_slot_utilization
    if (delay == 0 or len(ready) >= occupied or (min_util > 0 and util >= min_util)
            or now_ns - oldest >= delay):
        return Run(count)
    return Wait(oldest + delay)


def idle_expired(last_activity: dict[Hashable, int], now_ns: int, idle_ns: int) -> tuple[list[Hashable], int | None]:
    """(sequences idle for ``idle_ns`` or longer, when the next one expires or None)."""
    expired = []
    next_ns: int | None = None
    for key, last in last_activity.items():
        due = last + idle_ns
        if due <= now_ns:
            expired.append(key)
        elif next_ns is None or due < next_ns:
            next_ns = due
    return expired, next_ns


# ---- the batcher -----------------------------------------------------------------------

class SequenceBatcher(Generic[P]):
    """Queue sequence requests and run them in batches (see the module docstring).

    ``execute(batch)`` runs one :class:`SequenceBatch` and resolves every real row's future
    (it may read and replace ``row.sequence.state``). Scheduler interface: ``enqueue``,
    ``inflight``, ``stop``. ``enqueue`` must be called on the event loop the batcher uses.
    """

    def __init__(self, policy: SequencePolicy, execute: Callable[[SequenceBatch], Awaitable[None]],
                 clock: Callable[[], int] = time.monotonic_ns, name: str = "model") -> None:
        self.policy = policy
        self.name = name
        self._execute = execute
        self._clock = clock
        self._sequences: dict[Hashable, SequenceRecord] = {}
        self._backlog: deque[SequenceRecord] = deque()
        self._free_instances = list(range(policy.instance_count))
        self._free_slots = list(range(policy.slots_per_instance * policy.instance_count))
        self._admitted = 0
        self._executing = 0
        self._queued = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER
        self._closed_reason: str | None = None
        self._stopping = False
        self._backlog_admitted = False

    # -- scheduler interface -------------------------------------------------------------

    def enqueue(self, req: QueuedRequest[P], control: SequenceControl | None = None) -> None:
        """Queue ``req`` behind the earlier requests of its sequence (``control``, by default
        ``req.sequence``).

        Raises :class:`SequenceStartError` when the sequence is not active and ``control``
        has no START, :class:`UnavailableError` once the batcher is stopping.
        """
        if self._closed_reason is not None:
            raise UnavailableError(self._closed_reason)
        if control is None:
            control = req.sequence
            if control is None:
                raise ValueError(f"model '{self.name}': a sequence batcher's request needs its SequenceControl")
        key = _key(control.corrid)
        seq = self._sequences.get(key)
        if not control.start and (seq is None or not seq.open):
            raise SequenceStartError(
                f"inference request for sequence {control.corrid} to model '{self.name}' must specify "
                "the START flag on the first request of the sequence")
        now = self._clock()
        if seq is None:
            seq = self._sequences[key] = SequenceRecord(key, control.corrid, last_ns=now)
            self._admit_or_backlog(seq)
        seq.open = not control.end
        seq.last_ns = now
        seq.queue.append((req, control))
        self._queued += 1
        self._pump()

    def finish(self, corrid: int | str) -> None:
        """End a sequence as its END flag would, from the model's side (an iterative sequence whose
        request was released without rescheduling: Triton's IterativeSequencer ends it then): it
        is released once nothing of it is queued or running."""
        seq = self._sequences.get(_key(corrid))
        if seq is None:
            return
        seq.open = False
        if not seq.executing and not seq.queue:
            self._release(seq)
            self._pump()

    def inflight(self) -> int:
        """Requests queued or executing."""
        return self._queued + self._executing

    def active_sequences(self) -> int:
        """Sequences the batcher holds (admitted or in the backlog)."""
        return len(self._sequences)

    async def stop(self, drain: bool = True) -> None:
        """Refuse new requests; run (``drain``) or fail the queued ones; wait for batches.

        Requests of backlogged sequences that can no longer be scheduled fail with
        :class:`UnavailableError`; ``execute`` is not running when this returns."""
        if self._closed_reason is None:
            self._closed_reason = f"model '{self.name}' is stopping; the scheduler accepts no new requests"
        self._stopping = True
        if not drain:
            self._fail_all("stopped before it ran")
        while True:
            self._pump()
            if not self._tasks:
                break
            await asyncio.wait(list(self._tasks))
        self._fail_all("was not scheduled before the model stopped")
        self._cancel_timer()

    # -- admission -----------------------------------------------------------------------

    def _admit_or_backlog(self, seq: SequenceRecord) -> None:
        cap = self.policy.capacity
        if cap == 0 or self._admitted < cap:
            self._admit(seq)
        else:
            self._backlog.append(seq)

    def _admit(self, seq: SequenceRecord) -> None:
        seq.admitted = True
        self._admitted += 1
        if self.policy.strategy == "direct":
            seq.slot = self._free_slots.pop(0)

    def _release(self, seq: SequenceRecord) -> None:
        """Forget a sequence (ended or idle) and admit the oldest backlogged one."""
        self._sequences.pop(seq.key, None)
        if seq.admitted:
            seq.admitted = False
            self._admitted -= 1
            if seq.slot >= 0:
                self._free_slots.append(seq.slot)
                self._free_slots.sort()
                seq.slot = -1
        else:
            try:
                self._backlog.remove(seq)
            except ValueError:
                pass
        while self._backlog and (self.policy.capacity == 0 or self._admitted < self.policy.capacity):
            self._admit(self._backlog.popleft())
            self._backlog_admitted = True

    # -- the decision pump ---------------------------------------------------------------

    def _head(self, seq: SequenceRecord, now: int) -> QueuedRequest | None:
        """The sequence's next runnable request, dropping cancelled and expired ones."""
        while seq.queue:
            req, control = seq.queue[0]
            if req.future.done():
                seq.queue.popleft()
                self._queued -= 1
                if control.start and seq.queue:  # keep the reset for the next request
                    nxt, nctl = seq.queue.popleft()
                    seq.queue.appendleft((nxt, SequenceControl(nctl.corrid, True, nctl.end)))
                continue
            if req.deadline_ns is not None and req.deadline_ns <= now:
                seq.queue.popleft()
                self._queued -= 1
                req.future.set_exception(DeadlineExceededError(
                    f"model '{self.name}': request deadline exceeded after "
                    f"{(now - req.arrival_ns) / 1e6:.3f} ms in the queue"))
                continue
            return req
        return None

    def _pump(self) -> None:
        """Dispatch every batch that is due; arm one timer for the next decision."""
        now = self._clock()
        wake = _NEVER
        if self.policy.strategy == "oldest":
            wake = self._pump_oldest(now)
        else:
            wake = self._pump_direct(now)
        wake = min(wake, self._reap(now))
        self._arm(wake)

    def _ready(self, now: int) -> list[tuple[int, SequenceRecord, QueuedRequest]]:
        out = []
        for seq in self._sequences.values():
            if seq.admitted and not seq.executing:
                head = self._head(seq, now)
                if head is not None:
                    out.append((head.arrival_ns, seq, head))
        out.sort(key=lambda t: t[0])
        return out

    def _pump_oldest(self, now: int) -> int:
        while self._free_instances:
            ready = self._ready(now)
            if not ready:
                return _NEVER
            arrivals = [a for a, _, _ in ready]
            if self._stopping:
                now = max(now, arrivals[0] + self.policy.max_queue_delay_ns)
            action = oldest_action(arrivals, now, self.policy)
            if isinstance(action, Wait):
                return action.until_ns
            assert isinstance(action, Run)
            rows = [self._take(seq) for _, seq, _ in ready[:action.count]]
            self._dispatch(SequenceBatch(self._free_instances.pop(0), rows))
        return _NEVER

    def _pump_direct(self, now: int) -> int:
        per = self.policy.slots_per_instance
        ready = {seq.slot: (a, seq) for a, seq, _ in self._ready(now)}
        wake = _NEVER
        for inst in list(self._free_instances):
            base = inst * per
            arrivals = [ready[s][0] if s in ready else None for s in range(base, base + per)]
            occupied = sum(1 for s in self._sequences.values() if s.admitted and base <= s.slot < base + per)
            if self._stopping and any(a is not None for a in arrivals):
                action: Action = Run(max(i for i, a in enumerate(arrivals) if a is not None) + 1)
            else:
                action = direct_action(arrivals, occupied, now, self.policy)
            if isinstance(action, Wait):
                wake = min(wake, action.until_ns)
                continue
            if not isinstance(action, Run):
                continue
            rows = []
            for s in range(base, base + action.count):
                if s in ready:
                    rows.append(self._take(ready[s][1]))
                else:
                    holder = next((q for q in self._sequences.values() if q.slot == s), None)
                    rows.append(BatchRow(None, holder, None))
            self._free_instances.remove(inst)
            self._dispatch(SequenceBatch(inst, rows))
        return wake

    def _take(self, seq: SequenceRecord) -> BatchRow:
        req, control = seq.queue.popleft()
        self._queued -= 1
        seq.executing = True
        return BatchRow(req, seq, control)

    def _reap(self, now: int) -> int:
        idle = {s.key: s.last_ns for s in self._sequences.values()
                if not s.queue and not s.executing}
        if not idle:
            return _NEVER
        expired, next_ns = idle_expired(idle, now, self.policy.idle_ns)
        for key in expired:
            seq = self._sequences[key]
            if seq.open:
                _log.info("model '%s': sequence %s idle for %.0f ms; released", self.name, seq.corrid,
                          (now - seq.last_ns) / 1e6)
            self._release(seq)
        if expired and self._backlog_admitted:
            self._backlog_admitted = False
            asyncio.get_running_loop().call_soon(self._pump)  # admitted sequences may be ready
        return next_ns if next_ns is not None else _NEVER

    def _arm(self, when_ns: int) -> None:
        if when_ns >= _NEVER:
            return
        if self._timer is not None and self._timer_at <= when_ns:
            return
        self._cancel_timer()
        loop = asyncio.get_running_loop()
        self._timer_at = when_ns
        self._timer = loop.call_later(max(0.0, (when_ns - self._clock()) / 1e9), self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = _NEVER

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = _NEVER
        self._pump()

    # -- execution -----------------------------------------------------------------------

    def _dispatch(self, batch: SequenceBatch) -> None:
        n = len(batch.requests)
        self._executing += n
        task = asyncio.Task(self._run_batch(batch, n), loop=asyncio.get_running_loop(), name="batch")  # (see meshserve/server/http1/server.py:TASK_NAME)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: SequenceBatch, n: int) -> None:
        try:
            await self._execute(batch)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                _log.exception("model '%s': sequence batch failed", self.name)
            fail_unresolved((req.future for req in batch.requests), self.name, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            now = self._clock()
            for row in batch.rows:
                member, seq = row.request, row.sequence
                if member is not None and not member.future.done():
                    if member.requeued:  # its model rescheduled it: it runs again in a later batch
                        member.requeued = False
                    else:
                        member.future.set_exception(InternalBatchError(
                            f"model '{self.name}': batch finished without a result for this request"))
                if member is None or seq is None:
                    continue
                seq.executing = False
                seq.last_ns = now
                if not seq.open and not seq.queue and self._sequences.get(seq.key) is seq:
                    self._release(seq)  # END ran and nothing follows
            self._executing -= n
            self._free_instances.append(batch.instance)
            self._free_instances.sort()
            self._pump()

    def _fail_all(self, what: str) -> None:
        for seq in list(self._sequences.values()):
            while seq.queue:
                req, _ = seq.queue.popleft()
                self._queued -= 1
                if not req.future.done():
                    req.future.set_exception(UnavailableError(f"model '{self.name}': request {what}"))


def _key(corrid: int | str) -> Hashable:
    return ("s", corrid) if isinstance(corrid, str) else ("i", corrid)
