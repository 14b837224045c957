"""The runtime adapter interface: load a model file, run one batch. No gRPC, no asyncio.

The sequence service reuses the ONNX and TorchScript adapters through this interface;
TensorRT implements it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from meshserve._proto import model_config_pb2 as mc


class RuntimeLoadError(Exception):
    """A model file could not be loaded, or does not fit its config: every adapter's load
    error. The message names the model, the file and the cause."""


@dataclass(frozen=True)
class InstancePlacement:
    """Where one model instance runs (from instance_group)."""

    index: int  # 0-based across all groups of the model
    group: str
    kind: str  # "cpu" | "gpu"
    device_id: int = 0


class RuntimeInstance(Protocol):
    """One loaded copy of a model; runs one batch at a time (called from a worker thread)."""

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class RuntimeAdapter(Protocol):
    """Loads model files of one format into RuntimeInstances."""

    name: str  # "onnxruntime", "pytorch", "tensorrt"

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> RuntimeInstance: ...


def config_parameter(config: mc.ModelConfig, key: str, default: str | None = None) -> str | None:
    """A string from config `parameters { key: ... value: { string_value: ... } }`."""
    if key in config.parameters:
        return config.parameters[key].string_value
    return default


def config_int(config: mc.ModelConfig, key: str, minimum: int | None = None) -> int | None:
    """An integer from config `parameters` (None when absent or blank); RuntimeLoadError when
    it is not an integer or is below ``minimum``."""
    raw = config_parameter(config, key)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise RuntimeLoadError(f"model '{config.name}': parameter '{key}' must be an integer, got '{raw}'") from None
    if minimum is not None and value < minimum:
        raise RuntimeLoadError(f"model '{config.name}': parameter '{key}' must be >= {minimum}, got {value}")
    return value


def placements(config: mc.ModelConfig, gpu_available: bool) -> list[InstancePlacement]:
    """Expand instance_group into one placement per instance (KIND_GPU: one per listed GPU)."""
    out: list[InstancePlacement] = []
    for gi, group in enumerate(config.instance_group):
        name = group.name or f"{config.name}_{gi}"
        count = max(1, group.count)
        wants_gpu = group.kind == mc.ModelInstanceGroup.KIND_GPU or (
            group.kind == mc.ModelInstanceGroup.KIND_AUTO and gpu_available)
        gpus = list(group.gpus) or [0]
        for _ in range(count):
            if wants_gpu:
                for gpu in gpus:
                    out.append(InstancePlacement(len(out), name, "gpu", gpu))
            else:
                out.append(InstancePlacement(len(out), name, "cpu", 0))
    if not out:
        out.append(InstancePlacement(0, f"{config.name}_0", "cpu", 0))
    return out
