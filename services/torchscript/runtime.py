"""PyTorch adapter (`platform: "pytorch_libtorch"` / `backend: "pytorch"`), following Triton's
pytorch (libtorch) backend.

Model file: `model.pt`, a TorchScript archive loaded with `torch.jit.load` (primary: it is what
every Triton `pytorch_libtorch` repository holds). A `torch.export` archive (`model.pt2`,
`default_model_filename: "model.pt2"`, or `model.pt2` in a version directory without
`model.pt`) is loaded with `torch.export.load` and run through `ExportedProgram.module()`.

Input naming, as Triton's backend decides it from the config and `forward()`'s signature:
- every config input name is a `forward()` argument name → passed by argument name;
- a single `Dict[str, Tensor]` argument → one dict keyed by config input name;
- every name is `<anything>__<index>` (`INPUT__0`) → positional by that index;
- otherwise → positional in config order (logged).
Outputs: a single tensor is output 0; a tuple/list by index (`OUTPUT__1` → 1, other names by
config order); a dict by config output name.

Config parameters honoured (Triton's names, string values "true"/"false" or integers):
`INFERENCE_MODE` (default **true** here: forward runs under `torch.inference_mode()`; "false"
runs under `torch.no_grad()`), `DISABLE_OPTIMIZED_EXECUTION` (`torch.jit.optimized_execution`),
`ENABLE_JIT_EXECUTOR`, `ENABLE_JIT_PROFILING`, `ENABLE_TENSOR_FUSER` (process-wide JIT switches,
set before each forward when given, as Triton does), `ENABLE_WEIGHT_SHARING` (instances on one
device share one loaded module), `ENABLE_CACHE_CLEANING` (empty the CUDA cache after each
forward on GPU), `INTRA_OP_THREAD_COUNT` / `INTER_OP_THREAD_COUNT` (process-wide; the first
model that sets one wins, as in Triton). `ENABLE_NVFUSER` is accepted and ignored (nvFuser is
gone from PyTorch 2.x).

BYTES (TYPE_STRING) tensors are refused at load time. Inputs become tensors without a copy
(`torch.from_numpy`; the model sees the request buffers, as Triton's `from_blob`); CPU outputs
come back as numpy views of the result tensors.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import threading
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError
from services.base.runtime import InstancePlacement, RuntimeLoadError, config_int, config_parameter

log = logging.getLogger("meshserve.torchscript")

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32,
    "FP64": torch.float64,
}
_NAMED_INDEX = re.compile(r"^.*__(\d+)$")
# Request buffers are read-only bytes that the model reads without a copy; torch warns about
# that on every from_numpy. (A filter set once: catch_warnings is not thread-safe.)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
_THREADS_LOCK = threading.Lock()
_threads_set: dict[str, int] = {}


def _bool_param(config: mc.ModelConfig, key: str) -> bool | None:
    raw = config_parameter(config, key)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise RuntimeLoadError(f"model '{config.name}': parameter '{key}' must be true or false, got '{raw}'")


@dataclass(frozen=True)
class TorchOptions:
    """The pytorch-backend parameters of one model config."""

    inference_mode: bool = True
    optimized_execution: bool = True
    jit_executor: bool | None = None
    jit_profiling: bool | None = None
    tensor_fuser: bool | None = None
    weight_sharing: bool = False
    cache_cleaning: bool = False
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> TorchOptions:
        disable_opt = _bool_param(config, "DISABLE_OPTIMIZED_EXECUTION")
        inference = _bool_param(config, "INFERENCE_MODE")
        if _bool_param(config, "ENABLE_NVFUSER"):
            log.warning("model '%s': ENABLE_NVFUSER is ignored (nvFuser is not part of PyTorch 2.x)", config.name)
        return cls(
            inference_mode=True if inference is None else inference,
            optimized_execution=not disable_opt,
            jit_executor=_bool_param(config, "ENABLE_JIT_EXECUTOR"),
            jit_profiling=_bool_param(config, "ENABLE_JIT_PROFILING"),
            tensor_fuser=_bool_param(config, "ENABLE_TENSOR_FUSER"),
            weight_sharing=bool(_bool_param(config, "ENABLE_WEIGHT_SHARING")),
            cache_cleaning=bool(_bool_param(config, "ENABLE_CACHE_CLEANING")),
            intra_op_threads=config_int(config, "INTRA_OP_THREAD_COUNT", minimum=1),
            inter_op_threads=config_int(config, "INTER_OP_THREAD_COUNT", minimum=1),
        )


def _apply_thread_counts(opts: TorchOptions, model: str) -> None:
    """Process-wide, first setting wins (Triton: "set globally for the PyTorch backend")."""
    with _THREADS_LOCK:
        for key, value, setter in (("INTRA_OP_THREAD_COUNT", opts.intra_op_threads, torch.set_num_threads),
                                   ("INTER_OP_THREAD_COUNT", opts.inter_op_threads,
                                    torch.set_num_interop_threads)):
            if value is None:
                continue
            if key in _threads_set:
                if _threads_set[key] != value:
                    log.warning("model '%s': %s=%d ignored; already set to %d by an earlier model",
                                model, key, value, _threads_set[key])
                continue
            try:
                setter(value)
            except RuntimeError as exc:  # interop threads can only be set before parallel work starts
                log.warning("model '%s': %s=%d could not be applied: %s", model, key, value, exc)
                continue
            _threads_set[key] = value


# ---- I/O mapping (pure: config + forward signature) ------------------------------------------

@dataclass(frozen=True)
class ForwardSignature:
    """What the adapter needs to know about `forward()`."""

    names: tuple[str, ...]  # argument names, without self
    required: int  # arguments without a default
    dict_input: bool = False  # a single Dict[str, Tensor] argument


@dataclass(frozen=True)
class InputPlan:
    convention: str  # "forward_argument" | "dict" | "named_index" | "config_order"
    positions: dict[str, int]  # config input name -> positional index (positional conventions)


def plan_inputs(model: str, input_names: list[str], sig: ForwardSignature) -> InputPlan:
    """Decide how config inputs map to `forward()` arguments (Triton's naming conventions)."""
    if sig.dict_input:
        return InputPlan("dict", {})
    if input_names and all(n in sig.names for n in input_names):
        missing = [a for a in sig.names[:sig.required] if a not in input_names]
        if missing:
            raise RuntimeLoadError(f"model '{model}': forward() argument(s) {missing} have no config input "
                                   f"(config inputs: {input_names})")
        return InputPlan("forward_argument", {n: sig.names.index(n) for n in input_names})
    matches = [_NAMED_INDEX.match(n) for n in input_names]
    if input_names and all(matches):
        positions = {n: int(m.group(1)) for n, m in zip(input_names, matches, strict=True) if m}
        convention = "named_index"
        if sorted(positions.values()) != list(range(len(positions))):
            raise RuntimeLoadError(
                f"model '{model}': inputs {input_names} follow the <name>__<index> convention but their "
                f"indexes {sorted(positions.values())} are not 0..{len(positions) - 1}")
    else:
        positions = {n: i for i, n in enumerate(input_names)}
        convention = "config_order"
        if sig.names:
            log.warning("model '%s': inputs %s are neither forward() arguments %s nor <name>__<index>; "
                        "passing them in config order", model, input_names, list(sig.names))
    if sig.names and not (sig.required <= len(positions) <= len(sig.names)):
        raise RuntimeLoadError(
            f"model '{model}': the config has {len(positions)} inputs but forward() takes "
            f"{sig.required}..{len(sig.names)} arguments {list(sig.names)}")
    return InputPlan(convention, positions)


def plan_outputs(output_names: list[str]) -> dict[str, int]:
    """Config output name -> index into a tuple/list result (`OUTPUT__1` → 1, else config order)."""
    matches = [_NAMED_INDEX.match(n) for n in output_names]
    if output_names and all(matches):
        return {n: int(m.group(1)) for n, m in zip(output_names, matches, strict=True) if m}
    return {n: i for i, n in enumerate(output_names)}


def collect_outputs(model: str, result: Any, wanted: list[str], indexes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Pick the wanted outputs out of whatever forward() returned."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(result, dict):
        for name in wanted:
            if name not in result:
                raise InferError.internal(
                    f"model '{model}': forward() returned a dict without output '{name}' "
                    f"(keys: {sorted(map(str, result))})")
            out[name] = result[name]
    else:
        items = [result] if isinstance(result, torch.Tensor) else list(result) \
            if isinstance(result, (tuple, list)) else None
        if items is None:
            raise InferError.internal(
                f"model '{model}': forward() returned {type(result).__name__}; expected a tensor, "
                "a tuple/list of tensors or a dict of tensors")
        for name in wanted:
            i = indexes[name]
            if i >= len(items):
                raise InferError.internal(
                    f"model '{model}': output '{name}' is result {i} but forward() returned {len(items)}")
            out[name] = items[i]
    for name, value in out.items():
        if not isinstance(value, torch.Tensor):
            raise InferError.internal(f"model '{model}': output '{name}' is a {type(value).__name__}, not a tensor")
    return out


# ---- loading -----------------------------------------------------------------------------------

def _signature_of_script(module: Any) -> ForwardSignature:
    schema = module.forward.schema
    args = list(schema.arguments)
    if args and isinstance(args[0].type, torch.ClassType):
        args = args[1:]  # self
    names = tuple(a.name for a in args)
    required = sum(1 for a in args if not a.has_default_value())
    dict_input = len(args) == 1 and isinstance(args[0].type, torch.DictType) \
        and str(args[0].type).replace(" ", "") == "Dict[str,Tensor]"
    return ForwardSignature(names, required, dict_input)


def _signature_of_callable(module: Any) -> ForwardSignature:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return ForwardSignature((), 0)
    params = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return ForwardSignature(tuple(p.name for p in params), sum(1 for p in params if p.default is p.empty))


def resolve_model_file(model_file: Path) -> Path:
    """`model.pt`, or the `model.pt2` next to it when only that one exists."""
    if not model_file.exists() and model_file.suffix == ".pt":
        alt = model_file.with_suffix(".pt2")
        if alt.exists():
            return alt
    return model_file


def torch_device(placement: InstancePlacement, config: mc.ModelConfig) -> torch.device:
    if placement.kind != "gpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeLoadError(
            f"model '{config.name}' instance group '{placement.group}' asks for KIND_GPU but this torch "
            f"({torch.__version__}) has no usable CUDA device; install a CUDA build of torch or use KIND_CPU")
    count = torch.cuda.device_count()
    if placement.device_id >= count:
        raise RuntimeLoadError(
            f"model '{config.name}' instance group '{placement.group}' asks for GPU {placement.device_id} "
            f"but only {count} CUDA device(s) are visible")
    return torch.device(f"cuda:{placement.device_id}")


def _load_module(model_file: Path, config: mc.ModelConfig, device: torch.device) -> tuple[Any, ForwardSignature]:
    if not model_file.is_file():
        raise RuntimeLoadError(f"model '{config.name}': model file {model_file} does not exist")
    try:
        with warnings.catch_warnings():
            # torch 2.13 marks torch.jit deprecated; Triton repositories still ship TorchScript.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            if model_file.suffix == ".pt2":
                program = torch.export.load(str(model_file))
                module = program.module()
                if device.type != "cpu":
                    module = module.to(device)
                return module, _signature_of_callable(module)
            module = torch.jit.load(str(model_file), map_location=device)
            module.eval()
            return module, _signature_of_script(module)
    except Exception as exc:
        kind = "torch.export" if model_file.suffix == ".pt2" else "TorchScript"
        raise RuntimeLoadError(
            f"model '{config.name}': could not load {model_file} as a {kind} archive: {exc}") from None


def _check_datatypes(config: mc.ModelConfig) -> None:
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for t in tensors:
            dt = datatypes.config_to_wire(t.data_type)
            if dt == "BYTES":
                raise RuntimeLoadError(
                    f"model '{config.name}': {kind} '{t.name}' is TYPE_STRING (BYTES); the TorchScript "
                    "service supports numeric and BOOL tensors only")
            if dt not in _TORCH_DTYPES:  # Triton's pytorch backend's text, then ours
                raise RuntimeLoadError(
                    f"unsupported datatype {mc.DataType.Name(t.data_type)} for {kind} '{t.name}' for model "
                    f"'{config.name}' ({dt}, which the TorchScript service does not support; supported: "
                    f"{', '.join(_TORCH_DTYPES)})")


# ---- running -------------------------------------------------------------------------------------

@dataclass(eq=False)
class TorchInstance:
    """One model instance: a module on a device (maybe shared with sibling instances)."""

    name: str
    module: Any
    signature: ForwardSignature
    inputs: InputPlan
    outputs: dict[str, int]
    output_types: dict[str, str]
    device: torch.device
    opts: TorchOptions
    batched: bool
    stream: Any = field(init=False)  # a torch.cuda.Stream on a GPU, else None
    holder: object | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        opts = self.opts
        if opts.jit_executor is not None:
            torch._C._jit_set_profiling_executor(opts.jit_executor)
        if opts.jit_profiling is not None:
            torch._C._jit_set_profiling_mode(opts.jit_profiling)
        if opts.tensor_fuser is not None:
            torch._C._jit_set_texpr_fuser_enabled(opts.tensor_fuser)
        grad = torch.inference_mode() if opts.inference_mode else torch.no_grad()
        with contextlib.ExitStack() as stack:
            stack.enter_context(grad)
            stack.enter_context(torch.jit.optimized_execution(opts.optimized_execution))
            if self.stream is not None:
                stack.enter_context(torch.cuda.device(self.device))
                stack.enter_context(torch.cuda.stream(self.stream))
            yield

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)  # no copy, also for the read-only request buffers (as Triton's from_blob)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        for name, arr in inputs.items():
            if arr.dtype == np.object_:
                raise InferError.invalid(f"model '{self.name}': input '{name}' is BYTES, which TorchScript "
                                         "models cannot take")
        with self._modes():
            tensors = {n: self._tensor(a) for n, a in inputs.items()}
            plan = self.inputs
            if plan.convention == "dict":
                result = self.module(tensors)
            elif plan.convention == "forward_argument" and (
                    len(tensors) < len(plan.positions) or max(plan.positions.values()) >= len(plan.positions)):
                result = self.module(**tensors)  # optional arguments left out: bind by name
            else:
                args: list[Any] = [None] * len(plan.positions)
                for n, t in tensors.items():
                    args[plan.positions[n]] = t
                while args and args[-1] is None:  # trailing optional inputs not sent
                    args.pop()
                result = self.module(*args)
            picked = collect_outputs(self.name, result, output_names, self.outputs)
            out = {n: t.detach().cpu() for n, t in picked.items()}
        if self.opts.cache_cleaning and self.device.type == "cuda":
            torch.cuda.empty_cache()
        rows = next(iter(inputs.values())).shape[0] if inputs and self.batched else None
        arrays: dict[str, np.ndarray] = {}
        for n, t in out.items():
            want = _TORCH_DTYPES[self.output_types[n]]
            if t.dtype != want:
                raise InferError.internal(
                    f"model '{self.name}': output '{n}' is {t.dtype} but the config declares "
                    f"{self.output_types[n]} ({want})")
            # (a scalar answers for a batch of one row: the response encoder gives it the config's dims)
            if rows is not None and (t.shape[0] != rows if t.dim() else rows != 1):
                raise InferError.internal(
                    f"model '{self.name}': output '{n}' has shape {list(t.shape)}; with max_batch_size > 0 "
                    f"its first dimension must be the batch size {rows}")
            arrays[n] = t.numpy()
        return arrays

    def close(self) -> None:
        self.module = None
        self.holder = None


