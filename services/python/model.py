"""A loaded python-backend model version: the dynamic batcher of services/base in front of one
worker process per instance.

A batch is handed to ``execute()`` as Triton's python backend does: a list with one
InferenceRequest per client request (nothing concatenated). A decoupled model's responses stream
back through ``infer_stream``; a unary call on it gets Triton's error. With ``sequence_batching``
the sequence batcher of services/base takes the dynamic batcher's place: a sequence's requests
reach one instance, in order, each with its correlation id and START/END flags, and with the
configured control input tensors and implicit state (services/python/sequence_io.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, cast

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.hop import NO_HOP, Hop
from meshserve.telemetry import tracing
from services.base.model import ModelVersion
from services.base.scheduling.request import QueuedRequest, Scheduler, SequenceControl
from services.base.scheduling.sequence import SequenceBatch, SequenceBatcher
from services.base.validation import Pending, require_single_row
from services.python.instance import IterativeControl, ModelWorker, StreamSink, request_key
from services.python.sequence_io import SequenceIO
from services.sequence.model import policy_from_config, sequence_control

log = logging.getLogger("meshserve.python")
# the correlation ids an iterative sequence's requests without one get (Triton's counts from 1; here
# from 2**62, clear of the ids clients usually pick)
_ITERATIVE_IDS = itertools.count(1 << 62)


class PythonModelVersion(ModelVersion):
    """A python model version; its instances are ModelWorkers (one process each)."""

    def __init__(self, config: mc.ModelConfig, version: int, model_dir: Path, workers: list[ModelWorker]):
        super().__init__(config, version, model_dir, list(workers), "python")  # type: ignore[arg-type]
        self.workers = workers
        # a decoupled request's worker key (a process-wide counter, never an id()) and where its
        # responses go, from infer_stream until its final response or its end
        self._streams: dict[QueuedRequest[Pending], tuple[int, StreamSink]] = {}
        # when a decoupled request's batch began (its queue time, for its statistics)
        self._stream_started: dict[QueuedRequest[Pending], int] = {}
        self._restarts: set[asyncio.Task[None]] = set()
        self._closing = False
        for w in workers:
            w.on_death = self._on_death
            w.encoder = self.encoder  # (its classification labels)

    async def runtime_ready(self) -> str | None:
        """As Triton's model readiness: every instance must be ready (its worker up, and its
        ``is_ready()`` true when the model defines one; the instances are asked together); the
        first instance's reason that is not."""
        reasons = await asyncio.gather(*(w.check_ready() for w in self.workers))
        return next((r for r in reasons if r is not None), None)

    def busy(self) -> bool:
        return bool(self._streams) or super().busy()  # a decoupled request's responses still coming

    # ---- sequence batching ----------------------------------------------------------------
    def _scheduler(self, config: mc.ModelConfig, instance_count: int) -> Scheduler[Pending]:
        if not config.HasField("sequence_batching"):
            return super()._scheduler(config, instance_count)
        self.sequence_io = SequenceIO(config, self.model_dir)
        self.sequence_policy = policy_from_config(config, instance_count)
        return SequenceBatcher[Pending](self.sequence_policy, self._execute_sequence, name=config.name)

    @property
    def sequential(self) -> bool:
        return isinstance(self.scheduler, SequenceBatcher)

    @property
    def iterative(self) -> bool:
        """``sequence_batching { iterative_sequence: true }``: the model may reschedule a request."""
        return self.config.HasField("sequence_batching") and self.config.sequence_batching.iterative_sequence

    def prepare(self, request: pb.ModelInferRequest, hop: Hop = NO_HOP) -> Pending:
        """ModelVersion's validation; a sequence model's request also needs its correlation id
        and flags, and one row. An iterative sequence's request without one is a sequence of its
        own, with an id of the service's and START (Triton's IterativeSequencer)."""
        control: SequenceControl | None = None
        if self.iterative:
            control = sequence_control(request, self.name, required=False)
            if control.corrid == 0 or control.corrid == "":
                control = SequenceControl(next(_ITERATIVE_IDS), True, False)
            control = IterativeControl(control.corrid, control.start, control.end)
        elif self.config.HasField("sequence_batching"):
            control = sequence_control(request, self.name)
        pending = super().prepare(request, hop)
        if hop.gateway:  # the request's id is the hop's key: the client's is the hop's (none: "")
            pending.request_id = hop.request_id or ""
        if control is not None:
            require_single_row(pending, self.name, self.max_batch_size)
            pending.sequence = control
        return pending

    def _queued(self, request: pb.ModelInferRequest, pending: Pending, deadline_ns: int | None, hop: Hop,
                fut: asyncio.Future[object]) -> QueuedRequest[Pending]:
        if not self.sequential:
            return super()._queued(request, pending, deadline_ns, hop, fut)
        return QueuedRequest(rows=1, arrival_ns=time.monotonic_ns(), deadline_ns=deadline_ns, payload=pending,
                             future=fut, sequence=pending.sequence)

    async def _execute_sequence(self, batch: SequenceBatch) -> None:
        """One sequence batch on the batcher's instance: its real rows (a python model gets no
        filler rows) as one execute() list, with their control and state inputs; the batcher frees
        the instance when this returns."""
        io = self.sequence_io
        if not io.active:
            await self._run(self.workers[batch.instance], batch.requests, None)
            return
        io.add_inputs(batch.rows)
        await self._run(self.workers[batch.instance], batch.requests, None,
                        functools.partial(io.keep_states, batch.rows))

    # ---- decoupled -------------------------------------------------------------------
    async def infer_stream(self, request: pb.ModelInferRequest, deadline_ns: int | None,
                           hop: Hop = NO_HOP) -> AsyncGenerator[tuple[bytes | None, bool], None]:
        """Every response of one request to a decoupled model, in order; the last is final.

        Its statistics are counted here, once, when it ends (not when its execute() returns: its
        responses may come later, from a thread): a success once its final response is out, a
        failure with the error that ended it, CANCELED when its client left first (the queue's
        and a running batch's cancellation are counted by ``ModelVersion._result``)."""
        try:
            pending = self.prepare(request, hop)
        except InferError:
            self.stats.record_failure(0, "OTHER")
            raise
        if tracing.enabled:
            pending.spans = tracing.request_spans()
        answers: asyncio.Queue[tuple[bytes | None, bool] | InferError] = asyncio.Queue()
        key = request_key()
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        queued = self._queued(request, pending, deadline_ns, hop, fut)
        self._streams[queued] = (key, answers.put_nowait)
        final = False
        error: InferError | None = None  # what ended it: the model's error, or its batch's
        outcome: asyncio.Task[bytes] | None = None
        try:
            self._enqueue(queued)
            outcome = asyncio.ensure_future(self._result(queued, fut))
            outcome.add_done_callback(lambda t: _forward_error(t, answers))
            while True:
                item = await answers.get()
                if isinstance(item, InferError):
                    error = item
                    raise item
                final = item[1]
                yield item
                if final:
                    return
        finally:
            self._streams.pop(queued, None)
            started = self._stream_started.pop(queued, None)
            # After the final response (or an error) the request is over: its batch's outcome
            # settles by itself (the worker may report the batch after the final), and nothing is
            # cancelled. Before it, the client went away: a real cancel.
            now = time.monotonic_ns()
            if final:
                self.stats.record_success(now - queued.arrival_ns, (started or now) - queued.arrival_ns,
                                          pending.requests)
            elif error is not None:
                if error.code is not Code.DEADLINE_EXCEEDED:  # (expired in the queue: _result counted it)
                    self.stats.record_failure(now - queued.arrival_ns, "BACKEND", pending.requests)
            else:
                if not fut.cancel():  # its batch is over, its responses still coming: tell the worker
                    for w in self.workers:
                        w.cancel(key)
                    failed = not fut.cancelled() and fut.exception() is not None
                    self.stats.record_failure(now - queued.arrival_ns, "BACKEND" if failed else "CANCELED",
                                              pending.requests)
                # (a cancelled future leaves the queue, counted as cancelled, or tells the worker
                # running its batch: _cancel_if_cancelled)
                if outcome is not None and not outcome.done():
                    outcome.cancel()
                    with contextlib.suppress(BaseException):
                        await outcome
            # (the raised error's traceback holds this frame, and its outcome and future hold the
            # error: none stays in a local, docs/security.md, "Session 11: error cycles")
            error = item = outcome = fut = queued = None  # type: ignore[assignment]

    # ---- batches -----------------------------------------------------------------------
    def _take(self) -> ModelWorker:
        """A free instance, a live one first (a dead one fails its batch at once, naming why)."""
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            w = free[i]
            if isinstance(w, ModelWorker) and w.alive:
                return free.pop(i)  # type: ignore[return-value]
        return free.pop()  # type: ignore[return-value]

    async def _execute(self, batch: list[QueuedRequest[Pending]]) -> None:
        worker = self._take()

        def release() -> None:
            # the instance goes back, and the batcher may dispatch to it, before this batch's
            # results are delivered (as ModelVersion._execute does)
            self._free.append(worker)  # type: ignore[arg-type]
            self.batcher.release(batch)

        await self._run(worker, batch, release)

    async def _run(self, worker: ModelWorker, batch: list[QueuedRequest[Pending]],
                   release: Callable[[], None] | None,
                   answered: Callable[[list[Any]], None] | None = None) -> None:
        """Run ``batch`` on ``worker`` (``release`` once it ran; ``answered`` sees the answers
        first); resolve every member's future."""
        start_ns = time.monotonic_ns()
        keys: list[int] = []
        sinks: dict[int, StreamSink] = {}
        streams = self._streams
        for q in batch:
            stream = streams.get(q)
            if stream is None:
                keys.append(request_key())
            else:
                keys.append(stream[0])
                sinks[stream[0]] = stream[1]
                self._stream_started[q] = start_ns
        # a request whose client went away, or whose deadline passes, while execute() runs: the
        # model is told (request.is_cancelled())
        loop = asyncio.get_running_loop()
        timers = []
        watches = []  # (one per pass: a rescheduled request drops its pass's, _reschedule)
        for q, key in zip(batch, keys, strict=True):
            watch = functools.partial(_cancel_if_cancelled, worker, key)
            q.future.add_done_callback(watch)
            watches.append(watch)
            if q.deadline_ns is not None:
                timers.append(loop.call_later(max(0.0, (q.deadline_ns - start_ns) / 1e9), worker.cancel, key))
        out: list[bytes | InferError | asyncio.Future[object] | None] | None = None
        rescheduled: frozenset[int] = frozenset()
        failure: InferError | None = None
        infer_ns = 0
        try:
            out, infer_ns, rescheduled = await worker.execute([q.payload for q in batch], keys, sinks)
            if answered is not None and out is not None:
                answered(out)
        except InferError as exc:
            # (without its traceback, which no log shows: it holds this frame, which holds the
            # batch whose futures fail with it: docs/security.md, "Session 11: error cycles")
            failure = exc.with_traceback(None)
        except Exception as exc:
            failure = self._failure(exc)
        finally:
            for timer in timers:
                timer.cancel()
            if release is not None:
                release()
        end_ns = time.monotonic_ns()
        await asyncio.sleep(0)
        stats = self.stats
        # (a decoupled request is counted by infer_stream when it ends: sinks holds their keys)
        if self.iterative:  # a request released without RESCHEDULE ends its sequence (Triton's)
            for q, key in zip(batch, keys, strict=True):
                if key not in rescheduled and q.sequence is not None:
                    cast(SequenceBatcher[Pending], self.scheduler).finish(q.sequence.corrid)
        if failure is not None:
            for q, key in zip(batch, keys, strict=True):
                if not q.future.done():  # (a cancelled one is counted by ModelVersion._result)
                    if key not in sinks:
                        stats.record_failure(end_ns - q.arrival_ns, "BACKEND", q.payload.requests)
                    q.future.set_exception(failure)
            return
        stats.record_batch(sum(q.rows for q in batch), sum(q.payload.requests for q in batch), 0, infer_ns, 0)
        late: list[tuple[QueuedRequest[Pending], asyncio.Future[object]]] = []
        for i, q in enumerate(batch):
            if q.future.done():
                continue
            if keys[i] in rescheduled:
                q.future.remove_done_callback(watches[i])
                self._reschedule(q)
                continue
            if sinks and keys[i] in sinks:
                q.future.set_result(None)  # (a decoupled request's execute() returned: no answer)
                continue
            body = out[i] if out is not None else None
            if isinstance(body, asyncio.Future):  # execute() left it open: its sender answers it later
                worker.watch_deferred(keys[i])
                late.append((q, body))
                continue
            if isinstance(body, InferError):
                stats.record_failure(end_ns - q.arrival_ns, "BACKEND", q.payload.requests)
                q.future.set_exception(body)
                continue
            stats.record_success(end_ns - q.arrival_ns, start_ns - q.arrival_ns, q.payload.requests)
            q.future.set_result(body)
        if late:
            # (the instance is released already: the next batch runs meanwhile; each wait is bounded
            # by ModelWorker.watch_deferred, the worker's death and the model's unload)
            await asyncio.wait([fut for _, fut in late])
            for q, fut in late:
                self._answered_late(q, start_ns, fut)
            late.clear()

    def _reschedule(self, q: QueuedRequest[Pending]) -> None:
        """The model released ``q`` with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: queued again
        behind its sequence (an iterative one: the same instance, its next pass without START),
        its future and, when decoupled, its stream kept; in a model that is not iterative, the
        request fails in Triton's words."""
        control = q.sequence
        if not self.iterative or control is None:
            q.future.set_exception(InferError.internal(
                "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not "
                "configured to handle such a flag."))
            return
        again = IterativeControl(control.corrid, False, False)
        q.sequence = q.payload.sequence = again
        q.requeued = True
        try:
            cast(SequenceBatcher[Pending], self.scheduler).enqueue(q)
        except Exception as exc:  # (the model is stopping)
            q.requeued = False
            q.future.set_exception(InferError.unavailable(f"model '{self.name}': request rescheduled as the "
                                                          f"model stopped: {exc}"))

    def _answered_late(self, q: QueuedRequest[Pending], start_ns: int, answer: asyncio.Future[object]) -> None:
        """A deferred request's answer came (or its wait ran out, or its worker died)."""
        if q.future.done():  # (its client went away meanwhile: counted by ModelVersion._result)
            return
        end_ns = time.monotonic_ns()
        error = answer.exception()
        if error is not None:
            self.stats.record_failure(end_ns - q.arrival_ns, "BACKEND", q.payload.requests)
            q.future.set_exception(error)
            return
        self.stats.record_success(end_ns - q.arrival_ns, start_ns - q.arrival_ns, q.payload.requests)
        q.future.set_result(answer.result())

    # ---- restarts ----------------------------------------------------------------------
    def _on_death(self, worker: ModelWorker) -> None:
        if self._closing:
            return
        task = asyncio.ensure_future(self._restart(worker))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, worker: ModelWorker) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            delay = worker.restart_delay()
            log.warning("restarting model instance '%s' in %.1f s", worker.name, delay)
            worker.reason = f"{worker.reason}; restarting in {delay:g} s"
            await asyncio.sleep(delay)
            if self._closing:
                return
            try:
                await loop.run_in_executor(None, worker.start)
            except Exception as exc:
                worker.failures += 1
                worker.reason = f"restart failed: {exc}"
                log.error("model instance '%s' did not restart: %s", worker.name, exc)
                continue
            log.info("model instance '%s' restarted (pid %s)", worker.name, worker.pid)
            return

    def stop_restarts(self) -> None:
        self._closing = True
        for task in list(self._restarts):
            task.cancel()

    async def close(self, drain: bool = True) -> None:
        self.ready = False
        await self.scheduler.stop(drain=drain)
        self.stop_restarts()
        self._pool.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self._close_workers)

    def _close_workers(self) -> None:
        for w in self.workers:
            w.close()


def _forward_error(task: asyncio.Task[bytes], answers: asyncio.Queue[tuple[bytes | None, bool] | InferError]) -> None:
    """A request's batch failed (execute() raised, its worker died): the stream ends with that error."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        answers.put_nowait(exc if isinstance(exc, InferError) else InferError.internal(str(exc)))


def _cancel_if_cancelled(worker: ModelWorker, key: int, fut: asyncio.Future[object]) -> None:
    if fut.cancelled():
        worker.cancel(key)
