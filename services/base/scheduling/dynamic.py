"""Dynamic batching with Triton's semantics (``src/dynamic_batch_scheduler.cc``).

Two parts: :func:`next_action`, a pure decision over the row counts at the head of the
queue, and :class:`DynamicBatcher`, the asyncio loop that applies it, keeps at most
``instance_count`` batches in flight and makes sure every queued request resolves once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic

from . import timer
from .errors import (
    DeadlineExceededError,
    InternalBatchError,
    QueueFullError,
    UnavailableError,
    fail_unresolved,
)
from .policy import BatchingPolicy
from .request import P, QueuedRequest

__all__ = ["IDLE", "Action", "DynamicBatcher", "Idle", "Run", "Wait", "next_action"]

_log = logging.getLogger(__name__)
_NEVER = sys.maxsize
_TIMER_SLACK_NS = 1_000_000  # wait the final millisecond by yielding, not on a timer
# Early release learns its company again (a probe: one full wait) at least this often, and at
# least every _PROBE_DELAYS delays, so that a probe's wait stays a small share of the time.
_PROBE_EVERY_NS = 100_000_000
_PROBE_DELAYS = 20
_MISSES = 2  # ... and after this many batches in a row expired with fewer clients than K


@dataclass(frozen=True, slots=True)
class Run:
    """Take the first ``count`` queued requests as one batch, now (``early``: because the
    company the batcher expects is all there, before the delay expired; see next_action)."""

    count: int
    early: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to run yet: sleep until ``until_ns`` unless more requests arrive."""

    until_ns: int


@dataclass(frozen=True, slots=True)
class Idle:
    """The queue is empty."""


IDLE = Idle()
Action = Run | Wait | Idle


def next_action(queued_rows: Sequence[int], oldest_arrival_ns: int, now_ns: int,
                policy: BatchingPolicy, alone: bool = False, company: int = 0, members: int = 0) -> Action:
    """Decide what to do with the queue whose head requests have ``queued_rows`` rows.

    Mirrors Triton's ``GetDynamicBatch``, evaluated when an instance is free:

    * requests join in FIFO order while the batch stays within ``max_batch_size`` rows; the
      first request that would overflow it stays queued (and makes the batch ready now);
    * each prefix whose rows equal a preferred size is remembered; so is the prefix just
      before the rows would pass the largest preferred size (Triton treats a batch that
      cannot reach a larger preferred size as ready);
    * before the delay expires, a remembered prefix runs now; otherwise the batch runs now
      if it is full (≥ the largest preferred size, or ``max_batch_size`` without preferred
      sizes), else the batcher waits until ``oldest_arrival_ns + max_queue_delay_ns``;
    * once the delay from the *oldest* request has expired, everything that fits runs (as
      in Triton: the preferred prefix is not preferred any more);
    * with ``max_queue_delay_ns == 0`` nothing ever waits: the remembered preferred prefix
      runs if there is one, else everything that fits;
    * with batching disabled each request runs alone;
    * ``alone`` (the batcher's word that nothing is executing and the previous batch was one
      client request that found the model idle and met nobody until it was done: one client at
      a time; a gateway's merged request is several clients): a lone queued
      request runs now. Waiting for company that has not come for a whole batch only adds the
      delay to every request (Triton waits here; it is the one place meshserve does not).
      A second queued request, or anything arriving while it runs, ends it.
    * ``company`` (the batcher's K, 0 = none: see :class:`DynamicBatcher`, early release) and
      ``members`` (the client requests the queued requests carry; a gateway's merged request
      counts its clients): once ``members`` reaches ``company`` (≥ 2) a batch that would wait
      runs now (``Run(early=True)``): in a closed loop the clients that the last full wait
      gathered are all here and nobody else is coming. A preferred size still wins first.

    ``queued_rows`` may be a bounded prefix: only requests up to the first one that
    overflows ``max_batch_size`` are looked at.
    """
    n = len(queued_rows)
    if n == 0:
        return IDLE
    max_batch = policy.max_batch_size
    if max_batch == 0 or (alone and n == 1):
        return Run(1)
    preferred = policy.preferred_set
    max_preferred = policy.max_preferred

    # The first request always joins (even one larger than max_batch_size: it runs alone).
    total = queued_rows[0]
    count = 1
    best = 1 if total in preferred else 0  # a request count, 0 = none
    full = False
    for i in range(1, n):
        grown = total + queued_rows[i]
        if grown > max_preferred and best == 0:
            best = count
        if grown > max_batch:
            full = True
            break
        total = grown
        count += 1
        if total in preferred:
            best = count

    delay = policy.max_queue_delay_ns
    expired = delay != 0 and now_ns - oldest_arrival_ns >= delay
    if best and not expired:
        return Run(best)
    if full or expired or delay == 0 or total >= max_preferred:
        return Run(count)
    if company > 1 and members >= company:
        return Run(count, True)
    return Wait(oldest_arrival_ns + delay)


