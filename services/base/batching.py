"""Batch assembly, in the worker thread: the validated requests of one batch joined into the
model's input tensors (one buffer per input, viewed with numpy), plus Triton's generated
``batch_input`` tensors and the grouping of a batch by input shapes."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from services.base.scheduling.request import QueuedRequest
from services.base.validation import ModelTensors, Pending


def group_by_signature(batch: list[QueuedRequest[Pending]]) -> list[list[QueuedRequest[Pending]]]:
    """The batch's requests by input shapes (only equal shapes run together); mostly one group."""
    first = batch[0].payload.signature
    if all(q.payload.signature == first for q in batch):
        return [batch]
    groups: dict[tuple, list[QueuedRequest[Pending]]] = {}
    for q in batch:
        groups.setdefault(q.payload.signature, []).append(q)
    return list(groups.values())


def feeds(model: ModelTensors, payloads: Sequence[Pending], total_rows: int) -> dict[str, np.ndarray]:
    """The model's inputs for one group of requests with equal signatures: each input's buffers
    joined (a single request's is used as is), reshaped to the shape the model sees."""
    first = payloads[0]
    batched = model.max_batch_size > 0
    out: dict[str, np.ndarray] = {}
    for name, item in first.inputs.items():
        spec = item.spec
        inner = item.shape[1:] if batched else item.shape
        if spec.element_size:
            buf = item.data if len(payloads) == 1 else b"".join(p.inputs[name].data for p in payloads)
            arr = np.frombuffer(buf, dtype=spec.dtype)
        else:
            arr = np.array([v for p in payloads for v in datatypes.deserialize_bytes(p.inputs[name].data)],
                           dtype=np.object_)
        if name in model.ragged:
            out[name] = arr.reshape(-1)  # the requests' elements back to back
            continue
        model_inner = spec.reshape if spec.reshape is not None else inner
        out[name] = arr.reshape((total_rows, *model_inner) if batched else model_inner)
    for b in model.batch_inputs:
        value = batch_input_value(b, [p.inputs[b.source_input[0]].shape for p in payloads]
                                  if b.source_input else [], datatypes.numpy_dtype(datatypes.config_to_wire(b.data_type)))
        for target in b.target_name:
            out[target] = value
    return out


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
