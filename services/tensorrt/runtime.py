"""TensorRT adapter (`platform: "tensorrt_plan"` / `backend: "tensorrt"`), following Triton's
tensorrt backend, written against the `Engine` interface of `services/tensorrt/engine.py`.

- `model.plan` is deserialized once per (file, GPU) and shared by the instances on that GPU;
  each instance has its own execution context and CUDA stream. KIND_CPU instances are refused.
- Config ↔ engine at load: every engine input must be a config input and every config
  input/output an engine tensor, with the same datatype and a compatible shape (config `dims`,
  or `reshape` when given, behind the batch dimension when max_batch_size > 0).
- Batching: with max_batch_size > 0 the engine's first dimension is the batch. A dynamic one
  needs an optimization profile that accepts max_batch_size; a fixed one (N) takes batches up
  to N, padded with zeros to N and sliced back.
- Each batch runs on the first optimization profile (of the instance group's `profile` list,
  else all) whose min/max cover every input shape; it is switched with
  `set_optimization_profile_async` only when it changes. No profile → INVALID_ARGUMENT.
- Every engine output is bound (TensorRT requires it); only the requested ones are returned.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from services.base.runtime import InstancePlacement, RuntimeLoadError
from services.tensorrt.engine import INPUT, OUTPUT, Engine, EngineContext, ProfileShapes, TensorDesc

log = logging.getLogger("meshserve.tensorrt")

EngineLoader = Callable[[Path, int], Engine]


@dataclass(frozen=True)
class IOPlan:
    """How config tensors bind to engine tensors (checked at load)."""

    model: str
    batched: bool
    fixed_batch: int  # > 0: the engine's batch dimension is fixed at this size (pad to it)
    inputs: dict[str, TensorDesc]  # every engine input, by name
    outputs: dict[str, TensorDesc]  # every engine output, by name
    profiles: tuple[int, ...]  # profiles this instance may use, in preference order


def _model_shape(t: mc.ModelInput | mc.ModelOutput) -> tuple[int, ...]:
    return tuple(t.reshape.shape) if t.HasField("reshape") else tuple(t.dims)


def _dims_compatible(config_dims: Sequence[int], engine_dims: Sequence[int]) -> bool:
    if len(config_dims) != len(engine_dims):
        return False
    return all(e == -1 or c == e for c, e in zip(config_dims, engine_dims, strict=True))


def instance_profiles(config: mc.ModelConfig, placement: InstancePlacement, num_profiles: int) -> tuple[int, ...]:
    """The optimization profiles an instance may use: its group's `profile` list, else all."""
    for gi, group in enumerate(config.instance_group):
        if (group.name or f"{config.name}_{gi}") == placement.group and group.profile:
            out: list[int] = []
            for p in group.profile:
                try:
                    index = int(p)
                except ValueError:
                    raise RuntimeLoadError(f"model '{config.name}' instance group '{placement.group}': "
                                           f"profile '{p}' is not an integer") from None
                if not 0 <= index < num_profiles:
                    raise RuntimeLoadError(
                        f"model '{config.name}' instance group '{placement.group}': profile {index} does not "
                        f"exist; the engine has {num_profiles} optimization profile(s)")
                out.append(index)
            return tuple(out)
    return tuple(range(max(1, num_profiles)))