class LevelQueue:
    """FIFO queues per priority level (index 0 = level 1, the highest) plus a tail of
    requests whose DELAY timeout passed. ``popleft`` serves the highest non-empty level
    first, so a batch fills with high-priority requests before lower ones join it."""

    __slots__ = ("_levels", "_delayed", "_len")

    def __init__(self, levels: int = 1):
        self._levels: list[deque[QueuedRequest]] = [deque() for _ in range(max(1, levels))]
        self._delayed: deque[QueuedRequest] = deque()
        self._len = 0

    def _queue_of(self, req: QueuedRequest) -> deque[QueuedRequest]:
        if req.delayed:
            return self._delayed
        return self._levels[max(req.priority, 1) - 1]

    def append(self, req: QueuedRequest) -> None:
        self._queue_of(req).append(req)
        self._len += 1

    def popleft(self) -> QueuedRequest:
        for q in self._levels:
            if q:
                self._len -= 1
                return q.popleft()
        if self._delayed:
            self._len -= 1
            return self._delayed.popleft()
        raise IndexError("pop from an empty LevelQueue")

    def extendleft(self, reqs: Iterable[QueuedRequest]) -> None:
        """Push requests back to the front of their own queues (pass them in reverse order)."""
        for req in reqs:
            self._queue_of(req).appendleft(req)
            self._len += 1

    def level_len(self, level: int) -> int:
        return len(self._levels[max(level, 1) - 1])

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0


