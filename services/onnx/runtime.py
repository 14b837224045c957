"""onnxruntime adapter honouring Triton's onnxruntime backend parameters.

Config parameters read (as Triton's onnxruntime backend does): `intra_op_thread_count`,
`inter_op_thread_count`, `execution_mode` (0 sequential, 1 parallel), `enable_mem_arena`,
`enable_mem_pattern`; `optimization { graph { level } }`: -1 basic, 1 extended,
2 disable all, unset/0 all. KIND_GPU instances use the CUDA execution provider (device per
instance) and fail loading with a clear message when onnxruntime has no CUDA provider.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from meshserve._proto import model_config_pb2 as mc
from services.base.runtime import InstancePlacement, RuntimeLoadError, config_int
from services.onnx import load_guard

_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def session_options(config: mc.ModelConfig) -> ort.SessionOptions:
    so = ort.SessionOptions()
    intra = config_int(config, "intra_op_thread_count")
    inter = config_int(config, "inter_op_thread_count")
    mode = config_int(config, "execution_mode")
    if intra is not None:
        so.intra_op_num_threads = intra
    if inter is not None:
        so.inter_op_num_threads = inter
    if mode is not None:
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL if mode == 1 else ort.ExecutionMode.ORT_SEQUENTIAL
    arena = config_int(config, "enable_mem_arena")
    if arena is not None:
        so.enable_cpu_mem_arena = bool(arena)
    pattern = config_int(config, "enable_mem_pattern")
    if pattern is not None:
        so.enable_mem_pattern = bool(pattern)
    # Any `session.*` / `memory.*` parameter is an onnxruntime session config entry (as in
    # Triton's onnxruntime backend). meshserve turns intra-op spin-waiting off by default:
    # spinning threads burn the cores the gateway and the other services share.
    entries = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}
    for key, param in config.parameters.items():
        if key.startswith(("session.", "memory.")):
            entries[key] = param.string_value
    for key, value in entries.items():
        so.add_session_config_entry(key, value)
    level = config.optimization.graph.level if config.HasField("optimization") else 0
    so.graph_optimization_level = _LEVELS.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    return so


def providers_for(placement: InstancePlacement, config: mc.ModelConfig) -> list[object]:
    if placement.kind != "gpu":
        return ["CPUExecutionProvider"]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise RuntimeLoadError(
            f"model '{config.name}' instance group '{placement.group}' asks for KIND_GPU but onnxruntime "
            f"has no CUDA execution provider (available: {', '.join(available)}); "
            "install the [gpu] extra (onnxruntime-gpu) or use KIND_CPU")
    return [("CUDAExecutionProvider", {"device_id": placement.device_id}), "CPUExecutionProvider"]


class OnnxInstance:
    """One onnxruntime session."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.providers = session.get_providers()

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        for name, arr in inputs.items():
            if arr.dtype == np.object_:
                inputs[name] = _as_str_array(arr, name)
        results = self.session.run(output_names, inputs)
        return dict(zip(output_names, results, strict=True))

    def close(self) -> None:
        del self.session


def _as_str_array(arr: np.ndarray, name: str) -> np.ndarray:
    """onnxruntime string tensors hold Python str (UTF-8); BYTES elements arrive as bytes."""
    try:
        return np.array([v.decode("utf-8") if isinstance(v, bytes) else v for v in arr.reshape(-1)],
                        dtype=np.object_).reshape(arr.shape)
    except UnicodeDecodeError:
        from meshserve.protocol.errors import InferError

        raise InferError.invalid(f"input '{name}': onnxruntime string tensors must be UTF-8 text") from None


class OnnxRuntimeAdapter:
    name = "onnxruntime"
    guard_load = staticmethod(load_guard.check)  # an uploaded model's load, bounded in memory first

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> OnnxInstance:
        if not model_file.is_file():
            raise RuntimeLoadError(f"model '{config.name}': model file {model_file} does not exist")
        try:
            session = ort.InferenceSession(str(model_file), session_options(config),
                                           providers=providers_for(placement, config))
        except RuntimeLoadError:
            raise
        except Exception as exc:
            raise RuntimeLoadError(f"model '{config.name}': onnxruntime could not load {model_file}: {exc}") from None
        return OnnxInstance(session)
