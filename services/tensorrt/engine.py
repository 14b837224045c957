"""What the TensorRT adapter needs from an engine, as a small interface.

`services/tensorrt/trt_engine.py` implements it with the real TensorRT 10 Python API and
cuda-python (cudart) memory; the unit tests implement it with numpy. Everything above this
interface (config ↔ engine checks, optimization-profile choice, I/O binding, batch padding,
dtype mapping) is plain Python and tested without a GPU.

Shapes are tuples of ints, -1 for a dynamic dimension (TensorRT's convention). Datatypes are
wire names ("FP32"); `datatype_from_trt` maps TensorRT's `DataType` member names to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

INPUT = "input"
OUTPUT = "output"

# tensorrt.DataType member name -> wire datatype. BF16, FP8, INT4, FP4 have no numpy dtype and
# are refused at load time (they map to "").
_TRT_TO_WIRE = {
    "FLOAT": "FP32", "HALF": "FP16", "INT8": "INT8", "INT32": "INT32", "INT64": "INT64",
    "BOOL": "BOOL", "UINT8": "UINT8",
}


def datatype_from_trt(trt_name: str) -> str:
    """Wire datatype of a `tensorrt.DataType` name ("FLOAT" → "FP32"); "" when unsupported."""
    return _TRT_TO_WIRE.get(trt_name.rsplit(".", 1)[-1], "")


@dataclass(frozen=True)
class TensorDesc:
    """One I/O tensor of an engine."""

    name: str
    mode: str  # INPUT | OUTPUT
    datatype: str  # wire datatype, "" when TensorRT's type has no wire equivalent
    shape: tuple[int, ...]  # -1 = dynamic
    trt_type: str = ""  # TensorRT's name for the type (for messages)


@dataclass(frozen=True)
class ProfileShapes:
    """Shape range an optimization profile accepts for one input."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def covers(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= s <= hi for s, lo, hi in zip(shape, self.min, self.max, strict=True))


class EngineContext(Protocol):
    """An execution context with its own CUDA stream and device buffers (one per instance)."""

    def set_optimization_profile(self, index: int) -> None: ...

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None: ...

    def output_shape(self, name: str) -> tuple[int, ...]:
        """Valid once every input shape is set; -1 left means a data-dependent shape."""
        ...

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        """Copy inputs in, run, fill `outputs` (host arrays of the output shapes) in place."""
        ...

    def close(self) -> None: ...


class Engine(Protocol):
    """A deserialized engine on one device."""

    def tensors(self) -> list[TensorDesc]: ...

    @property
    def num_profiles(self) -> int: ...

    def profile_shapes(self, name: str, profile: int) -> ProfileShapes: ...

    def create_context(self) -> EngineContext: ...

    def close(self) -> None: ...
