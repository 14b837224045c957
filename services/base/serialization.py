"""Response encoding, in the worker thread: the model's outputs for one group of requests
sliced back per request (rows, scattered batch outputs, reshapes), classified where asked,
and serialized into one ModelInferResponse per request."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import datatypes
from services.base.validation import ModelTensors, Pending, TensorSpec


class ResponseEncoder:
    """Encodes one model version's responses; holds its classification labels (read once)."""

    def __init__(self, model: ModelTensors, version: str, model_dir: Path):
        self.model = model
        self.version = version
        self.model_dir = model_dir
        self._labels: dict[str, list[str]] = {}

    def encode(self, payloads: Sequence[Pending], produced: dict[str, np.ndarray]) -> list[bytes]:
        """One serialized response per request of the group, in order."""
        model = self.model
        batched = model.max_batch_size > 0
        bodies: list[bytes] = []
        row = 0
        scattered: dict[str, list[np.ndarray]] = {}
        for out_name, source in model.scatter.items():
            if out_name in produced:
                shapes = [p.inputs[source].shape for p in payloads]
                ends = np.cumsum([datatypes.element_count(s) for s in shapes])[:-1]
                flat = produced[out_name].reshape(-1)
                scattered[out_name] = [part.reshape(s) for part, s in zip(np.split(flat, ends), shapes, strict=True)]
        for i, p in enumerate(payloads):
            resp = pb.ModelInferResponse(model_name=model.name, model_version=self.version, id=p.request.id)
            for out_name, k in p.outputs:
                spec = model.outputs[out_name]
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
        return bodies

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


def _to_bytes(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return datatypes.serialize_bytes(arr.reshape(-1).tolist())
    want = datatypes.numpy_dtype(datatype)
    if arr.dtype != want:
        arr = arr.astype(want)
    return arr.tobytes()
