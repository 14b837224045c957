"""Request payloads built from a model's metadata and config, encoded once before the run.

Every request is pre-serialized (HTTP JSON body, HTTP binary body + header length, or a raw
gRPC ModelInferRequest) so the hot loop only sends bytes: encoding per request would make the
Python client, not the server, the bottleneck.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import datatypes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]  # without the batch dimension when the model batches


@dataclass
class ModelInfo:
    name: str
    max_batch_size: int
    inputs: list[TensorSpec]
    outputs: list[str]
    config: dict[str, Any] = field(default_factory=dict)


def model_info(metadata: dict[str, Any], config: dict[str, Any]) -> ModelInfo:
    """Combine `/v2/models/<m>` (names, datatypes) and `/config` (max_batch_size, dims)."""
    mbs = int(config.get("max_batch_size", 0) or 0)
    inputs = []
    for t in metadata.get("inputs", []):
        shape = [int(d) for d in t["shape"]]
        if mbs > 0 and shape and shape[0] == -1:
            shape = shape[1:]
        inputs.append(TensorSpec(t["name"], t["datatype"], shape))
    outputs = [t["name"] for t in metadata.get("outputs", [])]
    return ModelInfo(metadata.get("name", ""), mbs, inputs, outputs, config)


def _concrete(shape: list[int], dim: int) -> list[int]:
    return [dim if d < 0 else d for d in shape]


def random_tensor(spec: TensorSpec, batch: int, rng: np.random.Generator, dynamic_dim: int = 4,
                  batched: bool = True) -> np.ndarray:
    """Finite, modest values (perf_analyzer's random bit patterns make MLPs produce NaN)."""
    shape = ([batch] if batched else []) + _concrete(spec.shape, dynamic_dim)
    if spec.datatype == "BYTES":
        flat = np.array([f"s{rng.integers(0, 1 << 30)}".encode() for _ in range(int(np.prod(shape)))],
                        dtype=object)
        return flat.reshape(shape)
    dt = datatypes.numpy_dtype(spec.datatype)
    if spec.datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(dt)
    if np.issubdtype(dt, np.integer):
        return rng.integers(0, 100, size=shape).astype(dt)
    return rng.uniform(-1.0, 1.0, size=shape).astype(dt)


def file_tensors(path: Path, info: ModelInfo, batch: int) -> list[dict[str, np.ndarray]]:
    """perf_analyzer-style input file: {"data": [{"INPUT0": [...] | {"content": [...], "shape": [...]}}]}."""
    doc = json.loads(Path(path).read_text())
    out = []
    for entry in doc["data"]:
        arrays = {}
        for spec in info.inputs:
            item = entry[spec.name]
            content, shape = (item["content"], item.get("shape")) if isinstance(item, dict) else (item, None)
            if spec.datatype == "BYTES":
                arr = np.array([str(c).encode() for c in np.ravel(content)], dtype=object)
            else:
                arr = np.asarray(content, dtype=datatypes.numpy_dtype(spec.datatype))
            arr = arr.reshape(shape or _concrete(spec.shape, 1) or [-1]) if shape or spec.shape else arr
            if info.max_batch_size > 0:
                arr = np.repeat(arr[None, ...], batch, axis=0)
            arrays[spec.name] = arr
        out.append(arrays)
    return out


def _raw(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return datatypes.serialize_bytes(arr.ravel().tolist())
    return np.ascontiguousarray(arr).tobytes()


@dataclass(frozen=True)
class Payload:
    """One pre-encoded request in every wire form."""

    http_json: bytes
    http_binary: bytes
    http_binary_header_len: int
    grpc: bytes  # serialized ModelInferRequest
    rows: int  # batch rows (what the server counts in inference_count)


def encode(model: str, version: str, arrays: dict[str, np.ndarray], info: ModelInfo,
           outputs_binary: bool = True) -> Payload:
    rows = next(iter(arrays.values())).shape[0] if info.max_batch_size > 0 and arrays else 1
    json_inputs, bin_inputs, blobs = [], [], []
    req = pb.ModelInferRequest(model_name=model, model_version=version)
    for spec in info.inputs:
        arr = arrays[spec.name]
        shape = list(arr.shape)
        raw = _raw(arr, spec.datatype)
        if spec.datatype == "BYTES":
            data: Any = [b.decode() for b in arr.ravel().tolist()]
        else:
            data = arr.ravel().tolist()
        json_inputs.append({"name": spec.name, "shape": shape, "datatype": spec.datatype, "data": data})
        bin_inputs.append({"name": spec.name, "shape": shape, "datatype": spec.datatype,
                           "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
        t = req.inputs.add(name=spec.name, datatype=spec.datatype)
        t.shape.extend(shape)
        req.raw_input_contents.append(raw)
    for o in info.outputs:
        req.outputs.add(name=o)
    http_json = json.dumps({"inputs": json_inputs, "outputs": [{"name": o} for o in info.outputs]},
                           separators=(",", ":")).encode()
    header = json.dumps({"inputs": bin_inputs, "outputs": [
        {"name": o, "parameters": {"binary_data": outputs_binary}} for o in info.outputs]},
        separators=(",", ":")).encode()
    return Payload(http_json, header + b"".join(blobs), len(header), req.SerializeToString(), int(rows))


def build_payloads(model: str, version: str, info: ModelInfo, batch: int = 1, variants: int = 8,
                   input_file: Path | None = None, seed: int = 0) -> list[Payload]:
    """A few distinct payloads per target, cycled through during the run."""
    batched = info.max_batch_size > 0
    if input_file is not None:
        return [encode(model, version, a, info) for a in file_tensors(input_file, info, batch)]
    rng = np.random.default_rng(seed)
    return [encode(model, version, {s.name: random_tensor(s, batch, rng, batched=batched) for s in info.inputs},
                   info) for _ in range(variants)]
