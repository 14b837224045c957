"""Request validation, on the event loop: a ModelInferRequest checked against the model's
tensors (names, datatypes, shapes, byte lengths) and turned into a :class:`Pending`.

Works on metadata only (shape x element size = byte length; no numpy on the event loop except
for typed contents). Messages follow Triton's and name the model and the tensor at fault.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from meshserve.protocol.hop import MERGED, Hop
from meshserve.protocol.http_codec import typed_to_bytes
from meshserve.protocol.infer_checks import (
    MAX_BYTES_ELEMENTS,
    check_bytes_elements,
    datatype_mismatch,
    int_value,
    missing_inputs,
    mixed_contents,
    reject_mixed_contents,
    unexpected_input,
)
from meshserve.telemetry import tracing
from meshserve.telemetry.spans import Span
from services.base.classification import check_classifiable
from services.base.scheduling.policy import BatchingPolicy
from services.base.scheduling.request import SequenceControl


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
        return datatypes.carrier_dtype(self.datatype)  # (BF16: raw uint16)


def _spec(t: mc.ModelInput | mc.ModelOutput, optional: bool = False, label_filename: str = "") -> TensorSpec:
    dt = datatypes.config_to_wire(t.data_type)
    return TensorSpec(t.name, dt, tuple(t.dims), tuple(t.reshape.shape) if t.HasField("reshape") else None,
                      datatypes.element_size(dt), optional, label_filename)


@dataclass(frozen=True, slots=True)
class ModelTensors:
    """A model's tensors as its requests and batches use them, taken once from its config."""

    name: str
    max_batch_size: int
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    required_inputs: tuple[str, ...]
    all_outputs: list[tuple[str, int]]  # every output, no classification: what a request names none gets
    # Ragged batching (Triton): ragged inputs are concatenated into one 1-D tensor; batch
    # inputs describe the batch to the model; batch outputs are scattered back per request.
    ragged: frozenset[str]
    batch_inputs: tuple[mc.BatchInput, ...]
    scatter: dict[str, str]  # batch output -> the input whose per-request shapes it splits by

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> ModelTensors:
        inputs = {t.name: _spec(t, optional=t.optional) for t in config.input}
        outputs = {t.name: _spec(t, label_filename=t.label_filename) for t in config.output}
        return cls(config.name, config.max_batch_size, inputs, outputs,
                   tuple(s.name for s in inputs.values() if not s.optional), [(name, 0) for name in outputs],
                   frozenset(t.name for t in config.input if t.allow_ragged_batch), tuple(config.batch_input),
                   {name: b.source_input[0] for b in config.batch_output for name in b.target_name
                    if b.source_input})


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
    sequence: SequenceControl | None = None  # its sequence (a sequence model's request)
    # the client's request id where a gateway's hop carried it (Hop.request_id; the request's own
    # id is then the hop's key): what a python model's request_id() gives
    request_id: str | None = None


