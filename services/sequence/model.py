"""A loaded stateful model version: sequence parameters, control inputs, implicit state.

Reuses :class:`~services.base.model.ModelVersion` for validation, batch assembly and
response encoding; its scheduler is a :class:`~services.base.scheduling.sequence.SequenceBatcher`
instead of the dynamic batcher. Control tensors (START, END, READY, CORRID) and state inputs
are added to the feeds inside the worker thread by a thin wrapper around the runtime instance,
which also captures the state outputs.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from meshserve.protocol.hop import NO_HOP, Hop
from meshserve.protocol.infer_checks import check_sequence_id
from meshserve.repository.config import sequence_slots
from meshserve.telemetry import tracing
from services.base import batch_trace
from services.base.model import ModelVersion
from services.base.runtime import RuntimeInstance
from services.base.scheduling.request import QueuedRequest, Scheduler
from services.base.scheduling.sequence import (
    BatchRow,
    SequenceBatch,
    SequenceBatcher,
    SequenceControl,
    SequencePolicy,
)
from services.base.validation import InputData, Pending

_Kind = mc.ModelSequenceBatching.Control
_UINT64 = 1 << 64
_INT_CORRID = {mc.TYPE_UINT64: np.uint64, mc.TYPE_INT64: np.int64, mc.TYPE_UINT32: np.uint32,
               mc.TYPE_INT32: np.int32}


@dataclass(frozen=True)
class ControlSpec:
    """One injected control tensor: its name, kind and the numpy values for false / true."""

    name: str
    kind: int
    dtype: Any
    false_true: tuple[Any, Any] = (0, 1)


@dataclass(frozen=True)
class StateSpec:
    """One implicit state: fed as ``input_name``, stored from ``output_name``."""

    input_name: str
    output_name: str
    dtype: Any
    initial: np.ndarray  # one sequence's initial value (no batch dimension)


def parse_controls(sb: mc.ModelSequenceBatching) -> list[ControlSpec]:
    out = []
    for ci in sb.control_input:
        for ctl in ci.control:
            if ctl.kind == _Kind.CONTROL_SEQUENCE_CORRID:
                dtype = _INT_CORRID.get(ctl.data_type, np.object_)
                out.append(ControlSpec(ci.name, ctl.kind, dtype))
            elif ctl.int32_false_true:
                out.append(ControlSpec(ci.name, ctl.kind, np.int32, tuple(ctl.int32_false_true)[:2]))  # type: ignore[arg-type]
            elif ctl.fp32_false_true:
                out.append(ControlSpec(ci.name, ctl.kind, np.float32, tuple(ctl.fp32_false_true)[:2]))  # type: ignore[arg-type]
            else:
                out.append(ControlSpec(ci.name, ctl.kind, np.bool_, tuple(ctl.bool_false_true)[:2]))  # type: ignore[arg-type]
    return out


def parse_states(sb: mc.ModelSequenceBatching, model_dir: Path, model: str) -> list[StateSpec]:
    out = []
    for st in sb.state:
        dt = datatypes.config_to_wire(st.data_type)
        dtype = datatypes.numpy_dtype(dt)
        dims = [max(d, 1) for d in st.dims]  # a variable dim starts at 1
        initial = np.zeros(dims, dtype=dtype) if dt != "BYTES" else np.full(dims, b"", dtype=np.object_)
        if st.initial_state:
            init = st.initial_state[0]
            shape = list(init.dims) or dims
            if init.WhichOneof("state_data") == "data_file":
                path = model_dir / "initial_state" / init.data_file
                try:
                    raw = path.read_bytes()
                except OSError as exc:
                    raise InferError.invalid(
                        f"model '{model}': initial state file for '{st.input_name}' unreadable: {exc}") from None
                want = datatypes.element_count(shape) * dtype.itemsize
                if dt == "BYTES" or len(raw) != want:
                    raise InferError.invalid(
                        f"model '{model}': initial state file {path} has {len(raw)} bytes, expected {want} "
                        f"({dt} {shape})")
                initial = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
            else:
                initial = np.zeros(shape, dtype=dtype) if dt != "BYTES" else np.full(shape, b"", dtype=np.object_)
        out.append(StateSpec(st.input_name, st.output_name, dtype, initial))
    return out


def policy_from_config(config: mc.ModelConfig, instance_count: int) -> SequencePolicy:
    sb = config.sequence_batching
    slots = max(1, config.max_batch_size)
    idle_ns = int(sb.max_sequence_idle_microseconds or 1_000_000) * 1000
    if sb.WhichOneof("strategy_choice") == "oldest":
        o = sb.oldest
        # Triton's candidates, per instance (sequence_slots); our oldest batcher shares them
        # between the instances: as many in all. 0 left the candidates unbounded (every sequence
        # started and left open held its id and state until it went idle), and a set value held
        # that many in all, not per instance (docs/security.md, "Session 22: sequence ids").
        return SequencePolicy("oldest", slots, instance_count, sequence_slots(config, instance_count),
                              tuple(sorted({int(s) for s in o.preferred_batch_size})),
                              int(o.max_queue_delay_microseconds) * 1000, idle_ns=idle_ns)
    d = sb.direct
    return SequencePolicy("direct", slots, instance_count, max_queue_delay_ns=int(d.max_queue_delay_microseconds) * 1000,
                          minimum_slot_utilization=float(d.minimum_slot_utilization), idle_ns=idle_ns)


def _flag(p: pb.InferParameter, name: str) -> bool:
    which = p.WhichOneof("parameter_choice")
    if which == "bool_param":
        return bool(p.bool_param)
    if which in ("int64_param", "uint64_param"):
        return bool(getattr(p, which))
    if which == "string_param" and p.string_param.lower() in ("true", "false", "1", "0"):
        return p.string_param.lower() in ("true", "1")
    raise InferError.invalid(f"parameter '{name}' must be a boolean, got {which}")


def sequence_control(request: pb.ModelInferRequest, model: str, required: bool = True) -> SequenceControl:
    """The correlation id and flags of a request (every integer oneof member is accepted); a
    request without one (absent, 0 or "") is refused, or with ``required`` False (an iterative
    sequence's: services/python/model.py) its control has corrid 0."""
    params = request.parameters
    corrid: int | str = 0
    if "sequence_id" in params:
        p = params["sequence_id"]
        which = p.WhichOneof("parameter_choice")
        if which == "int64_param":
            corrid = p.int64_param % _UINT64  # uint64 ids travel as int64 (two's complement)
        elif which == "uint64_param":
            corrid = p.uint64_param
        elif which == "string_param":
            corrid = check_sequence_id(p.string_param)
        elif which == "double_param" and float(p.double_param).is_integer() and p.double_param >= 0:
            corrid = int(p.double_param)
        else:
            raise InferError.invalid(
                f"inference request to model '{model}': parameter 'sequence_id' must be an unsigned "
                f"integer or a string, got {which}")
    if (corrid == 0 or corrid == "") and required:
        raise InferError.invalid(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID")
    start = _flag(params["sequence_start"], "sequence_start") if "sequence_start" in params else False
    end = _flag(params["sequence_end"], "sequence_end") if "sequence_end" in params else False
    return SequenceControl(corrid, start, end)


class _Injecting:
    """Wraps an instance for one batch: adds control/state feeds, captures state outputs."""

    def __init__(self, inner: RuntimeInstance, extra: dict[str, np.ndarray], state_outputs: list[str]):
        self.inner = inner
        self.extra = extra
        self.state_outputs = state_outputs
        self.captured: dict[str, np.ndarray] = {}

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        feeds = {**inputs, **self.extra}
        names = list(output_names) + [n for n in self.state_outputs if n not in output_names]
        out = self.inner.run(feeds, names)
        self.captured = {n: out[n] for n in self.state_outputs}
        return out

    def close(self) -> None:
        pass


class SequenceModelVersion(ModelVersion):
    """A model version with ``sequence_batching``: one SequenceBatcher, per-sequence state."""

    def __init__(self, config: mc.ModelConfig, version: int, model_dir: Path,
                 instances: list[RuntimeInstance], platform: str):
        super().__init__(config, version, model_dir, instances, platform)
        sb = config.sequence_batching
        self.controls = parse_controls(sb)
        self.states = parse_states(sb, model_dir, self.name)
        hidden = {c.name for c in self.controls} | {s.input_name for s in self.states}
        clash = hidden & set(self.inputs)
        if clash:
            raise InferError.invalid(
                f"model '{self.name}': {sorted(clash)} are control or state inputs of sequence_batching "
                "and must not be listed as model inputs")

    def _scheduler(self, config: mc.ModelConfig, instance_count: int) -> Scheduler[Pending]:
        self.sequence_policy = policy_from_config(config, instance_count)
        return SequenceBatcher[Pending](self.sequence_policy, self._execute_sequence, name=self.name)

    # ---- scheduling (event loop) -----------------------------------------------------
    def prepare(self, request: pb.ModelInferRequest, hop: Hop = NO_HOP) -> Pending:
        """The request's sequence control, checked, then ModelVersion's validation (batch size 1)."""
        control = sequence_control(request, self.name)
        if isinstance(control.corrid, str) and any(
                c.kind == _Kind.CONTROL_SEQUENCE_CORRID and c.dtype is not np.object_ for c in self.controls):
            raise InferError.invalid(
                f"inference request to model '{self.name}': string correlation ID '{control.corrid}' "
                "but the CORRID control input has an integer data_type")
        pending = super().prepare(request, hop)
        if self.max_batch_size > 0 and pending.rows != 1:
            raise InferError.invalid(
                f"inference request to model '{self.name}' must specify batch-size 1 due to requirements "
                f"of sequence batcher (got {pending.rows})")
        pending.sequence = control
        return pending

    def _queued(self, request: pb.ModelInferRequest, pending: Pending, deadline_ns: int | None, hop: Hop,
                fut: asyncio.Future[object]) -> QueuedRequest[Pending]:
        return QueuedRequest(rows=1, arrival_ns=time.monotonic_ns(), deadline_ns=deadline_ns, payload=pending,
                             future=fut, sequence=pending.sequence)

    async def _execute_sequence(self, batch: SequenceBatch) -> None:
        loop = asyncio.get_running_loop()
        instance = self._instances[batch.instance]
        start_ns = time.monotonic_ns()
        groups = _groups(batch.rows)
        results: list[tuple[list[BatchRow], Any]] = []
        for rows in groups:
            try:
                res = await loop.run_in_executor(self._pool, self._run_rows, instance, rows)
                results.append((rows, res))
            except BaseException as exc:  # a failing group fails only its members
                results.append((rows, exc))
        end_ns = time.monotonic_ns()
        if tracing.enabled and batch_trace.traced(batch.requests):
            traced = [([r.request for r in rows if r.request is not None],
                       res if isinstance(res, BaseException) else None, (0, 0, 0) if isinstance(res, BaseException)
                       else res[2]) for rows, res in results]
            # after the results delivered below are written: spans are not what clients wait for
            tracing.defer(batch_trace.record, self.name, self.version_str, batch.instance,
                          batch.requests, traced, start_ns, end_ns)
        stats = self.stats
        for rows, res in results:
            real = [r for r in rows if r.request is not None]
            if isinstance(res, BaseException):
                err = self._failure(res)
                for r in real:
                    assert r.request is not None
                    if not r.request.future.done():  # (a cancelled one is counted by ModelVersion._result)
                        stats.record_failure(end_ns - r.request.arrival_ns, "BACKEND")
                        r.request.future.set_exception(err)
                continue
            bodies, new_states, (t_in, t_infer, t_out) = res
            stats.record_batch(len(real), len(real), t_in, t_infer, t_out)
            for r, body, state in zip(rows, bodies, new_states, strict=True):
                if r.request is None:
                    continue
                if r.sequence is not None and self.states:
                    r.sequence.state = state
                if not r.request.future.done():
                    if isinstance(body, InferError):  # this request's own (its classification)
                        stats.record_failure(end_ns - r.request.arrival_ns, "BACKEND")
                        r.request.future.set_exception(body)
                        continue
                    stats.record_success(end_ns - r.request.arrival_ns, start_ns - r.request.arrival_ns)
                    r.request.future.set_result(body)

    # ---- compute (worker thread) -----------------------------------------------------
    def _run_rows(self, instance: RuntimeInstance, rows: Sequence[BatchRow]
                  ) -> tuple[list[bytes | InferError], list[dict[str, np.ndarray] | None], tuple[int, int, int]]:
        first = next(cast(Pending, r.request.payload) for r in rows if r.request is not None)
        payloads = [cast(Pending, r.request.payload) if r.request is not None else _filler(first) for r in rows]
        batched = self.max_batch_size > 0
        n = len(rows)
        extra: dict[str, np.ndarray] = {}
        for c in self.controls:
            extra[c.name] = self._control_tensor(c, rows, batched)
        prior: list[dict[str, np.ndarray] | None] = []
        for r in rows:
            seq = r.sequence
            fresh = r.control is not None and r.control.start
            prior.append(None if seq is None or fresh else cast("dict[str, np.ndarray] | None", seq.state))
        for s in self.states:
            values = [p[s.input_name] if p is not None else s.initial for p in prior]
            extra[s.input_name] = np.stack(values) if batched else values[0]
        wrapped = _Injecting(instance, extra, [s.output_name for s in self.states])
        bodies, timing = self._run_group(wrapped, payloads)
        new_states: list[dict[str, np.ndarray] | None] = [None] * n
        if self.states:
            for i in range(n):
                if rows[i].request is None:
                    continue
                st = {}
                for s in self.states:
                    full = np.asarray(wrapped.captured[s.output_name])
                    st[s.input_name] = (full[i] if batched else full).astype(s.dtype, copy=True)
                new_states[i] = st
        return bodies, new_states, timing

    def _control_tensor(self, c: ControlSpec, rows: Sequence[BatchRow], batched: bool) -> np.ndarray:
        values: list[Any] = []
        for r in rows:
            ctl = r.control
            if c.kind == _Kind.CONTROL_SEQUENCE_CORRID:
                corrid = ctl.corrid if ctl is not None else (r.sequence.corrid if r.sequence is not None else 0)
                if c.dtype is np.object_:
                    values.append(str(corrid).encode())
                else:
                    values.append(int(corrid) if isinstance(corrid, int) else 0)
                continue
            if c.kind == _Kind.CONTROL_SEQUENCE_START:
                on = ctl is not None and ctl.start
            elif c.kind == _Kind.CONTROL_SEQUENCE_END:
                on = ctl is not None and ctl.end
            elif c.kind == _Kind.CONTROL_SEQUENCE_READY:
                on = r.request is not None
            else:
                on = False
            values.append(c.false_true[1 if on else 0])
        arr = np.array(values, dtype=c.dtype)
        return arr.reshape((len(rows), 1)) if batched else arr.reshape((1,))


def _groups(rows: list[BatchRow]) -> list[list[BatchRow]]:
    """Rows whose requests share input shapes run together; filler joins the first group."""
    by_sig: dict[tuple, list[BatchRow]] = {}
    filler = []
    for r in rows:
        if r.request is None:
            filler.append(r)
        else:
            by_sig.setdefault(cast(Pending, r.request.payload).signature, []).append(r)
    groups = list(by_sig.values())
    if len(groups) == 1:
        return [rows]  # the common case: keep the slot order, filler included
    if groups and filler:
        groups[0] = filler + groups[0]
    return groups


def _filler(like: Pending) -> Pending:
    """A READY=0 row shaped like ``like``: zero inputs, no outputs."""
    inputs = {}
    for name, item in like.inputs.items():
        if item.spec.element_size:
            data = bytes(len(item.data))
        else:
            data = datatypes.serialize_bytes([b""] * datatypes.element_count(item.shape))
        inputs[name] = InputData(item.spec, item.shape, data)
    return Pending(pb.ModelInferRequest(), inputs, [], 1, like.signature)
