"""One loaded model version: its instances, scheduler and statistics.

A request is validated on the event loop (:mod:`services.base.validation`: metadata only, no
numpy), queued on the version's :class:`~services.base.scheduling.Scheduler` (the dynamic
batcher here; :mod:`services.sequence.model` puts a sequence batcher in its place), and its
batch runs in a worker thread per instance (on the event loop where that batch size was measured
to run in microseconds: ``INLINE_RUN_NS``): the batch's inputs are joined into one buffer per
input (:mod:`services.base.batching`), run, and the outputs sliced back into one serialized
response per request (:mod:`services.base.serialization`).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn, cast

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.hop import NO_HOP, QUEUED, Hop
from meshserve.server.admission import RETRY_AFTER_S
from meshserve.telemetry import tracing
from meshserve.telemetry.model_stats import ModelStats
from services.base import batch_trace, batching
from services.base.runtime import RuntimeInstance, RuntimeLoadError, config_parameter
from services.base.scheduling.dynamic import DynamicBatcher
from services.base.scheduling.errors import (
    DeadlineExceededError,
    InternalBatchError,
    QueueFullError,
    UnavailableError,
)
from services.base.scheduling.policy import BatchingPolicy
from services.base.scheduling.request import QueuedRequest, Scheduler
from services.base.scheduling.sequence import SequenceStartError
from services.base.serialization import ResponseEncoder
from services.base.validation import ModelTensors, Pending, prepare, schedule_policy
from services.base.worker import InstanceWorker

# A group whose runtime call was measured at most this long (its fastest run at that size: rows
# and input shapes) runs on the event loop instead of the instance's worker thread: the hand-off
# costs more than the loop could do meanwhile. Measured (2-core box, uvloop,
# docs/perf/service-inline-runs.md): a run_in_executor round trip costs ~19 us of CPU and two
# thread wake-ups, and the result waits for the GIL when the loop is busy; onnxruntime runs
# add_sub (2 intra-op threads) in 5-22 us of wall time for 1-64 rows, mlp in 1.0-5.5 ms. A size
# not run yet goes to the thread. MESHSERVE_INLINE_RUN_US overrides it (0: never inline; under
# valgrind every run is ~1000x longer).
INLINE_RUN_NS = int(os.environ.get("MESHSERVE_INLINE_RUN_US", "50")) * 1000
# The dynamic batcher's early release (DynamicBatcher: a batch whose expected clients are all
# queued runs before max_queue_delay): on unless MESHSERVE_EARLY_RELEASE=0 turns the default off;
# a model's config decides for itself with parameters { key: "meshserve_early_release" ... }.
EARLY_RELEASE_PARAMETER = "meshserve_early_release"
EARLY_RELEASE = os.environ.get("MESHSERVE_EARLY_RELEASE", "1") != "0"
_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}
_UNMEASURED = 1 << 62
_SIZES_MAX = 4096  # run sizes remembered per version (variable dimensions) before starting over


def early_release(config: mc.ModelConfig) -> bool:
    """Whether the model's dynamic batcher releases early (``EARLY_RELEASE_PARAMETER``, "true" or
    "false"; absent: ``EARLY_RELEASE``); RuntimeLoadError for any other value."""
    raw = config_parameter(config, EARLY_RELEASE_PARAMETER)
    if raw is None:
        return EARLY_RELEASE
    value = _BOOLEANS.get(raw.strip().lower())
    if value is None:
        raise RuntimeLoadError(f"model '{config.name}': parameter '{EARLY_RELEASE_PARAMETER}' must be "
                               f"\"true\" or \"false\", got '{raw}'")
    return value


class ModelVersion:
    """A loaded (model, version) with its instances, scheduler and statistics."""

    def __init__(self, config: mc.ModelConfig, version: int, model_dir: Path,
                 instances: list[RuntimeInstance], platform: str):
        self.config = config
        self.name = config.name
        self.version = version
        self.version_str = str(version)
        self.model_dir = model_dir
        self.platform = platform
        self.max_batch_size = config.max_batch_size
        self.tensors = ModelTensors.from_config(config)
        self.inputs = self.tensors.inputs
        self.outputs = self.tensors.outputs
        # (its labels: set by the load, which reads them before any instance: services/base/core.py)
        self.encoder = ResponseEncoder(self.tensors, self.version_str)
        self.stats = ModelStats(self.name, version)
        # model_transaction_policy { decoupled: true }: zero or more responses per request
        # (infer_stream); only kinds that can run such models (python) load them
        self.decoupled = config.model_transaction_policy.decoupled
        self._free = list(instances)
        self._instances = list(instances)
        # (the sequence batcher's runs; the dynamic batcher's go to each instance's own worker)
        self._pool = ThreadPoolExecutor(max_workers=len(instances), thread_name_prefix=f"{self.name}-{version}")
        self._workers = {id(inst): InstanceWorker(f"{self.name}-{version}_{k}") for k, inst in enumerate(instances)}
        self._order_tail: asyncio.Future[None] | None = None
        # (group rows, input shapes) -> the fastest runtime call of that size (INLINE_RUN_NS)
        self._fastest_ns: dict[tuple[int, tuple], int] = {}
        # sizes say how long a run takes unless an input's size is not in its shape (ragged
        # inputs, BYTES elements): those models always run on the worker thread
        self._inline_ok = not self.tensors.ragged and all(s.element_size for s in self.inputs.values())
        self._ordered = False  # preserve_ordering (dynamic batching)
        self.scheduler: Scheduler[Pending] = self._scheduler(config, len(instances))
        self.ready = True
        # services/base/memory.py: the measured size (set once loaded) and when it was loaded
        self.memory_bytes = 0
        self.gpu_bytes: dict[int, int] = {}  # GPU -> device bytes of its instances there (KIND_GPU)
        self.loaded_ms = time.time() * 1000

    @property
    def instances(self) -> list[RuntimeInstance]:
        return self._instances

    def last_used_ms(self) -> float:
        """When a request last ran on this version (its load, before any did): the eviction order."""
        return max(self.stats.last_inference_ms, self.loaded_ms)

    async def runtime_ready(self) -> str | None:
        """Beyond being loaded: None when the version's instances can serve, else why not (the
        python backend's workers and their ``is_ready()``: PythonModelVersion). A runtime held in
        this process is ready while it is loaded."""
        return None

    def busy(self) -> bool:
        """Requests in flight (queued, executing, or awaiting their answer) or a live sequence:
        an eviction never unloads a busy version."""
        scheduler = self.scheduler
        active = getattr(scheduler, "active_sequences", None)
        return self.stats.pending > 0 or scheduler.inflight() > 0 or (active is not None and active() > 0)

    def _scheduler(self, config: mc.ModelConfig, instance_count: int) -> Scheduler[Pending]:
        """The dynamic batcher (Triton's ``dynamic_batching``, or one request per batch without
        it); a sequence model version puts its sequence batcher here instead."""
        dyn = config.dynamic_batching if config.HasField("dynamic_batching") else None
        if any(getattr(i, "runs_alone", False) for i in self._instances):
            dyn = None  # a graph that takes a true scalar per run: each request runs alone
        self.policy = BatchingPolicy.from_config(config.max_batch_size, dyn)
        self._ordered = self.policy.preserve_ordering
        self.batcher = DynamicBatcher[Pending](self.policy, self._execute, instance_count=instance_count,
                                               name=f"{self.name}:{self.version}",
                                               early_release=early_release(config))
        return self.batcher

    def prepare(self, request: pb.ModelInferRequest, hop: Hop = NO_HOP) -> Pending:
        """Validate ``request`` for this model (InferError INVALID_ARGUMENT if it does not fit)."""
        return prepare(self.tensors, request, hop)

    # ---- scheduling (event loop) -----------------------------------------------------
    async def infer(self, request: pb.ModelInferRequest, deadline_ns: int | None, hop: Hop = NO_HOP) -> bytes:
        try:
            pending = self.prepare(request, hop)
        except InferError:
            self.stats.record_failure(0, "OTHER")  # invalid request (counted in stats and /metrics)
            raise
        if tracing.enabled:
            pending.spans = tracing.request_spans()
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        queued = self._queued(request, pending, deadline_ns, hop, fut)
        self._enqueue(queued)
        if self._ordered:
            try:
                return await self._result(queued, self._in_order(fut))
            finally:
                del fut, queued  # (as below)
        # _result's work without its coroutine (one fewer per request)
        try:
            return cast(bytes, await fut)
        except BaseException as exc:
            self._failed(queued, exc)
        finally:
            self.stats.pending -= 1
            # (a failed future holds its error, whose traceback holds this frame: no local keeps
            # it, nor the request: docs/security.md, "Session 11: error cycles")
            del fut, queued

    def infer_stream(self, request: pb.ModelInferRequest, deadline_ns: int | None,
                     hop: Hop = NO_HOP) -> AsyncGenerator[tuple[bytes | None, bool], None]:
        """A decoupled model's responses to one request (kinds that serve decoupled models
        override it; ServiceCore calls it only when ``decoupled`` is set)."""
        raise InferError.unsupported(f"model '{self.name}': decoupled models are not served by this service")

    def _queued(self, request: pb.ModelInferRequest, pending: Pending, deadline_ns: int | None, hop: Hop,
                fut: asyncio.Future[object]) -> QueuedRequest[Pending]:
        """The scheduler's entry for a validated request: its queue level, deadline and DELAY
        time (Triton's schedule-policy parameters) and the time it already waited in a gateway."""
        arrival = time.monotonic_ns()
        level, deadline_ns, delay_at = schedule_policy(self.policy, self.name, request, arrival, deadline_ns)
        if hop.queued_ns is None:
            raise InferError.invalid(f"model '{self.name}': parameter '{QUEUED}' must be an integer")
        return QueuedRequest(rows=pending.rows, arrival_ns=arrival, priority=level, deadline_ns=deadline_ns,
                             delay_at_ns=delay_at, payload=pending, future=fut,
                             waited_ns=hop.queued_ns,  # waited in a gateway's coalescer
                             members=hop.merged or 1)

    def _enqueue(self, queued: QueuedRequest[Pending]) -> None:
        """Queue a request on the scheduler (pending in the statistics until ``_result`` ends),
        mapping the scheduler's refusals to protocol errors."""
        stats = self.stats
        try:
            self.scheduler.enqueue(queued)
        except QueueFullError as exc:
            stats.record_failure(0, "REJECTED")
            raise InferError.exhausted(str(exc), retry_after_s=RETRY_AFTER_S) from None
        except SequenceStartError as exc:
            stats.record_failure(0, "OTHER")
            raise InferError.invalid(str(exc)) from None
        except UnavailableError as exc:
            raise InferError.unavailable(str(exc)) from None
        stats.pending += 1

    async def _result(self, queued: QueuedRequest[Pending], outcome: Awaitable[object]) -> bytes:
        """Await a queued request's outcome, mapping scheduler errors to protocol errors."""
        try:
            body = await outcome
        except BaseException as exc:
            self._failed(queued, exc)
        finally:
            self.stats.pending -= 1
            del queued, outcome  # (as infer's)
        return cast(bytes, body)

    def _failed(self, queued: QueuedRequest[Pending], exc: BaseException) -> NoReturn:
        """Raise what a queued request whose outcome raised ``exc`` raises (called while handling
        it): scheduler errors mapped to protocol errors (a deadline and a client that left counted
        in the statistics); anything else as it is."""
        try:
            if isinstance(exc, DeadlineExceededError):
                self.stats.record_failure(time.monotonic_ns() - queued.arrival_ns, "TIMEOUT")
                raise InferError(Code.DEADLINE_EXCEEDED, str(exc)) from None
            if isinstance(exc, UnavailableError):
                raise InferError.unavailable(str(exc)) from None
            if isinstance(exc, InternalBatchError):
                raise InferError.internal(f"model '{self.name}' version {self.version}: {exc}") from None
            if isinstance(exc, asyncio.CancelledError) and queued.future.cancelled():
                # the client left: counted here, once (its batch, if any, skips it)
                self.stats.record_failure(time.monotonic_ns() - queued.arrival_ns, "CANCELED", queued.payload.requests)
            raise exc
        finally:
            # (the raised error's traceback holds this frame, and the request's future holds
            # the error: neither stays in a local, docs/security.md, "Session 11: error cycles")
            del exc, queued

    async def _in_order(self, fut: asyncio.Future[object]) -> object:
        """preserve_ordering: a response leaves only after every earlier-enqueued one has
        (batches on several instances can finish out of order). Called right after enqueue,
        so the chain follows enqueue order."""
        prev, done = self._order_tail, asyncio.get_running_loop().create_future()
        self._order_tail = done
        try:
            try:
                return await fut
            finally:
                if prev is not None and not prev.done():
                    await asyncio.shield(prev)
        finally:
            if not done.done():
                done.set_result(None)
            del fut  # (as infer's)

    async def _execute(self, batch: list[QueuedRequest[Pending]]) -> None:
        """Run one batch on a free instance (on the event loop; the group itself runs in
        `_run_group` on the instance's worker thread, or inline where measured to be quick);
        resolve every member future."""
        loop = asyncio.get_running_loop()
        instance = self._free.pop()
        start_ns = time.monotonic_ns()
        try:
            groups = batching.group_by_signature(batch)
            results: list[tuple[list[QueuedRequest[Pending]], list[bytes | InferError] | BaseException, tuple[int, int, int]]] = []
            out: list[bytes | InferError] | BaseException
            fastest = self._fastest_ns
            for group in groups:
                payloads = [q.payload for q in group]
                # the run's size: its rows and the members' (equal) input shapes
                size = (sum(p.rows for p in payloads), payloads[0].signature)
                try:
                    if fastest.get(size, _UNMEASURED) <= INLINE_RUN_NS:
                        out, timing = self._run_group(instance, payloads)
                    else:
                        out, timing = await self._workers[id(instance)].submit(loop, self._run_group, instance, payloads)
                    if self._inline_ok and timing[1] < fastest.get(size, _UNMEASURED):
                        if len(fastest) >= _SIZES_MAX:
                            fastest.clear()
                        fastest[size] = timing[1]
                    results.append((group, out, timing))
                except BaseException as exc:  # a failing batch fails only its members
                    # (without its traceback, which no log shows: it holds this frame, which holds
                    # the batch whose futures fail with it, a cycle only the collector frees,
                    # keeping every member's request: docs/security.md, "Session 11: error cycles")
                    results.append((group, exc.with_traceback(None), (0, 0, 0)))
        finally:
            self._free.append(instance)
        end_ns = time.monotonic_ns()
        # Pipelining: hand the instance to the next batch before delivering this one's results,
        # and let the batcher dispatch it first, so the runtime is not idle while responses are
        # written (measured: ~1 ms of idle instance per mlp batch-64 request otherwise).
        self.batcher.release(batch)
        await asyncio.sleep(0)
        if tracing.enabled and batch_trace.traced(batch):
            # after the results below are written: spans are not what clients wait for
            tracing.defer(batch_trace.record, self.name, self.version_str,
                          self._instances.index(instance), batch, results, start_ns, end_ns)
        stats = self.stats
        for group, out, (t_in, t_infer, t_out) in results:
            if isinstance(out, BaseException):
                err = self._failure(out)
                for q in group:
                    if not q.future.done():
                        stats.record_failure(end_ns - q.arrival_ns, "BACKEND", q.payload.requests)
                        q.future.set_exception(err)
                continue
            rows = sum(q.rows for q in group)
            stats.record_batch(rows, sum(q.payload.requests for q in group), t_in, t_infer, t_out)
            answered: list[tuple[int, int]] = []
            for q, body in zip(group, out, strict=True):
                fut = q.future
                if not fut.done():  # (a cancelled one is counted by _result)
                    if isinstance(body, InferError):  # this request's own (its classification)
                        stats.record_failure(end_ns - q.arrival_ns, "BACKEND", q.payload.requests)
                        fut.set_exception(body)
                        continue
                    fut.set_result(body)
                    answered.append((q.arrival_ns, q.payload.requests))
            stats.record_successes(end_ns, start_ns, answered)

    def _failure(self, exc: BaseException) -> InferError:
        """What the members of a group whose run raised ``exc`` fail with (a cancelled run is
        the server stopping, not the model failing: UNAVAILABLE, as for a request refused then)."""
        if isinstance(exc, InferError):
            return exc
        if isinstance(exc, asyncio.CancelledError):
            return InferError.unavailable(f"model '{self.name}' version {self.version}: its run was cancelled")
        return InferError.internal(
            f"model '{self.name}' version {self.version} failed to execute: {type(exc).__name__}: {exc}")

    # ---- compute (worker thread) -----------------------------------------------------
    def _run_group(self, instance: RuntimeInstance, payloads: Sequence[Pending]
                   ) -> tuple[list[bytes | InferError], tuple[int, int, int]]:
        """Run one group (requests with equal input shapes): its serialized responses (or a
        request's own error: ResponseEncoder.encode) and the
        (input, infer, output) nanoseconds the statistics report."""
        t0 = time.perf_counter_ns()
        feeds = batching.feeds(self.tensors, payloads, sum(p.rows for p in payloads))
        wanted = sorted({n for p in payloads for n, _ in p.outputs})
        t1 = time.perf_counter_ns()
        produced = instance.run(feeds, wanted)
        t2 = time.perf_counter_ns()
        bodies = self.encoder.encode(payloads, produced)
        t3 = time.perf_counter_ns()
        return bodies, (t1 - t0, t2 - t1, t3 - t2)

    # ---- lifecycle ------------------------------------------------------------------
    async def close(self, drain: bool = True) -> None:
        self.ready = False
        await self.scheduler.stop(drain=drain)
        self._pool.shutdown(wait=False)
        for worker in self._workers.values():
            worker.close()
        for inst in self._instances:
            inst.close()