class _Loaded:
    """A loaded module and its signature (weakly cached for ENABLE_WEIGHT_SHARING)."""

    def __init__(self, module: Any, signature: ForwardSignature):
        self.module = module
        self.signature = signature


class _Prime(torch.nn.Module):
    """TorchScriptAdapter.prime's model: one small linear layer (a matmul wakes the intra-op pool)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, torch.ones(64, 64)) + 1


class TorchScriptAdapter:
    """Loads `model.pt` (TorchScript) or `model.pt2` (torch.export) into TorchInstances."""

    name = "pytorch"

    @staticmethod
    def prime() -> None:
        """torch's one-time start (the JIT's first script, save and load, the profiling executor,
        the CPU allocator and the intra-op thread pool: ~8 MiB kept for good) paid before the
        first model loads, so that it counts in the service's base and not in that model's size
        (services/base/memory.py:MemoryBook.prime)."""
        buffer = io.BytesIO()
        with warnings.catch_warnings():  # torch 2.13 marks torch.jit deprecated (as _load_module)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            torch.jit.save(torch.jit.script(_Prime()), buffer)
            buffer.seek(0)
            module = torch.jit.load(buffer).eval()
        with torch.inference_mode():
            for _ in range(2):  # the profiling executor optimizes on the second run
                module(torch.ones(1, 64))

    def __init__(self) -> None:
        # ENABLE_WEIGHT_SHARING: one module per (model, file, device) while an instance holds it
        self._shared: weakref.WeakValueDictionary[tuple[str, str, str], _Loaded] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def load(self, model_file: Path, config: mc.ModelConfig, placement: InstancePlacement) -> TorchInstance:
        opts = TorchOptions.from_config(config)
        _check_datatypes(config)
        _apply_thread_counts(opts, config.name)
        device = torch_device(placement, config)
        model_file = resolve_model_file(model_file)
        stamp = model_file.stat().st_mtime_ns if model_file.exists() else 0
        key = (config.name, f"{model_file.resolve()}@{stamp}", str(device))
        with self._lock:
            loaded = self._shared.get(key) if opts.weight_sharing else None
            if loaded is None:
                loaded = _Loaded(*_load_module(model_file, config, device))
                if opts.weight_sharing:
                    self._shared[key] = loaded
        module, sig = loaded.module, loaded.signature
        inputs = plan_inputs(config.name, [t.name for t in config.input], sig)
        outputs = plan_outputs([t.name for t in config.output])
        output_types = {t.name: datatypes.config_to_wire(t.data_type) for t in config.output}
        log.info("model '%s' instance %d on %s: inputs by %s", config.name, placement.index, device,
                 inputs.convention.replace("_", " "))
        instance = TorchInstance(config.name, module, sig, inputs, outputs, output_types, device, opts,
                                 config.max_batch_size > 0)
        instance.holder = loaded  # keeps a shared module alive exactly as long as an instance uses it
        return instance
