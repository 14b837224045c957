"""One loaded model version: request validation, batch execution, responses, statistics.

Validation works on metadata only (shape x element size = byte length; no numpy on the
event loop). Batches run in a worker thread per instance: inputs of the batch's requests
are joined into one buffer, viewed with numpy, run, and the outputs are sliced back into
one serialized response per request.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes, wire
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.infer_checks import mixed_contents, reject_mixed_contents
from meshserve.server.core import NO_HOP, Hop
from meshserve.telemetry import tracing
from meshserve.telemetry.model_stats import ModelStats
from meshserve.telemetry.spans import Span
from services.base import batch_trace
from services.base.runtime import RuntimeInstance
from services.base.scheduling.dynamic import DynamicBatcher
from services.base.scheduling.errors import (
    DeadlineExceededError,
    InternalBatchError,
    QueueFullError,
    UnavailableError,
)
from services.base.scheduling.policy import BatchingPolicy
from services.base.scheduling.request import QueuedRequest

_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension
    reshape: tuple[int, ...] | None  # shape the model sees (without batch dim)
    element_size: int  # 0 for BYTES
    optional: bool = False
    label_filename: str = ""

    @property
    def dtype(self) -> np.dtype:
        return datatypes.numpy_dtype(self.datatype)


def _spec_from_input(t: mc.ModelInput) -> TensorSpec:
    dt = datatypes.config_to_wire(t.data_type)
    return TensorSpec(t.name, dt, tuple(t.dims), tuple(t.reshape.shape) if t.HasField("reshape") else None,
                      datatypes.element_size(dt), optional=t.optional)


def _spec_from_output(t: mc.ModelOutput) -> TensorSpec:
    dt = datatypes.config_to_wire(t.data_type)
    return TensorSpec(t.name, dt, tuple(t.dims), tuple(t.reshape.shape) if t.HasField("reshape") else None,
                      datatypes.element_size(dt), label_filename=t.label_filename)


@dataclass(slots=True)
class InputData:
    spec: TensorSpec
    shape: tuple[int, ...]  # as sent by the client (incl. batch dim if any)
    data: bytes


@dataclass(slots=True)
class Pending:
    """Scheduler payload: a validated request."""

    request: pb.ModelInferRequest
    inputs: dict[str, InputData]
    outputs: list[tuple[str, int]]  # (output name, classification k or 0)
    rows: int
    signature: tuple  # shapes of non-batch dims; only equal signatures share a batch
    requests: int = 1  # client requests this one carries (a gateway may merge several)
    # the request's sampled spans, which its batch's spans hang off (tracing on; a request the
    # gateway forwarded has LateSpans: one per traced member of a merged request)
    spans: tuple[Span, ...] | tracing.LateSpans = ()


class ModelVersion:
    """A loaded (model, version) with its instances, batcher and statistics."""

    def __init__(self, config: mc.ModelConfig, version: int, model_dir: Path,
                 instances: list[RuntimeInstance], platform: str):
        self.config = config
        self.name = config.name
        self.version = version
        self.version_str = str(version)
        self.model_dir = model_dir
        self.platform = platform
        self.max_batch_size = config.max_batch_size
        self.inputs = {t.name: _spec_from_input(t) for t in config.input}
        self.outputs = {t.name: _spec_from_output(t) for t in config.output}
        self.required_inputs = [s.name for s in self.inputs.values() if not s.optional]
        # Ragged batching (Triton): ragged inputs are concatenated into one 1-D tensor; batch
        # inputs describe the batch to the model; batch outputs are scattered back per request.
        self.ragged = frozenset(t.name for t in config.input if t.allow_ragged_batch)
        self.batch_inputs = list(config.batch_input)
        self.scatter = {name: b.source_input[0] for b in config.batch_output for name in b.target_name
                        if b.source_input}
        self.all_outputs = [(name, 0) for name in self.outputs]
        self.stats = ModelStats(self.name, version)
        self._labels: dict[str, list[str]] = {}
        self._free = list(instances)
        self._instances = list(instances)
        self._pool = ThreadPoolExecutor(max_workers=len(instances), thread_name_prefix=f"{self.name}-{version}")
        dyn = config.dynamic_batching if config.HasField("dynamic_batching") else None
        self.policy = BatchingPolicy.from_config(config.max_batch_size, dyn)
        self._order_tail: asyncio.Future[None] | None = None
        self.batcher = DynamicBatcher(self.policy, self._execute, instance_count=len(instances),
                                      name=f"{self.name}:{version}")
        self.ready = True

    # ---- validation (event loop) -----------------------------------------------------
    def prepare(self, request: pb.ModelInferRequest, hop: Hop = NO_HOP) -> Pending:
        name = self.name
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            reject_mixed_contents(request)  # Triton names a typed contents first
            raise InferError.invalid(
                f"model '{name}': {len(raw)} raw_input_contents for {len(request.inputs)} inputs; "
                "every input needs exactly one raw entry")
        inputs: dict[str, InputData] = {}
        batch = -1
        sig: list[tuple[int, ...]] = []
        mbs = self.max_batch_size
        for i, t in enumerate(request.inputs):
            if raw and t.HasField("contents"):  # infer_checks.reject_mixed_contents, in this loop
                raise mixed_contents(t.name, name)
            spec = self.inputs.get(t.name)
            if spec is None:
                raise InferError.invalid(
                    f"unexpected inference input '{t.name}' for model '{name}'; "
                    f"model inputs are {sorted(self.inputs)}")
            if t.name in inputs:
                raise InferError.invalid(f"input '{t.name}' appears twice in the request for model '{name}'")
            if t.datatype != spec.datatype:
                raise InferError.invalid(
                    f"inference input '{t.name}' data-type is '{t.datatype}', but model '{name}' "
                    f"expects '{spec.datatype}'")
            shape = tuple(t.shape)
            if mbs > 0:
                if len(shape) != len(spec.dims) + 1 or not _dims_match(shape[1:], spec.dims):
                    raise InferError.invalid(
                        f"unexpected shape for input '{t.name}' for model '{name}'. Expected "
                        f"{[-1, *spec.dims]}, got {list(shape)}")
                if shape[0] < 1 or shape[0] > mbs:
                    raise InferError.invalid(
                        f"inference request batch-size must be <= {mbs} for model '{name}' "
                        f"(input '{t.name}' has batch {shape[0]})" if shape[0] > mbs else
                        f"input '{t.name}' for model '{name}' has batch size {shape[0]}; must be >= 1")
                if batch not in (-1, shape[0]):
                    raise InferError.invalid(
                        f"inputs of model '{name}' disagree on the batch size ({batch} vs {shape[0]} "
                        f"for input '{t.name}')")
                batch = shape[0]
            elif not _dims_match(shape, spec.dims):
                raise InferError.invalid(
                    f"unexpected shape for input '{t.name}' for model '{name}'. Expected "
                    f"{list(spec.dims)}, got {list(shape)}")
            if any(d < 0 for d in shape):
                raise InferError.invalid(f"input '{t.name}' for model '{name}' has a negative dimension {list(shape)}")
            data = raw[i] if raw else _typed_to_bytes(t, name)
            count = datatypes.element_count(shape)
            if spec.element_size:
                expected = count * spec.element_size
                if len(data) != expected:
                    raise InferError.invalid(
                        f"input '{t.name}' for model '{name}': shape {list(shape)} of {spec.datatype} needs "
                        f"{expected} bytes, got {len(data)}")
            else:
                got = datatypes.bytes_element_count(data)
                if got != count:
                    raise InferError.invalid(
                        f"input '{t.name}' for model '{name}': shape {list(shape)} needs {count} BYTES "
                        f"elements, got {got}")
            inputs[t.name] = InputData(spec, shape, data)
            sig.append(() if t.name in self.ragged else (shape[1:] if mbs > 0 else shape))
        if len(inputs) < len(self.inputs):
            missing = [n for n in self.required_inputs if n not in inputs]
            if missing:
                raise InferError.invalid(
                    f"expected {len(self.required_inputs)} inputs but got {len(inputs)} inputs for model "
                    f"'{name}'; missing {missing}")
        outputs = self.all_outputs
        if request.outputs:
            outputs = []
            for o in request.outputs:
                if o.name not in self.outputs:
                    raise InferError.invalid(
                        f"unexpected inference output '{o.name}' for model '{name}'; "
                        f"model outputs are {sorted(self.outputs)}")
                k = 0
                if "classification" in o.parameters:
                    k = _int_param(o.parameters["classification"])
                    if k < 0:
                        raise InferError.invalid(f"output '{o.name}': classification count must be >= 0")
                outputs.append((o.name, k))
        rows = batch if mbs > 0 else 1
        merged = hop.merged  # client requests a gateway merged into this one
        if merged is None:
            raise InferError.invalid(f"model '{name}': parameter '{wire.MERGED_PARAMETER}' must be an integer")
        if merged < 1 or merged > rows:
            raise InferError.invalid(f"parameter '{wire.MERGED_PARAMETER}' must be in 1..{rows}, got {merged}")
        return Pending(request, inputs, outputs, rows, tuple(sig), merged)

    # ---- scheduling ------------------------------------------------------------------
    async def infer(self, request: pb.ModelInferRequest, deadline_ns: int | None, hop: Hop = NO_HOP) -> bytes:
        try:
            pending = self.prepare(request, hop)
        except InferError:
            self.stats.record_failure(0, "OTHER")  # invalid request (counted in stats and /metrics)
            raise
        if tracing.enabled:
            pending.spans = tracing.request_spans()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[object] = loop.create_future()
        arrival = time.monotonic_ns()
        level, deadline_ns, delay_at = self._schedule_policy(request, arrival, deadline_ns)
        if hop.queued_ns is None:
            raise InferError.invalid(f"model '{self.name}': parameter '{wire.QUEUED_PARAMETER}' must be an integer")
        queued = QueuedRequest(rows=pending.rows, arrival_ns=arrival, priority=level, deadline_ns=deadline_ns,
                               delay_at_ns=delay_at, payload=pending, future=fut,
                               waited_ns=hop.queued_ns)  # waited in a gateway's coalescer
        self.stats.pending += 1
        try:
            try:
                self.batcher.enqueue(queued)
            except QueueFullError as exc:
                self.stats.record_failure(0, "REJECTED")
                raise InferError.exhausted(str(exc)) from None
            except UnavailableError as exc:
                raise InferError.unavailable(str(exc)) from None
            return await self._result(queued, self._in_order(fut) if self.policy.preserve_ordering else fut)
        finally:
            self.stats.pending -= 1

    async def _result(self, queued: QueuedRequest, outcome: Awaitable[object]) -> bytes:
        """Await a queued request's outcome, mapping scheduler errors to protocol errors."""
        try:
            return cast(bytes, await outcome)
        except DeadlineExceededError as exc:
            self.stats.record_failure(time.monotonic_ns() - queued.arrival_ns, "TIMEOUT")
            raise InferError(Code.DEADLINE_EXCEEDED, str(exc)) from None
        except UnavailableError as exc:
            raise InferError.unavailable(str(exc)) from None
        except InternalBatchError as exc:
            raise InferError.internal(f"model '{self.name}' version {self.version}: {exc}") from None

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

    def _schedule_policy(self, request: pb.ModelInferRequest, arrival: int, deadline_ns: int | None
                         ) -> tuple[int, int | None, int | None]:
        """(queue level, REJECT deadline, DELAY time) from Triton's schedule-policy extension:
        request parameters `priority` (1 = highest, 0 = default) and `timeout` (µs), the
        model's priority levels and queue policies, and the transport deadline (gRPC)."""
        params = request.parameters
        priority = 0
        if "priority" in params:
            priority = _int_param(params["priority"])
        policy = self.policy
        try:
            level = policy.level_for(priority)
        except ValueError as exc:
            raise InferError.invalid(f"model '{self.name}': {exc}") from None
        qp = policy.queue_policy(level)
        timeout_ns = qp.default_timeout_ns
        if "timeout" in params:
            requested = _int_param(params["timeout"])
            if requested < 0:
                raise InferError.invalid(f"model '{self.name}': timeout must be >= 0 µs, got {requested}")
            # Triton: a request's timeout replaces the default when the policy allows it, or
            # when the model sets no default timeout at all.
            if requested and (qp.allow_timeout_override or not qp.default_timeout_ns):
                timeout_ns = requested * 1000
        delay_at = None
        if timeout_ns:
            if qp.delay_on_timeout:
                delay_at = arrival + timeout_ns
            else:
                deadline_ns = arrival + timeout_ns if deadline_ns is None else min(deadline_ns, arrival + timeout_ns)
        return level, deadline_ns, delay_at

    async def _execute(self, batch: list[QueuedRequest]) -> None:
        """Run one batch on a free instance (worker thread); resolve every member future."""
        loop = asyncio.get_running_loop()
        instance = self._free.pop()
        start_ns = time.monotonic_ns()
        try:
            groups = _group_by_signature(batch)
            results: list[tuple[list[QueuedRequest], list[bytes] | BaseException, tuple[int, int, int]]] = []
            out: list[bytes] | BaseException
            for group in groups:
                try:
                    out, timing = await loop.run_in_executor(self._pool, self._run_group, instance, group)
                    results.append((group, out, timing))
                except BaseException as exc:  # noqa: BLE001 - a failing batch fails only its members
                    results.append((group, exc, (0, 0, 0)))
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
                err = out if isinstance(out, InferError) else InferError.internal(
                    f"model '{self.name}' version {self.version} failed to execute: {type(out).__name__}: {out}")
                for q in group:
                    stats.record_failure(end_ns - q.arrival_ns, "BACKEND", cast(Pending, q.payload).requests)
                    if not q.future.done():
                        q.future.set_exception(err)
                continue
            rows = sum(q.rows for q in group)
            stats.record_batch(rows, sum(cast(Pending, q.payload).requests for q in group), t_in, t_infer, t_out)
            for q, body in zip(group, out, strict=True):
                stats.record_success(end_ns - q.arrival_ns, start_ns - q.arrival_ns, cast(Pending, q.payload).requests)
                if not q.future.done():
                    q.future.set_result(body)

    # ---- compute (worker thread) -----------------------------------------------------
    def _run_group(self, instance: RuntimeInstance, group: Sequence[QueuedRequest]
                   ) -> tuple[list[bytes], tuple[int, int, int]]:
        t0 = time.perf_counter_ns()
        payloads: list[Pending] = [q.payload for q in group]  # type: ignore[misc]
        first = payloads[0]
        total_rows = sum(p.rows for p in payloads)
        batched = self.max_batch_size > 0
        feeds: dict[str, np.ndarray] = {}
        for name, item in first.inputs.items():
            spec = item.spec
            inner = item.shape[1:] if batched else item.shape
            if spec.element_size:
                buf = item.data if len(payloads) == 1 else b"".join(p.inputs[name].data for p in payloads)
                arr = np.frombuffer(buf, dtype=spec.dtype)
            else:
                arr = np.array([v for p in payloads for v in datatypes.deserialize_bytes(p.inputs[name].data)],
                               dtype=np.object_)
            if name in self.ragged:
                feeds[name] = arr.reshape(-1)  # the requests' elements back to back
                continue
            model_inner = spec.reshape if spec.reshape is not None else inner
            feeds[name] = arr.reshape((total_rows, *model_inner) if batched else model_inner)
        for b in self.batch_inputs:
            value = batch_input_value(b, [p.inputs[b.source_input[0]].shape for p in payloads]
                                      if b.source_input else [], datatypes.numpy_dtype(datatypes.config_to_wire(b.data_type)))
            for target in b.target_name:
                feeds[target] = value
        wanted = sorted({n for p in payloads for n, _ in p.outputs})
        t1 = time.perf_counter_ns()
        produced = instance.run(feeds, wanted)
        t2 = time.perf_counter_ns()
        bodies: list[bytes] = []
        row = 0
        scattered: dict[str, list[np.ndarray]] = {}
        for out_name, source in self.scatter.items():
            if out_name in produced:
                shapes = [p.inputs[source].shape for p in payloads]
                ends = np.cumsum([datatypes.element_count(s) for s in shapes])[:-1]
                flat = produced[out_name].reshape(-1)
                scattered[out_name] = [part.reshape(s) for part, s in zip(np.split(flat, ends), shapes, strict=True)]
        for i, p in enumerate(payloads):
            resp = pb.ModelInferResponse(model_name=self.name, model_version=self.version_str, id=p.request.id)
            for out_name, k in p.outputs:
                spec = self.outputs[out_name]
                full = produced[out_name]
                part = full[row:row + p.rows] if batched else full
                if out_name in scattered:
                    part = scattered[out_name][i]
                elif batched and spec.reshape is not None:
                    part = part.reshape((p.rows, *spec.dims))
                elif not batched and spec.reshape is not None:
                    part = part.reshape(spec.dims)
                if k:
                    part = self._classify(part, k, spec, batched)
                    datatype = "BYTES"
                else:
                    datatype = spec.datatype
                tensor = resp.outputs.add()
                tensor.name = out_name
                tensor.datatype = datatype
                tensor.shape.extend(part.shape)
                resp.raw_output_contents.append(_to_bytes(part, datatype))
            bodies.append(resp.SerializeToString())
            row += p.rows
        t3 = time.perf_counter_ns()
        return bodies, (t1 - t0, t2 - t1, t3 - t2)

    def _classify(self, arr: np.ndarray, k: int, spec: TensorSpec, batched: bool) -> np.ndarray:
        labels = self._labels_for(spec)
        rows = arr.reshape((arr.shape[0], -1)) if batched else arr.reshape((1, -1))
        k = min(k, rows.shape[1])
        out = []
        for r in rows:
            top = np.argsort(-r, kind="stable")[:k]
            out.append([f"{r[i]:f}:{i}" + (f":{labels[i]}" if i < len(labels) else "") for i in top])
        res = np.array(out, dtype=np.object_)
        return res if batched else res.reshape((k,))

    def _labels_for(self, spec: TensorSpec) -> list[str]:
        if not spec.label_filename:
            return []
        if spec.name not in self._labels:
            path = self.model_dir / spec.label_filename
            try:
                self._labels[spec.name] = path.read_text().splitlines()
            except OSError:
                self._labels[spec.name] = []
        return self._labels[spec.name]

    # ---- lifecycle ------------------------------------------------------------------
    async def close(self, drain: bool = True) -> None:
        self.ready = False
        await self.batcher.stop(drain=drain)
        self._pool.shutdown(wait=False)
        for inst in self._instances:
            inst.close()


