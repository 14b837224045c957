"""Response encoding, in the worker thread: the model's outputs for one group of requests
sliced back per request (rows, scattered batch outputs, reshapes), classified where asked
(services/base/classification.py), and serialized into one ModelInferResponse per request.

The ModelInferResponse is written directly in protobuf's wire format, the bytes
``SerializeToString`` gives (fields in number order; tests/unit/services compares them): building
the message costs several µs of attribute calls per request. A fixed-size output with neither
classification nor scattering is not even sliced into arrays: each request's rows are a range of
one contiguous buffer per output."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from meshserve.protocol.wire import varint
from services.base.classification import MAX_CLASSIFIED, classify
from services.base.validation import ModelTensors, Pending, TensorSpec

# ModelInferResponse field tags: model_name = 1, model_version = 2, id = 3, outputs = 5,
# raw_output_contents = 6 (all length-delimited); InferOutputTensor: name = 1, datatype = 2,
# shape = 3 (packed int64)
_NAME, _VERSION, _ID, _OUTPUT, _RAW = b"\x0a", b"\x12", b"\x1a", b"\x2a", b"\x32"
_TENSOR_NAME, _TENSOR_DATATYPE, _TENSOR_SHAPE = b"\x0a", b"\x12", b"\x1a"
_EMPTY = memoryview(b"")
_HEADS_MAX = 4096  # cached output tensor messages (one per name, datatype and shape) before a reset


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


class ResponseEncoder:
    """Encodes one model version's responses; holds its classification labels (``labels``: each
    output's, read at load by meshserve/repository/labels.py:read_labels; none until then)."""

    def __init__(self, model: ModelTensors, version: str):
        self.model = model
        self.version = version
        # set by the load (services/base/core.py:ServiceCore._measured_build), which reads them
        # before any instance is made; a model without label files keeps none
        self.labels: Mapping[str, Sequence[str]] = {}
        name = model.name.encode()
        # every response starts with the model's name and version
        self._prefix = (_field(_NAME, name) if name else b"") + (_field(_VERSION, version.encode()) if version else b"")
        self._heads: dict[tuple[str, str, tuple[int, ...]], bytes] = {}

    def _head(self, name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
        """The serialized outputs entry (InferOutputTensor: name, datatype, shape) with its tag."""
        key = (name, datatype, shape)
        head = self._heads.get(key)
        if head is None:
            dims = b"".join(varint(d) for d in shape)
            tensor = _field(_TENSOR_NAME, name.encode()) + _field(_TENSOR_DATATYPE, datatype.encode()) \
                + (_field(_TENSOR_SHAPE, dims) if dims else b"")
            head = _field(_OUTPUT, tensor)
            if len(self._heads) >= _HEADS_MAX:
                self._heads.clear()
            self._heads[key] = head
        return head

    def encode(self, payloads: Sequence[Pending], produced: dict[str, np.ndarray]) -> list[bytes | InferError]:
        """One serialized response per request of the group, in order, or the error that request
        alone fails with (a classification past its bound: services/base/classification.py)."""
        model = self.model
        batched = model.max_batch_size > 0
        scattered = scatter(model, payloads, produced)
        # fixed-size outputs that go out as rows: (one contiguous buffer as bytes, bytes per row,
        # each row's shape) per output
        rows_of: dict[str, tuple[memoryview, int, tuple[int, ...]]] = {}
        if batched:
            total = sum(p.rows for p in payloads)
            for out_name, arr in produced.items():
                spec = model.outputs.get(out_name)
                if spec is not None and not arr.ndim:
                    produced[out_name] = arr = scalar_as_config(arr, spec, True, total)
                if spec is None or not spec.element_size or out_name in scattered or arr.shape[0] != total:
                    continue  # (the general path below: _part)
                arr = np.ascontiguousarray(arr, dtype=spec.dtype)
                if spec.reshape is not None:
                    arr = arr.reshape((total, *spec.dims))
                # (memoryview.cast refuses a shape with a zero in it: an empty output has no bytes)
                rows_of[out_name] = (arr.data.cast("B") if arr.size else _EMPTY, arr.nbytes // total, arr.shape[1:])
        prefix = self._prefix
        bodies: list[bytes | InferError] = []
        row = 0
        for i, p in enumerate(payloads):
            rid = p.request.id
            heads: list[bytes | memoryview] = [prefix, _field(_ID, rid.encode())] if rid else [prefix]
            raws: list[bytes | memoryview] = []
            room = MAX_CLASSIFIED
            failed: InferError | None = None
            for out_name, k in p.outputs:
                fast = rows_of.get(out_name) if not k else None
                if fast is not None:
                    buf, row_bytes, inner = fast
                    heads.append(self._head(out_name, model.outputs[out_name].datatype, (p.rows, *inner)))
                    raws.append(_RAW)
                    raws.append(varint(row_bytes * p.rows))
                    raws.append(buf[row * row_bytes:(row + p.rows) * row_bytes])
                    continue
                try:
                    part, datatype = self._part(out_name, k, produced, scattered, i, row, p.rows, batched, room)
                except InferError as exc:  # (a classification past its bound: this request's own)
                    failed = exc
                    break
                if k:
                    room -= part.size
                data = _to_bytes(part, datatype)
                heads.append(self._head(out_name, datatype, tuple(part.shape)))
                raws.append(_RAW)
                raws.append(varint(len(data)))
                raws.append(data)
            row += p.rows
            if failed is not None:
                bodies.append(failed)
                continue
            heads += raws
            bodies.append(b"".join(heads))
        return bodies

    def _part(self, out_name: str, k: int, produced: dict[str, np.ndarray], scattered: dict[str, list[np.ndarray]],
              i: int, row: int, rows: int, batched: bool, room: int) -> tuple[np.ndarray, str]:
        """Request ``i``'s part of output ``out_name`` (its rows from ``row``, its scattered
        piece, reshaped, classified with ``k`` within ``room`` entries) and its datatype on the wire."""
        spec = self.model.outputs[out_name]
        full = produced[out_name]
        if not full.ndim:  # (batched: encode gave it its shape)
            full = scalar_as_config(full, spec, False, 1)
        part = full[row:row + rows] if batched else full
        if out_name in scattered:
            part = scattered[out_name][i]
        elif batched and spec.reshape is not None:
            part = part.reshape((rows, *spec.dims))
        elif not batched and spec.reshape is not None:
            part = part.reshape(spec.dims)
        if k:
            where = f"model '{self.model.name}' output '{out_name}'"
            return classify(part, k, spec.datatype, self.labels.get(out_name, ()), batched, room, where), "BYTES"
        return part, spec.datatype


def scatter(model: ModelTensors, payloads: Sequence[Pending], produced: dict[str, np.ndarray]
            ) -> dict[str, list[np.ndarray]]:
    """Each batch output's (``batch_output`` BATCH_SCATTER_WITH_INPUT_SHAPE) piece per request,
    in the shape of the request's source input."""
    scattered: dict[str, list[np.ndarray]] = {}
    for out_name, source in model.scatter.items():
        if out_name in produced:
            shapes = [p.inputs[source].shape for p in payloads]
            ends = np.cumsum([datatypes.element_count(s) for s in shapes])[:-1]
            flat = produced[out_name].reshape(-1)
            scattered[out_name] = [part.reshape(s) for part, s in zip(np.split(flat, ends), shapes, strict=True)]
    return scattered


def scalar_as_config(arr: np.ndarray, spec: TensorSpec, batched: bool, rows: int) -> np.ndarray:
    """A rank-0 output in the shape its config gives (Triton's onnxruntime backend answers a 0-d
    result with the config's dims, `[1]`, not `[]`): the dims, all 1 for a scalar, behind the
    batch dimension of a batched model, which a scalar can only fill for a batch of one row."""
    dims = tuple(1 for _ in spec.dims)
    if batched:
        if rows != 1:
            raise InferError.internal(
                f"output '{spec.name}' is a scalar for a batch of {rows} rows; a batched model's "
                "outputs need the batch dimension first")
        dims = (1, *dims)
    return arr.reshape(dims)


def _to_bytes(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return datatypes.serialize_bytes(arr.reshape(-1).tolist())
    want = datatypes.carrier_dtype(datatype)
    if arr.dtype != want:
        arr = arr.astype(want)
    return arr.tobytes()