def plan_io(config: mc.ModelConfig, engine: Engine, profiles: tuple[int, ...]) -> IOPlan:
    """Check a config against an engine and say how to bind them; RuntimeLoadError names every mismatch."""
    name = config.name
    tensors = engine.tensors()
    ins = {t.name: t for t in tensors if t.mode == INPUT}
    outs = {t.name: t for t in tensors if t.mode == OUTPUT}
    batched = config.max_batch_size > 0
    problems: list[str] = []
    missing = sorted(set(ins) - {t.name for t in config.input})
    if missing:
        problems.append(f"engine inputs {missing} are not in the config")
    batch_dims: set[int] = set()
    for kind, entries, pool in (("input", config.input, ins), ("output", config.output, outs)):
        for t in entries:
            desc = pool.get(t.name)
            if desc is None:
                problems.append(f"config {kind} '{t.name}' is not an engine {kind} (engine {kind}s: {sorted(pool)})")
                continue
            want = datatypes.config_to_wire(t.data_type)
            if not desc.datatype:
                problems.append(f"engine {kind} '{t.name}' has TensorRT type {desc.trt_type or '?'}, which "
                                "meshserve cannot serve")
            elif want != desc.datatype:
                problems.append(f"{kind} '{t.name}' is {want} in the config but {desc.datatype} in the engine")
            dims = _model_shape(t)
            engine_dims = desc.shape[1:] if batched else desc.shape
            if batched and not desc.shape:
                problems.append(f"{kind} '{t.name}' has no batch dimension in the engine but max_batch_size > 0")
                continue
            if not _dims_compatible(dims, engine_dims):
                problems.append(f"{kind} '{t.name}' has shape {[-1, *dims] if batched else list(dims)} in the "
                                f"config but {list(desc.shape)} in the engine")
            if batched and kind == "input":
                batch_dims.add(desc.shape[0])
    fixed = 0
    if batched and not problems:
        static = {d for d in batch_dims if d != -1}
        if (static and -1 in batch_dims) or len(static) > 1:
            problems.append(f"the engine's first dimensions {sorted(batch_dims)} disagree; with max_batch_size > 0 "
                            "they are all the batch dimension")
        elif static:
            fixed = static.pop()
            if config.max_batch_size > fixed:
                problems.append(f"max_batch_size {config.max_batch_size} exceeds the engine's fixed batch "
                                f"dimension {fixed}")
        else:
            top = max((min(engine.profile_shapes(n, p).max[0] for n in ins) for p in profiles), default=0)
            if config.max_batch_size > top:
                problems.append(f"max_batch_size {config.max_batch_size} exceeds the largest batch the engine's "
                                f"optimization profile(s) {list(profiles)} accept ({top})")
    if problems:
        raise RuntimeLoadError(f"model '{name}': the TensorRT plan does not match config.pbtxt: " + "; ".join(problems))
    return IOPlan(name, batched, fixed, ins, outs, profiles)


def select_profile(engine: Engine, shapes: dict[str, tuple[int, ...]], profiles: Sequence[int]) -> int | None:
    """The first profile whose min/max cover every input shape, or None."""
    for p in profiles:
        if all(engine.profile_shapes(n, p).covers(s) for n, s in shapes.items()):
            return p
    return None


def _describe_profiles(engine: Engine, names: Sequence[str], profiles: Sequence[int]) -> str:
    parts = []
    for p in profiles:
        ranges: list[str] = []
        for n in names:
            ps: ProfileShapes = engine.profile_shapes(n, p)
            ranges.append(f"{n} {list(ps.min)}..{list(ps.max)}")
        parts.append(f"profile {p}: " + ", ".join(ranges))
    return "; ".join(parts)