def _dims_match(shape: Sequence[int], dims: Sequence[int]) -> bool:
    if len(shape) != len(dims):
        return False
    return all(d == -1 or d == s for s, d in zip(shape, dims, strict=True))


def _int_param(p: pb.InferParameter) -> int:
    which = p.WhichOneof("parameter_choice")
    if which in ("int64_param", "uint64_param"):
        return int(getattr(p, which))
    if which == "string_param" and p.string_param.lstrip("-").isdigit():
        return int(p.string_param)
    if which == "double_param" and float(p.double_param).is_integer():
        return int(p.double_param)
    raise InferError.invalid(f"parameter must be an integer, got {which}")


def _typed_to_bytes(t: pb.ModelInferRequest.InferInputTensor, model: str) -> bytes:
    """Typed InferTensorContents (KServe SDK, hand-written stubs) -> raw little-endian bytes."""
    field_name = _CONTENTS_FIELD.get(t.datatype)
    if field_name is None:
        raise InferError.invalid(
            f"input '{t.name}' for model '{model}': datatype {t.datatype} cannot travel in typed "
            "contents; use raw_input_contents")
    values = getattr(t.contents, field_name)
    if t.datatype == "BYTES":
        return datatypes.serialize_bytes(values)
    try:
        return np.asarray(values, dtype=datatypes.numpy_dtype(t.datatype)).tobytes()
    except (OverflowError, ValueError) as exc:
        raise InferError.invalid(f"input '{t.name}' for model '{model}': {exc}") from None