def prepare(model: ModelTensors, request: pb.ModelInferRequest, hop: Hop) -> Pending:
    """Check ``request`` against the model's tensors; raises InferError (INVALID_ARGUMENT)."""
    name = model.name
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        reject_mixed_contents(request)  # Triton names a typed contents first
        raise InferError.invalid(
            f"model '{name}': {len(raw)} raw_input_contents for {len(request.inputs)} inputs; "
            "every input needs exactly one raw entry")
    specs = model.inputs
    inputs: dict[str, InputData] = {}
    batch = -1
    strings = 0  # BYTES elements so far
    sig: list[tuple[int, ...]] = []
    mbs = model.max_batch_size
    # (index loops over the repeated fields: upb's containers iterate by the sequence protocol,
    # ending each loop with a formatted IndexError, ~2,200 instructions: three per request)
    tensors = request.inputs
    for i in range(len(tensors)):
        t = tensors[i]
        if raw and t.HasField("contents"):  # infer_checks.reject_mixed_contents, in this loop
            raise mixed_contents(t.name, name)
        tname = t.name  # (each read of a upb field makes a new str)
        spec = specs.get(tname)
        if spec is None:
            raise unexpected_input(t.name, name, specs)
        if tname in inputs:
            raise InferError.invalid(f"input '{t.name}' already exists in request")  # (Triton's words)
        if t.datatype != spec.datatype:
            raise datatype_mismatch(t.name, t.datatype, name, spec.datatype)
        shape = tuple(t.shape[:])  # (a slice is a list: no IndexError)
        if mbs > 0:
            inner = shape[1:]
            if inner != spec.dims and (len(shape) != len(spec.dims) + 1 or not _dims_match(inner, spec.dims)):
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
        if shape and min(shape) < 0:
            raise InferError.invalid(f"input '{t.name}' for model '{name}' has a negative dimension {list(shape)}")
        count = prod(shape)  # (datatypes.element_count, in C: the shape's entries are ints)
        if spec.element_size:
            data = raw[i] if raw else typed_to_bytes(t, name)
            expected = count * spec.element_size
            if len(data) != expected:  # (Triton's words: NVIDIA's L0_input_validation asserts them)
                raise InferError.invalid(f"input byte size mismatch for input '{t.name}' for model '{name}'. "
                                         f"Expected {expected}, got {len(data)}")
        else:  # BYTES: bounded by the shape before any element is walked (infer_checks.MAX_BYTES_ELEMENTS)
            strings += count
            if strings > MAX_BYTES_ELEMENTS:
                check_bytes_elements(strings, f"input '{t.name}' for model '{name}'")
            data = raw[i] if raw else typed_to_bytes(t, name)
            datatypes.check_bytes_framing(data, count, t.name, name)
        inputs[tname] = InputData(spec, shape, data)
        sig.append(() if tname in model.ragged else (inner if mbs > 0 else shape))
    if len(inputs) < len(specs):
        missing = [n for n in model.required_inputs if n not in inputs]
        if missing:
            raise missing_inputs(name, len(specs), len(model.required_inputs), list(inputs), missing)
    outputs = model.all_outputs
    wanted = request.outputs
    if wanted:
        outputs = []
        for j in range(len(wanted)):
            o = wanted[j]
            if o.name not in model.outputs:
                raise InferError.invalid(
                    f"unexpected inference output '{o.name}' for model '{name}'; "
                    f"model outputs are {sorted(model.outputs)}")
            k = 0
            if "classification" in o.parameters:
                k = int_param(o.parameters["classification"])
                if k < 0:
                    raise InferError.invalid(f"output '{o.name}': classification count must be >= 0")
                if k:
                    check_classifiable(model.outputs[o.name].datatype)
            outputs.append((o.name, k))
        if len(outputs) > 1 and len({n for n, _ in outputs}) < len(outputs):
            raise _named_twice(outputs)
    rows = batch if mbs > 0 else 1
    merged = hop.merged  # client requests a gateway merged into this one
    if merged is None:
        raise InferError.invalid(f"model '{name}': parameter '{MERGED}' must be an integer")
    if merged < 1 or merged > rows:
        raise InferError.invalid(f"parameter '{MERGED}' must be in 1..{rows}, got {merged}")
    return Pending(request, inputs, outputs, rows, tuple(sig), merged)


def require_single_row(pending: Pending, model: str, max_batch_size: int) -> None:
    """A request to a sequence-batched model carries one row (Triton's sequence batcher rule)."""
    if max_batch_size > 0 and pending.rows != 1:
        raise InferError.invalid(
            f"inference request to model '{model}' must specify batch-size 1 due to requirements "
            f"of sequence batcher (got {pending.rows})")


def _named_twice(outputs: list[tuple[str, int]]) -> InferError:
    """A request naming an output twice: Triton's refusal in its words (its core since 2026-04,
    AddOriginalRequestedOutput; NVIDIA's qa/L0_http asserts it). Triton 2.51 answered such an
    output once; meshserve's ONNX kind answered it twice."""
    seen: set[str] = set()
    for name, _ in outputs:
        if name in seen:
            return InferError.invalid(f"output '{name}' already exists in request")
        seen.add(name)
    raise AssertionError("no output named twice")


def int_param(p: pb.InferParameter) -> int:
    """An integer request parameter (any integer form); INVALID_ARGUMENT otherwise."""
    value = int_value(p)
    if value is None:
        raise InferError.invalid(f"parameter must be an integer, got {p.WhichOneof('parameter_choice')}")
    return value


def _dims_match(shape: Sequence[int], dims: Sequence[int]) -> bool:
    if shape == dims:  # (tuples: the common case, no variable dimension)
        return True
    if len(shape) != len(dims):
        return False
    return all(d == -1 or d == s for s, d in zip(shape, dims, strict=True))


def schedule_policy(policy: BatchingPolicy, model: str, request: pb.ModelInferRequest, arrival: int,
                    deadline_ns: int | None) -> tuple[int, int | None, int | None]:
    """(queue level, REJECT deadline, DELAY time) from Triton's schedule-policy extension:
    request parameters `priority` (1 = highest, 0 = default) and `timeout` (µs), the
    model's priority levels and queue policies, and the transport deadline (gRPC)."""
    params = request.parameters
    if not params and not policy.priority_levels and not policy.priority_queue_policies \
            and not policy.default_queue_policy.default_timeout_ns:
        return 1, deadline_ns, None  # the common case (no parameters, priorities or default timeout): level 1
    priority = 0
    if "priority" in params:
        priority = int_param(params["priority"])
    try:
        level = policy.level_for(priority)
    except ValueError as exc:
        raise InferError.invalid(f"model '{model}': {exc}") from None
    qp = policy.queue_policy(level)
    timeout_ns = qp.default_timeout_ns
    if "timeout" in params:
        requested = int_param(params["timeout"])
        if requested < 0:
            raise InferError.invalid(f"model '{model}': timeout must be >= 0 µs, got {requested}")
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