def _pad(arr: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
    out[:arr.shape[0]] = arr
    return out


class TensorRTInstance:
    """One execution context (own CUDA stream) over a shared engine; runs one batch at a time."""

    def __init__(self, engine: Engine, context: EngineContext, plan: IOPlan,
                 release: Callable[[], None] | None = None):
        self.engine = engine
        self.context = context
        self.plan = plan
        self._release = release
        self.profile: int | None = None
        self._dynamic = any(-1 in t.shape for t in plan.inputs.values())

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        plan = self.plan
        rows = 0
        feeds: dict[str, np.ndarray] = {}
        for n, desc in plan.inputs.items():
            arr = inputs.get(n)
            if arr is None:
                raise InferError.invalid(f"model '{plan.model}': TensorRT engine input '{n}' is required")
            if arr.dtype == np.object_:
                raise InferError.invalid(f"model '{plan.model}': input '{n}' is BYTES, which TensorRT cannot take")
            feeds[n] = np.ascontiguousarray(arr, dtype=datatypes.numpy_dtype(desc.datatype))
        if plan.batched and feeds:
            rows = next(iter(feeds.values())).shape[0]
            if plan.fixed_batch and rows < plan.fixed_batch:
                feeds = {n: _pad(a, plan.fixed_batch) for n, a in feeds.items()}
            elif plan.fixed_batch and rows > plan.fixed_batch:
                raise InferError.invalid(f"model '{plan.model}': batch of {rows} exceeds the engine's fixed "
                                         f"batch dimension {plan.fixed_batch}")
        shapes = {n: tuple(a.shape) for n, a in feeds.items()}
        if self._dynamic or self.engine.num_profiles > 1:
            profile = select_profile(self.engine, shapes, plan.profiles)
            if profile is None:
                raise InferError.invalid(
                    f"model '{plan.model}': no optimization profile accepts the input shapes "
                    f"{ {n: list(s) for n, s in shapes.items()} } ({_describe_profiles(self.engine, list(shapes), plan.profiles)})")
            if profile != self.profile:
                self.context.set_optimization_profile(profile)
                self.profile = profile
        for n, s in shapes.items():
            self.context.set_input_shape(n, s)
        outputs: dict[str, np.ndarray] = {}
        for n, desc in plan.outputs.items():
            shape = self.context.output_shape(n)
            if any(d < 0 for d in shape):
                raise InferError.internal(f"model '{plan.model}': output '{n}' has a data-dependent shape "
                                          f"{list(shape)}, which meshserve's TensorRT service does not support")
            outputs[n] = np.empty(shape, dtype=datatypes.numpy_dtype(desc.datatype))
        self.context.execute(feeds, outputs)
        result: dict[str, np.ndarray] = {}
        for n in output_names:
            arr = outputs[n]
            result[n] = arr[:rows] if plan.fixed_batch and rows < plan.fixed_batch else arr
        return result

    def close(self) -> None:
        self.context.close()
        if self._release is not None:
            self._release()
            self._release = None


def default_loader(model_file: Path, device_id: int) -> Engine:
    from services.tensorrt.trt_engine import load_engine  # deferred: needs tensorrt + a GPU

    return load_engine(model_file, device_id)


class TensorRTAdapter:
    """Loads `model.plan` files into TensorRTInstances (engine shared per file and GPU)."""

    name = "tensorrt"

    def __init__(self, loader: EngineLoader = default_loader):
        self._loader = loader
        self._engines: dict[tuple[str, int, int], tuple[Engine, int]] = {}  # key -> (engine, instances)
        self._lock = threading.Lock()

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> TensorRTInstance:
        if placement.kind != "gpu":
            raise RuntimeLoadError(
                f"model '{config.name}' instance group '{placement.group}': TensorRT plans run on GPUs only; "
                "use KIND_GPU (or KIND_AUTO on a machine with a GPU)")
        if not model_file.is_file():
            raise RuntimeLoadError(f"model '{config.name}': model file {model_file} does not exist")
        for kind, tensors in (("input", config.input), ("output", config.output)):
            for t in tensors:
                if t.data_type == mc.TYPE_STRING:
                    raise RuntimeLoadError(f"model '{config.name}': {kind} '{t.name}' is TYPE_STRING; TensorRT "
                                           "engines take numeric and BOOL tensors only")
        key = (str(model_file.resolve()), model_file.stat().st_mtime_ns, placement.device_id)
        with self._lock:
            engine, users = self._engines.get(key, (None, 0))
            if engine is None:
                try:
                    engine = self._loader(model_file, placement.device_id)
                except RuntimeLoadError:
                    raise
                except Exception as exc:
                    raise RuntimeLoadError(f"model '{config.name}': could not load TensorRT plan {model_file} on "
                                           f"GPU {placement.device_id}: {exc}") from None
            self._engines[key] = (engine, users + 1)
        try:
            plan = plan_io(config, engine, instance_profiles(config, placement, engine.num_profiles))
            context = engine.create_context()
        except BaseException:
            self._release(key)
            raise
        log.info("model '%s' instance %d on GPU %d: profiles %s%s", config.name, placement.index,
                 placement.device_id, list(plan.profiles),
                 f", fixed batch {plan.fixed_batch} (padded)" if plan.fixed_batch else "")
        return TensorRTInstance(engine, context, plan, lambda: self._release(key))

    def _release(self, key: tuple[str, int, int]) -> None:
        """An instance is done with its engine; the last one frees it (unload, reload)."""
        with self._lock:
            engine, users = self._engines.get(key, (None, 0))
            if engine is None:
                return
            if users > 1:
                self._engines[key] = (engine, users - 1)
                return
            del self._engines[key]
        engine.close()