def _to_bytes(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return datatypes.serialize_bytes(arr.reshape(-1).tolist())
    want = datatypes.numpy_dtype(datatype)
    if arr.dtype != want:
        arr = arr.astype(want)
    return arr.tobytes()


def _group_by_signature(batch: list[QueuedRequest]) -> list[list[QueuedRequest]]:
    first = batch[0].payload.signature  # type: ignore[attr-defined]
    if all(q.payload.signature == first for q in batch):  # type: ignore[attr-defined]
        return [batch]
    groups: dict[tuple, list[QueuedRequest]] = {}
    for q in batch:
        groups.setdefault(q.payload.signature, []).append(q)  # type: ignore[attr-defined]
    return list(groups.values())


def batch_input_value(b: mc.BatchInput, shapes: list[tuple[int, ...]], dtype: np.dtype) -> np.ndarray:
    """The tensor Triton generates for a `batch_input` from the source input's per-request shapes."""
    counts = [datatypes.element_count(s) for s in shapes]
    kind = b.kind
    if kind == mc.BatchInput.BATCH_ELEMENT_COUNT:
        return np.asarray(counts, dtype=dtype)
    if kind == mc.BatchInput.BATCH_ACCUMULATED_ELEMENT_COUNT:
        return np.cumsum(counts).astype(dtype)
    if kind == mc.BatchInput.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
        return np.concatenate([[0], np.cumsum(counts)]).astype(dtype)
    if kind == mc.BatchInput.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
        return np.zeros((max(counts, default=0),), dtype=dtype)
    items = [s[1:] for s in shapes]  # each request's shape without its batch dimension
    if kind == mc.BatchInput.BATCH_ITEM_SHAPE:
        return np.asarray(items, dtype=dtype).reshape(len(items), -1)
    if kind == mc.BatchInput.BATCH_ITEM_SHAPE_FLATTEN:
        return np.asarray(items, dtype=dtype).reshape(-1)
    raise InferError.unsupported(f"batch_input kind {kind} is not supported")
