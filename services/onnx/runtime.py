"""onnxruntime adapter honouring Triton's onnxruntime backend parameters.

Config parameters read (as Triton's onnxruntime backend does): `intra_op_thread_count` (unset:
`default_intra_threads`, not onnxruntime's default; see there), `inter_op_thread_count`, `execution_mode` (0 sequential, 1 parallel), `enable_mem_arena`,
`enable_mem_pattern`; `optimization { graph { level } }`: -1 basic, 1 extended,
2 disable all, unset/0 all. KIND_GPU instances use the CUDA execution provider (device per
instance) and fail loading with a clear message when onnxruntime has no CUDA provider.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.base.runtime import InstancePlacement, RuntimeLoadError, config_int
from services.onnx import load_guard

_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def default_intra_threads() -> int:
    """Intra-op threads of a session whose config does not set `intra_op_thread_count`: half the
    CPUs this process may run on, at least 1 (1 on a 2-core machine).

    onnxruntime's own default (what Triton gives such a config) is one thread per physical core,
    its pool threads pinned to cores whatever the process's CPU set (on 2 cores: every session's
    pool thread on core 1, even in a process started with `taskset -c 0`). That assumes the process
    owns the machine; a meshserve service shares it with its own event loop, the gateway and the
    other services. Measured on 2 shared cores (docs/perf/mlp-and-onnxruntime.md, "Round 4"): mlp
    at ~23 rows per run costs the service's onnxruntime threads ~10% less CPU per row with 1 thread
    than with onnxruntime's default, ~13% less than with 2 unpinned threads: with 2, the calling
    thread busy-waits (`pause`, whatever `session.intra_op.allow_spinning` says) at the end of every
    parallel section for a pool thread that the other processes keep off its core ("Session 12":
    10-12% of the service's CPU through the gateway at c32). A config's `intra_op_thread_count`
    wins, 0 included (onnxruntime's default, as in Triton)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no sched_getaffinity on this platform)
        cpus = os.cpu_count() or 1
    return max(1, cpus // 2)


def session_options(config: mc.ModelConfig) -> ort.SessionOptions:
    so = ort.SessionOptions()
    intra = config_int(config, "intra_op_thread_count")
    inter = config_int(config, "inter_op_thread_count")
    mode = config_int(config, "execution_mode")
    so.intra_op_num_threads = default_intra_threads() if intra is None else intra
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


# onnxruntime's tensor type names -> the config's (what Triton's onnxruntime backend compares)
_GRAPH_TYPES = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING", "tensor(bfloat16)": "TYPE_BF16",
}
_ONNX_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16


def _graph_dims(shape: list[object]) -> list[int]:
    """A graph tensor's shape as Triton reads it: a symbolic or unknown dimension is -1."""
    return [d if isinstance(d, int) else -1 for d in shape]


def _shape_text(dims: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"  # Triton's ShapeToString


def _compare_dims(model: str, name: str, graph: list[int], dims: list[int], max_batch_size: int,
                  exact: bool) -> None:
    """Triton's CompareDimsSupported (onnxruntime_utils.cc): the config's dims against the graph's."""
    if max_batch_size > 0:
        if not graph or graph[0] != -1:
            raise RuntimeLoadError(
                f"model '{model}', tensor '{name}': for the model to support batching the shape should have "
                f"at least 1 dimension and the first dimension must be -1; but shape expected by the model "
                f"is {_shape_text(graph)}")
        full = [-1, *dims]
        if len(graph) != len(full) or any((exact or g != -1) and g != f for g, f in zip(graph, full, strict=True)):
            raise RuntimeLoadError(
                f"model '{model}', tensor '{name}': the model expects {len(graph)} dimensions (shape "
                f"{_shape_text(graph)}) but the model configuration specifies {len(full)} dimensions (an initial "
                f"batch dimension because max_batch_size > 0 followed by the explicit tensor shape, making "
                f"complete shape {_shape_text(full)})")
    elif len(graph) != len(dims) or any((exact or g != -1) and g != d for g, d in zip(graph, dims, strict=True)):
        raise RuntimeLoadError(
            f"model '{model}', tensor '{name}': the model expects {len(graph)} dimensions (shape "
            f"{_shape_text(graph)}) but the model configuration specifies {len(dims)} dimensions (shape "
            f"{_shape_text(dims)})")


def check_against_graph(session: ort.InferenceSession, config: mc.ModelConfig) -> None:
    """Refuse at load a config its graph cannot answer, as Triton's onnxruntime backend does
    (ValidateInputs / ValidateOutputs, with its texts): the input count, every config tensor's
    name, datatype and dims (reshape when given; a scalar graph tensor takes dims of 1s only).
    RuntimeLoadError names the model and the tensor at fault."""
    model = config.name
    graph_in = {i.name: i for i in session.get_inputs()}
    graph_in.update({i.name: i for i in session.get_overridable_initializers()})
    graph_out = {o.name: o for o in session.get_outputs()}
    sb = config.sequence_batching
    # (the sequence service lists control and state inputs among the inputs too: count names once)
    named = {t.name for t in config.input if not t.optional} | {c.name for c in sb.control_input} \
        | {s.input_name for s in sb.state}
    expected = len(named) + len(config.batch_input)
    provided = len(session.get_inputs())
    if provided != expected:
        raise RuntimeLoadError(f"unable to load model '{model}', configuration expects {expected} inputs, "
                               f"model provides {provided}")
    for kind, tensors, graph in (("input", config.input, graph_in), ("output", config.output, graph_out)):
        batch_outputs = {n for b in config.batch_output for n in b.target_name} if kind == "output" else set()
        for t in tensors:
            info = graph.get(t.name)
            if info is None:
                raise RuntimeLoadError(f"unexpected inference {kind} '{t.name}', allowed {kind}s are: "
                                       + ", ".join(sorted(graph)))
            want = mc.DataType.Name(t.data_type)
            have = _GRAPH_TYPES.get(info.type, "TYPE_INVALID")
            if want != have:
                raise RuntimeLoadError(f"unable to load model '{model}', configuration expects datatype {want} "
                                       f"for {kind} '{t.name}', model provides {have}")
            if t.name in batch_outputs:
                continue
            dims = list(t.reshape.shape) if t.HasField("reshape") else list(t.dims)
            shape = _graph_dims(info.shape)
            if kind == "input" and t.allow_ragged_batch:
                if shape != [-1]:
                    raise RuntimeLoadError(
                        f"unable to load model '{model}', configuration expects model provides input with shape "
                        f"[-1]  for ragged input '{t.name}', model provides {_shape_text(shape)}")
            elif shape:
                _compare_dims(model, t.name, shape, dims, config.max_batch_size, exact=kind == "output")
            elif any(d != 1 for d in dims):
                raise RuntimeLoadError(
                    f"unable to load model '{model}', scalar tensor '{t.name}', should only provide 1 in the model "
                    f"configuration when the model doesn't support batching. Model configuration provided: "
                    f"{_shape_text(dims)}.")


class OnnxInstance:
    """One onnxruntime session.

    A graph input of rank 0 is fed a true scalar (the request's one element), as Triton's
    onnxruntime backend does; a rank-0 result takes its config dims in the response encoder
    (services/base/serialization.py:scalar_as_config). BF16 tensors, which numpy has no type
    for, travel as uint16 holding the raw bits: in through OrtValues typed bfloat16, out as the
    bytes onnxruntime wrote."""

    def __init__(self, session: ort.InferenceSession, batched: bool = False):
        self.session = session
        self.providers = session.get_providers()
        self._scalars = frozenset(i.name for i in session.get_inputs() if not i.shape)
        # a batched model with a scalar graph input runs each request alone (ModelVersion reads it)
        self.runs_alone = bool(self._scalars) and batched
        self._bf16_in = frozenset(i.name for i in session.get_inputs() if i.type == "tensor(bfloat16)")
        self._bf16_out = frozenset(o.name for o in session.get_outputs() if o.type == "tensor(bfloat16)")
        self._binding: ort.IOBinding | None = None

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        for name, arr in inputs.items():
            if arr.dtype == np.object_:
                inputs[name] = _as_str_array(arr, name)
        if self._scalars:
            for name in self._scalars.intersection(inputs):
                arr = inputs[name]
                if arr.size != 1:
                    raise InferError.invalid(
                        f"input '{name}' is a scalar in the model: a request (and a batch) carries one element, "
                        f"got shape {list(arr.shape)}")
                inputs[name] = arr.reshape(())
        if self._bf16_in or self._bf16_out:
            return self._run_values(inputs, output_names)
        results = self.session.run(output_names, inputs)
        return dict(zip(output_names, results, strict=True))

    def _run_values(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        """A run through OrtValues bound to an IOBinding, for models with BF16 tensors (measured:
        ~19 us a run of a small identity where ``run_with_ort_values`` took ~156 us; session.run
        ~30 us). An instance runs one batch at a time: one binding per instance."""
        io = self._binding
        if io is None:
            io = self._binding = self.session.io_binding()
        for n, a in inputs.items():
            a = np.ascontiguousarray(a)
            io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, _ONNX_BFLOAT16)
                                   if n in self._bf16_in else ort.OrtValue.ortvalue_from_numpy(a))
        for n in output_names:
            io.bind_output(n, "cpu")
        try:
            self.session.run_with_iobinding(io)
            results = io.get_outputs()
        finally:
            io.clear_binding_inputs()
            io.clear_binding_outputs()
        out: dict[str, np.ndarray] = {}
        for n, value in zip(output_names, results, strict=True):
            if n in self._bf16_out:
                raw = ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())
                out[n] = np.frombuffer(raw, dtype="<u2").reshape(value.shape())
            else:
                out[n] = value.numpy()
        return out

    def close(self) -> None:
        del self.session


def _as_str_array(arr: np.ndarray, name: str) -> np.ndarray:
    """onnxruntime string tensors hold Python str (UTF-8); BYTES elements arrive as bytes."""
    try:
        return np.array([v.decode("utf-8") if isinstance(v, bytes) else v for v in arr.reshape(-1)],
                        dtype=np.object_).reshape(arr.shape)
    except UnicodeDecodeError:
        raise InferError.invalid(f"input '{name}': onnxruntime string tensors must be UTF-8 text") from None


class OnnxRuntimeAdapter:
    name = "onnxruntime"
    guard_load = staticmethod(load_guard.check)  # an uploaded model's load, bounded in memory first

    @staticmethod
    def prime() -> None:
        """onnxruntime's one-time start (its environment, kernel registries: ~10-19 MiB its first
        session keeps for good) paid before the first onnxruntime model loads, so that it counts in the
        service's base and not in that model's size (services/base/memory.py:MemoryBook.prime)."""
        from onnx import TensorProto, helper

        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "y")]
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "prime", io[:1], io[1:])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.ones(1, np.float32)})

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
        check_against_graph(session, config)
        return OnnxInstance(session, config.max_batch_size > 0)