class DynamicBatcher(Generic[P]):
    """Queue requests for one model and run them in batches on ``instance_count`` instances.

    ``execute(batch)`` runs one batch and sets each member's future. At most
    ``instance_count`` calls are in flight; while they run the loop keeps queueing, so the
    next batch grows until an instance is free (which is what makes batching pay off under
    load). Every request resolves exactly once: cancelled requests are skipped, expired ones
    fail with :class:`DeadlineExceededError`, members left unresolved by ``execute`` (or by
    an ``execute`` that raised) get :class:`InternalBatchError`, and if the loop itself fails,
    the queue fails with :class:`UnavailableError` and so do later enqueues.

    Build it explicitly at model load and call :meth:`stop` before unloading. ``enqueue``
    must be called from the event loop the batcher runs on; the loop task starts lazily.

    Early release (``early_release``, on by default; a difference from Triton, which always
    waits): a batch released by its delay expiring while it waited at a free instance, or by
    being full, is a *probe*; the client requests (members) queued at that moment are the company
    K that the next batches expect (a batch that expired behind a busy instance only counts the
    clients that came during the compute).
    While an instance is free and K ≥ 2 clients are queued, the batch runs now instead of
    waiting out the delay (next_action's ``company``): in a closed loop (clients that wait for
    their answer before sending again) the clients that the full wait gathered are all back and
    nobody else is coming. It never waits longer than Triton would. Only probes set K (an early
    batch always holds ≥ K, an expiry before K came < K: learning from those would ratchet), and a
    probe comes again at least every ``max(_PROBE_EVERY_NS, _PROBE_DELAYS x delay)`` and right
    after ``_MISSES`` batches in a row expired while K was in force (fewer clients than K came;
    a single miss is a late client, who joins the next round), so K follows the load both ways
    and stays an unbiased sample under open-loop arrivals. ``early_releases`` counts the batches
    it released.
    """

    def __init__(self, policy: BatchingPolicy,
                 execute: Callable[[list[QueuedRequest[P]]], Awaitable[None]],
                 instance_count: int = 1,
                 clock: Callable[[], int] = time.monotonic_ns,
                 name: str = "model", early_release: bool = True) -> None:
        if instance_count < 1:
            raise ValueError(f"model '{name}': instance_count must be >= 1, got {instance_count}")
        self.policy = policy
        self.name = name
        self._execute = execute
        self._clock = clock
        self.instance_count = instance_count
        self._free_slots = instance_count
        # running batches whose slot release() already freed (held, and compared by identity: at
        # most one per instance)
        self._released: list[list[QueuedRequest]] = []
        self._queue = LevelQueue(policy.levels)
        self._queued_rows = 0  # rows of everything in _queue, cancelled entries included
        self._executing = 0  # requests in batches that are running
        self._batches: set[asyncio.Task[None]] = set()
        self._held: list[QueuedRequest] | None = None  # popped by the loop, not yet placed
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The loop sleeps on a bare future; enqueue wakes it only once the queued rows reach
        # _wake_rows, so arrivals that cannot change the decision cost no wake-up.
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.Handle | None = None
        self._precise: timer.PreciseTimer | None = None
        self._wake_rows = _NEVER
        self._closed_reason: str | None = None  # set once enqueue must refuse
        self._stopping = False
        # One client at a time (next_action's ``alone``): the last batch was one client request
        # that arrived with nothing queued or executing, and nothing else arrived until it was
        # done. _enqueued counts arrivals; _idle_arrival is the last request that found the
        # model idle, with the count after it.
        self._alone = False
        self._enqueued = 0
        self._idle_arrival: tuple[QueuedRequest | None, int] = (None, 0)
        # Early release (see the class docstring): K, the clock time when the next batch is a
        # probe again (0: now; _NEVER: early release is off), and how many batches it released.
        # _wake_members counts down the members still missing to K while the loop sleeps.
        self._company = 0
        self._misses = 0  # batches in a row that expired while K was in force
        self._waited = False  # the batch being formed waited at a free instance
        delay = policy.max_queue_delay_ns
        self._probe_at = 0 if early_release and delay and policy.batching else _NEVER
        self._probe_every = max(_PROBE_EVERY_NS, _PROBE_DELAYS * delay)
        self._wake_members = _NEVER
        self.early_releases = 0

    # -- scheduler interface -------------------------------------------------------------

    def enqueue(self, req: QueuedRequest[P]) -> None:
        """Queue ``req``; its future resolves when its batch finishes or it is failed.

        Raises :class:`QueueFullError` when ``max_queue_size`` requests are queued and
        :class:`UnavailableError` once the batcher is stopping or has failed.
        """
        if self._closed_reason is not None:
            raise UnavailableError(self._closed_reason)
        policy = self.policy
        if policy.priority_levels:
            limit = policy.queue_policy(req.priority).max_queue_size
            if limit and self._queue.level_len(req.priority) >= limit:
                raise QueueFullError(self.name, limit)
        else:
            limit = policy.max_queue_size
            if limit and len(self._queue) >= limit:
                raise QueueFullError(self.name, limit)
        if req.rows < 1:
            raise ValueError(f"model '{self.name}': a request needs at least 1 row, got {req.rows}")
        if self._task is None:
            self._start()
        idle = not self._queue and not self._executing
        self._queue.append(req)
        self._queued_rows += req.rows
        self._enqueued += 1
        if idle:
            self._idle_arrival = (req, self._enqueued)
        self._wake_members -= req.members
        if self._queued_rows >= self._wake_rows or self._wake_members <= 0 or req.waited_ns:
            self._wake()  # enough rows or clients, or a request older than its arrival: its delay may be due

    def inflight(self) -> int:
        """Requests queued or executing (cancelled ones count until the loop drops them)."""
        return len(self._queue) + self._executing

    async def stop(self, drain: bool = True) -> None:
        """Refuse new requests, then finish.

        ``drain=True`` runs every queued request (no more waiting for the delay) and returns
        once all batches are done. ``drain=False`` fails the queued requests with
        :class:`UnavailableError` and waits only for the batches already executing. Either way
        ``execute`` is not running when this returns, so the runtime can be unloaded.
        """
        if self._closed_reason is None:
            self._closed_reason = f"model '{self.name}' is stopping; the scheduler accepts no new requests"
        self._stopping = True
        if not drain:
            self._fail_queue("stopped before it ran")
        self._wake()
        if self._task is not None:
            await asyncio.wait([self._task])
        while self._batches:
            await asyncio.wait(list(self._batches))
        if self._precise is not None:
            precise, self._precise = self._precise, None
            precise.close()

    # -- loop ------------------------------------------------------------------------------

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # The real clock gets a timerfd (µs precision, no spinning); an injected clock (tests)
        # or a platform without timerfd falls back to loop timers + per-pass clock checks.
        if self._clock is time.monotonic_ns and timer.available() and os.environ.get("MESHSERVE_TIMERFD", "1") != "0":
            self._precise = timer.PreciseTimer(self._loop, self._wake)
        self._task = self._loop.create_task(self._run(), name=f"dynamic-batcher:{self.name}")

    def _wake(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._precise is not None:
            self._precise.disarm()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._wake_rows = self._wake_members = _NEVER
            if not waiter.done():
                waiter.set_result(None)

    async def _sleep(self, wake_rows: int, until_ns: int | None, wake_members: int = _NEVER) -> None:
        """Sleep until woken (enqueue reaching ``wake_rows``, ``wake_members`` more client
        requests, a free slot, stop) or ``until_ns``."""
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._wake_rows = wake_rows
        self._wake_members = wake_members
        self._timer = None
        if until_ns is not None and self._precise is not None:
            self._precise.arm(until_ns)
        elif until_ns is not None:
            remaining = until_ns - self._clock()
            if remaining > _TIMER_SLACK_NS:
                self._timer = self._loop.call_later((remaining - _TIMER_SLACK_NS) / 1e9, self._tick, until_ns)
            else:
                self._tick(until_ns)
        try:
            await waiter
        finally:
            self._waiter = None
            self._wake_rows = self._wake_members = _NEVER
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._precise is not None:
                self._precise.disarm()

    def _tick(self, until_ns: int) -> None:
        # Event-loop timers are millisecond-grained (epoll rounds up, libuv rounds down), so
        # a 100 µs delay would become ~1 ms: for the last stretch, re-check the clock once per
        # loop pass. A pass costs one clock read; the full decision runs only when time is up.
        assert self._loop is not None
        if self._clock() >= until_ns:
            self._timer = None
            self._wake()
        else:
            self._timer = self._loop.call_soon(self._tick, until_ns)

    async def _run(self) -> None:
        try:
            await self._serve()
        except BaseException as exc:  # the loop must never die with requests left queued
            if not isinstance(exc, asyncio.CancelledError):
                _log.exception("model '%s': dynamic batcher loop failed", self.name)
            reason = f"model '{self.name}': the scheduler failed ({exc!r})"
            self._closed_reason = reason
            held, self._held = self._held, None
            for req in held or ():
                if not req.future.done():
                    req.future.set_exception(UnavailableError(reason))
            self._fail_queue("the scheduler failed", cause=exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _serve(self) -> None:
        queue = self._queue
        policy = self.policy
        clock = self._clock
        limit = policy.max_batch_size or 1  # rows to look at: one more request overflows
        delay = policy.max_queue_delay_ns
        preferred = policy.preferred_batch_sizes
        max_preferred = policy.max_preferred
        while True:
            if not queue:
                if self._stopping:
                    return
                await self._sleep(1, None)
                continue
            if self._free_slots == 0:
                await self._sleep(_NEVER, None)  # a finishing batch wakes us
                continue

            now = clock()
            # Pop the bounded prefix, dropping cancelled and expired requests on the way.
            held: list[QueuedRequest] = []
            self._held = held
            rows: list[int] = []
            total = 0
            members = 0
            min_deadline = _NEVER
            oldest = _NEVER
            while queue and total < limit:
                req = queue.popleft()
                fut = req.future
                if fut.done():
                    self._queued_rows -= req.rows
                    continue
                delay_at = req.delay_at_ns
                if delay_at is not None and delay_at <= now and not req.delayed:
                    req.delayed = True  # DELAY policy: behind everything that has not timed out
                    queue.append(req)
                    continue
                deadline = req.deadline_ns
                if deadline is not None:
                    if deadline <= now:
                        self._queued_rows -= req.rows
                        fut.set_exception(DeadlineExceededError(
                            f"model '{self.name}': request deadline exceeded after "
                            f"{(now - req.arrival_ns) / 1e6:.3f} ms in the queue"))
                        continue
                    if deadline < min_deadline:
                        min_deadline = deadline
                since = req.arrival_ns - req.waited_ns
                if since < oldest:
                    oldest = since
                held.append(req)
                rows.append(req.rows)
                total += req.rows
                members += req.members
            if not held:
                self._held = None
                continue

            if self._stopping and delay:
                now = max(now, oldest + delay)  # draining: do not wait for more requests
            probe = now >= self._probe_at
            company = 0 if probe else self._company
            action = next_action(rows, oldest, now, policy, self._alone and not self._executing, company, members)

            if isinstance(action, Run):
                if action.early:
                    self.early_releases += 1
                    self._misses = 0
                elif self._probe_at != _NEVER:  # early release is on
                    # expired after waiting at a free instance: a batch that expired behind a busy
                    # one (compute longer than the delay) tells nothing of who comes within a delay
                    expired = now - oldest >= delay and self._waited
                    if probe and (expired or total >= max_preferred):
                        # K: the clients that a full wait (or a full batch) gathered; below 2 it
                        # releases nothing, so every batch probes (it waits anyway)
                        self._company = members
                        self._probe_at = now + self._probe_every if members > 1 else 0
                        self._misses = 0
                    elif expired and not probe:
                        # fewer than K came: one late client is forgiven (it joins the next
                        # round); twice in a row, K is learned again with the next batch
                        self._misses += 1
                        if self._misses >= _MISSES:
                            self._probe_at = 0
                self._waited = False
                count = action.count
                if count < len(held):
                    queue.extendleft(reversed(held[count:]))
                    batch = held[:count]
                    batch_rows = sum(rows[:count])
                else:
                    batch = held
                    batch_rows = total
                self._queued_rows -= batch_rows
                self._dispatch(batch)
                self._held = None
                continue

            # Wait: everything queued fits (else it would run), so queued rows == total.
            queue.extendleft(reversed(held))
            self._held = None
            self._waited = True
            assert isinstance(action, Wait)
            # Only an arrival that reaches the next preferred size (or the max batch) can
            # turn this Wait into a Run; earlier arrivals do not wake the loop.
            i = bisect_right(preferred, total)
            wake_rows = preferred[i] if i < len(preferred) else policy.max_batch_size
            # ... or the client requests that make up the company (early release)
            await self._sleep(wake_rows, min(action.until_ns, min_deadline),
                              company - members if company > 1 else _NEVER)

    def _dispatch(self, batch: list[QueuedRequest]) -> None:
        assert self._loop is not None
        # a lone request that found the model idle and met nobody: if nothing arrives until it
        # is done either, the next lone request need not wait for company (next_action's ``alone``)
        first, mark = self._idle_arrival
        if len(batch) != 1 or batch[0] is not first or first.members != 1 or mark != self._enqueued:
            mark = -1  # company came (or it is a gateway's merge of several clients)
        self._idle_arrival = (None, 0)
        self._free_slots -= 1
        self._executing += len(batch)
        task = asyncio.Task(self._run_batch(batch, mark), loop=self._loop, name="batch")  # (see meshserve/server/http1/server.py:TASK_NAME)
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    def release(self, batch: list[QueuedRequest]) -> None:
        """The executor is done with its instance for `batch` (compute finished) though the
        batch's results are not delivered yet: the next batch may start now. Optional and
        idempotent; without it the slot frees when the batch's execute returns."""
        for b in self._released:
            if b is batch:
                return
        self._released.append(batch)
        self._free_slots += 1
        if self._free_slots == 1 and self._queue:
            self._wake()

    async def _run_batch(self, batch: list[QueuedRequest], mark: int = -1) -> None:
        try:
            await self._execute(batch)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                _log.exception("model '%s': batch of %d requests failed", self.name, len(batch))
            fail_unresolved((req.future for req in batch), self.name, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            for req in batch:
                if not req.future.done():
                    req.future.set_exception(InternalBatchError(
                        f"model '{self.name}': batch finished without a result for this request"))
            self._executing -= len(batch)
            self._alone = mark == self._enqueued
            for i, b in enumerate(self._released):
                if b is batch:
                    del self._released[i]
                    break
            else:
                self._free_slots += 1
                if self._free_slots == 1 and self._queue:
                    self._wake()  # the loop may be waiting for this slot

    def _fail_queue(self, what: str, cause: BaseException | None = None) -> None:
        queue = self._queue
        while queue:
            req = queue.popleft()
            if not req.future.done():
                err = UnavailableError(f"model '{self.name}': request {what}")
                err.__cause__ = cause
                req.future.set_exception(err)
        self._queued_rows = 0
