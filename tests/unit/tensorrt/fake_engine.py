"""A numpy implementation of services.tensorrt.engine's Engine interface.

The "network" computes OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1 (elementwise,
output shapes = input shapes), and records what the adapter asked of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.tensorrt.engine import INPUT, OUTPUT, ProfileShapes, TensorDesc


@dataclass
class FakeContext:
    engine: FakeEngine
    profile: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    profile_calls: list[int] = field(default_factory=list)
    executions: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    bound_outputs: list[list[str]] = field(default_factory=list)
    closed: bool = False

    def set_optimization_profile(self, index: int) -> None:
        assert 0 <= index < self.engine.num_profiles
        self.profile = index
        self.profile_calls.append(index)

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        desc = self.engine.by_name[name]
        assert desc.mode == INPUT
        assert len(shape) == len(desc.shape)
        if self.engine.profiles:
            assert self.engine.profile_shapes(name, self.profile).covers(shape), (name, shape, self.profile)
        self.shapes[name] = shape

    def output_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[self.engine.input_names[0]] if not self.engine.data_dependent else (-1, 4)

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        for name, arr in inputs.items():
            assert arr.dtype == np.dtype(self.engine.np_dtype) and arr.flags.c_contiguous
            assert arr.shape == self.shapes[name]
        self.executions.append({n: a.shape for n, a in inputs.items()})
        self.bound_outputs.append(sorted(outputs))
        a, b = (inputs[n] for n in self.engine.input_names)
        outputs["OUTPUT0"][...] = a + b
        outputs["OUTPUT1"][...] = a - b

    def close(self) -> None:
        self.closed = True


class FakeEngine:
    def __init__(self, shape: tuple[int, ...] = (-1, 4), profiles: list[tuple[int, int]] | None = None,
                 datatype: str = "FP32", trt_type: str = "FLOAT", width: int = 4,
                 data_dependent: bool = False, extra_input: str | None = None):
        self.input_names = ["INPUT0", "INPUT1"] + ([extra_input] if extra_input else [])
        self.np_dtype = {"FP32": np.float32, "INT64": np.int64, "FP16": np.float16}.get(datatype, np.float32)
        self.data_dependent = data_dependent
        descs = [TensorDesc(n, INPUT, datatype, shape, trt_type) for n in self.input_names]
        descs += [TensorDesc(n, OUTPUT, datatype, shape, trt_type) for n in ("OUTPUT0", "OUTPUT1")]
        self.by_name = {d.name: d for d in descs}
        self._descs = descs
        # profiles: (min batch, max batch); None and a dynamic shape -> one profile 1..8
        if profiles is None and -1 in shape:
            profiles = [(1, 8)]
        self.profiles = profiles or []
        self.width = width
        self.contexts: list[FakeContext] = []
        self.closed = False

    def tensors(self) -> list[TensorDesc]:
        return list(self._descs)

    @property
    def num_profiles(self) -> int:
        return max(1, len(self.profiles))

    def profile_shapes(self, name: str, profile: int) -> ProfileShapes:
        lo, hi = self.profiles[profile]
        rest = self.by_name[name].shape[1:]
        return ProfileShapes((lo, *rest), (hi, *rest), (hi, *rest))

    def create_context(self) -> FakeContext:
        ctx = FakeContext(self)
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        self.closed = True
