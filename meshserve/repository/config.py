"""Triton model configuration pipeline: parse → autocomplete → normalize → validate → reload diff.

Follows Triton core (``model_config_utils.cc``) and the onnxruntime backend's auto-complete, so
that a repository that loads in Triton loads here with the same effective config.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository.errors import ConfigError
from meshserve.repository.kinds import KINDS, python_based_backend
from meshserve.repository.names import NAME_RULE, is_valid_model_name
from meshserve.repository.versions import available_versions, select_versions

__all__ = [
    "BACKEND_COMPLETERS",
    "BACKEND_TO_PLATFORM",
    "CONFIG_FILENAME",
    "ConfigError",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MODEL_FILENAMES",
    "ENSEMBLE_PLATFORM",
    "KNOWN_BACKENDS",
    "KNOWN_PLATFORMS",
    "PLATFORM_TO_BACKEND",
    "autocomplete",
    "config_errors",
    "load_model_config",
    "normalize",
    "parse_config",
    "parse_config_json",
    "prepare_config",
    "problems",
    "validate",
]

CONFIG_FILENAME = "config.pbtxt"
ENSEMBLE_PLATFORM = "ensemble"
# what the backend kinds serve (meshserve/repository/kinds.py, one row per kind)
PLATFORM_TO_BACKEND: dict[str, str] = {p: b for k in KINDS for p, b in k.platforms.items() if b}
BACKEND_TO_PLATFORM: dict[str, str] = {b: p for p, b in PLATFORM_TO_BACKEND.items()}
KNOWN_BACKENDS: frozenset[str] = frozenset(b for k in KINDS for b in k.backends)
KNOWN_PLATFORMS: frozenset[str] = frozenset(p for k in KINDS for p in k.platforms)
DEFAULT_MODEL_FILENAMES: dict[str, str] = {b: files[0] for k in KINDS for b, files in k.backends.items()}
# backend -> a completer that fills a config from the model itself, run by ``autocomplete`` in the
# process that registered it: the python service registers the one that runs a model.py's
# ``auto_complete_config`` (services/python/autocomplete.py). Elsewhere (the gateway, check-repo)
# a python model's config is taken as written.
BackendCompleter = Callable[[mc.ModelConfig, Path], mc.ModelConfig]
BACKEND_COMPLETERS: dict[str, BackendCompleter] = {}
# Triton's --backend-config=onnxruntime,default-max-batch-size default.
DEFAULT_MAX_BATCH_SIZE = 4
# Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS.
SEQUENCE_IDLE_DEFAULT_MICROSECONDS = 1_000_000


_KIND_AUTO = mc.ModelInstanceGroup.KIND_AUTO
_KIND_GPU = mc.ModelInstanceGroup.KIND_GPU
_KIND_CPU = mc.ModelInstanceGroup.KIND_CPU
_KIND_MODEL = mc.ModelInstanceGroup.KIND_MODEL
_CONTROL = mc.ModelSequenceBatching.Control
_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)
# ONNX element type name -> config DataType, as the onnxruntime backend maps them
# (BFLOAT16 and complex types have no mapping there either).
_ONNX_TO_CONFIG: dict[str, int] = {
    "BOOL": mc.TYPE_BOOL, "UINT8": mc.TYPE_UINT8, "UINT16": mc.TYPE_UINT16,
    "UINT32": mc.TYPE_UINT32, "UINT64": mc.TYPE_UINT64, "INT8": mc.TYPE_INT8,
    "INT16": mc.TYPE_INT16, "INT32": mc.TYPE_INT32, "INT64": mc.TYPE_INT64,
    "FLOAT16": mc.TYPE_FP16, "FLOAT": mc.TYPE_FP32, "DOUBLE": mc.TYPE_FP64,
    "STRING": mc.TYPE_STRING,
}


# ----------------------------------------------------------------------------------- parse


_PARSE_FIELD_PATTERNS = (
    re.compile(r'has no field named "(\w+)"'),
    re.compile(r"for field (\w+)"),
    re.compile(r'should not have multiple "(\w+)" fields'),
    re.compile(r'Field "(?:[\w.]*\.)?(\w+)" is specified along with'),
    re.compile(r'Message type "[\w.]+" has no field named "(\w+)"'),
)


def instance_count(config: mc.ModelConfig) -> int:
    """The instances a config's instance groups make, at least one (a group's count of 0, unset,
    is one instance, as Triton's)."""
    return max(1, sum(max(1, g.count) for g in config.instance_group))


def sequence_slots(config: mc.ModelConfig, instances: int) -> int:
    """The sequences a stateful model's ``instances`` hold at once (the rest wait in a backlog),
    Triton's rule (sequence_batch_scheduler.cc: seq_slot_cnt_ per instance, a batcher each):
    oldest's ``max_candidate_sequences`` per instance, else ``max(1, max_batch_size)`` per
    instance (direct's slots, and oldest's without it)."""
    sb = config.sequence_batching
    each = sb.oldest.max_candidate_sequences if sb.WhichOneof("strategy_choice") == "oldest" else 0
    return (each if each > 0 else max(1, config.max_batch_size)) * instances


def _copy(config: mc.ModelConfig) -> mc.ModelConfig:
    out = mc.ModelConfig()
    out.CopyFrom(config)
    return out


def parse_config(path: str | Path) -> mc.ModelConfig:
    """Parse a ``config.pbtxt`` (protobuf text format) into a ModelConfig.

    Raises ConfigError with the line and column protobuf reports; the model is named after
    the directory holding the file.
    """
    path = Path(path)
    model = path.parent.name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, model, "", "file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(path, model, "", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(path, model, "", f"cannot read: {e.strerror or e}") from None
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        detail = re.sub(r"^\d+:\d+ : ", "", str(e))
        source_line = text.splitlines()[line - 1] if line and line <= len(text.splitlines()) else ""
        for echoed in (source_line, source_line.strip()):
            if echoed and detail.startswith(f"'{echoed}': "):
                detail = detail[len(echoed) + 4:]  # protobuf echoes the line; we give line/column
                break
        field = _parse_error_field(detail)
        if not field and col and detail.startswith(("Enum type", "Couldn't parse")):
            # Bad value: the field is the last "name:" before the column.
            names = re.findall(r"(\w+)\s*:", source_line[: col - 1])
            field = names[-1] if names else ""
        where = f"line {line}, column {col}: " if line is not None else ""
        raise ConfigError(path, model, field, where + detail) from None


def parse_config_json(text: str, *, source: str = "", model: str = "") -> mc.ModelConfig:
    """Parse a ModelConfig written as JSON (snake_case or camelCase names, as Triton prints it)."""
    try:
        return json_format.Parse(text, mc.ModelConfig())
    except json_format.ParseError as e:
        detail = str(e)
        raise ConfigError(source, model, _parse_error_field(detail), detail) from None


def _parse_error_field(detail: str) -> str:
    for pattern in _PARSE_FIELD_PATTERNS:
        m = pattern.search(detail)
        if m:
            return m.group(1)
    return ""


# ------------------------------------------------------------------------------ autocomplete


@dataclass(frozen=True)
class _OnnxTensor:
    name: str
    elem_type: str  # ONNX element type name, "" when the value is not a tensor
    value_kind: str  # "tensor_type", "sequence_type", ...
    dims: tuple[int, ...]  # -1 for symbolic or unknown dimensions


def autocomplete(config: mc.ModelConfig, model_dir: str | Path,
                 model_file: Path | None = None) -> mc.ModelConfig:
    """Fill what the config omits, as Triton's server and onnxruntime backend do.

    - ``name`` from the directory; ``backend`` from ``default_model_filename`` or from the
      model file found in a version directory (``model.onnx``/``.plan``/``.pt``/``.py``).
    - ONNX models: when ``input`` or ``output`` is empty, ``max_batch_size`` (set to
      ``DEFAULT_MAX_BATCH_SIZE`` when 0 and every input and output has a dynamic first
      dimension, plus ``dynamic_batching {}`` when it is > 1 and no batcher is set) and the
      missing entries (name, data_type, dims; the batch dimension left out when
      max_batch_size > 0). Listed entries get a missing ``data_type``/``dims`` from the graph.
    - A backend with a registered completer (``BACKEND_COMPLETERS``: python) is completed by it.

    ``model_file`` is the ONNX file (or directory) to read; None looks for it in the model
    directory (highest version the policy selects). Returns a new message.
    """
    out = _copy(config)
    model_dir = Path(model_dir)
    if not out.name:
        out.name = model_dir.name
    _autocomplete_backend(out, model_dir)
    completer = BACKEND_COMPLETERS.get("python" if python_based_backend(out.backend) is not None else out.backend)
    if completer is not None:
        return completer(out, model_dir)
    if _is_onnx(out):
        path = model_file if model_file is not None else _find_model_file(out, model_dir)
        if path is not None:
            _autocomplete_onnx(out, Path(path))
    return out


def _is_onnx(config: mc.ModelConfig) -> bool:
    return config.platform == "onnxruntime_onnx" or config.backend == "onnxruntime"


def _autocomplete_backend(config: mc.ModelConfig, model_dir: Path) -> None:
    if config.platform or config.backend:
        return
    by_filename = {f: b for b, f in DEFAULT_MODEL_FILENAMES.items()}
    if config.default_model_filename:
        config.backend = by_filename.get(config.default_model_filename, "")
        return
    for version in reversed(available_versions(model_dir)):
        for filename, backend in by_filename.items():
            if (model_dir / str(version) / filename).exists():
                config.backend = backend
                return


def _find_model_file(config: mc.ModelConfig, model_dir: Path) -> Path | None:
    filename = config.default_model_filename or DEFAULT_MODEL_FILENAMES["onnxruntime"]
    available = available_versions(model_dir)
    policy = config.version_policy if config.HasField("version_policy") else _latest(1)
    try:
        selected = select_versions(policy, available)
    except ConfigError:
        selected = []  # validation and scan report the policy problem
    for version in [*reversed(selected), *reversed(available)]:
        candidate = model_dir / str(version) / filename
        if candidate.exists():
            return candidate
    return None


def _latest(n: int) -> mc.ModelVersionPolicy:
    policy = mc.ModelVersionPolicy()
    policy.latest.num_versions = n
    return policy


_OnnxIO = tuple[tuple[_OnnxTensor, ...], tuple[_OnnxTensor, ...]]


def _read_onnx_io(path: Path, model: str) -> _OnnxIO:
    """Graph inputs (initializers excluded) and outputs of an ONNX model.

    Cached by file identity, so that polling a repository does not re-read unchanged models.
    """
    file = path / "model.onnx" if path.is_dir() else path
    try:
        st = file.stat()
    except FileNotFoundError:
        raise ConfigError(file, model, "", "ONNX model file not found") from None
    except OSError as e:
        raise ConfigError(file, model, "", f"cannot read ONNX model: {e.strerror or e}") from None
    try:
        return _load_onnx_io(str(file.resolve()), st.st_mtime_ns, st.st_size)
    except Exception as e:  # onnx raises DecodeError, OSError, ValueError ...
        raise ConfigError(file, model, "", f"cannot read ONNX model: {e}") from None


@functools.lru_cache(maxsize=256)
def _load_onnx_io(file: str, mtime_ns: int, size: int) -> _OnnxIO:
    import onnx  # deferred: heavy, and only ONNX models need it

    model_proto = onnx.load(file, load_external_data=False)  # external weights stay on disk
    graph = model_proto.graph
    initializers = {t.name for t in graph.initializer}
    initializers.update(t.values.name for t in graph.sparse_initializer)
    inputs = [vi for vi in graph.input if vi.name not in initializers]
    outputs = list(graph.output)
    if any(not _has_shape(vi) for vi in outputs):
        # onnxruntime infers output shapes at session creation; do the same here.
        try:
            inferred = onnx.shape_inference.infer_shapes(model_proto)
            outputs = list(inferred.graph.output)
        except Exception:  # shapes stay unknown; not worth failing the load over
            pass
    return tuple(_onnx_tensor(vi) for vi in inputs), tuple(_onnx_tensor(vi) for vi in outputs)


def _has_shape(vi: Any) -> bool:
    return vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.HasField("shape")


def _onnx_tensor(vi: Any) -> _OnnxTensor:
    import onnx

    kind = vi.type.WhichOneof("value") or "unknown"
    if kind != "tensor_type":
        return _OnnxTensor(vi.name, "", kind, ())
    tt = vi.type.tensor_type
    elem = onnx.TensorProto.DataType.Name(tt.elem_type) if tt.elem_type else "UNDEFINED"
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
    return _OnnxTensor(vi.name, elem, kind, dims)


def _autocomplete_onnx(config: mc.ModelConfig, path: Path) -> None:
    ins, outs = _read_onnx_io(path, config.name)
    file = str(path)
    input_cnt = len(config.input) + len(config.batch_input)
    output_cnt = len(config.output)
    if input_cnt > 0 and output_cnt > 0:
        # Triton skips auto-complete entirely here; we only fill missing data_type/dims.
        _complete_listed(config, config.input, "input", ins, file)
        _complete_listed(config, config.output, "output", outs, file)
        return

    can_batch = all(t.dims and t.dims[0] == -1 for t in (*ins, *outs))
    if can_batch:
        if config.max_batch_size == 0:
            config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        if config.max_batch_size > 1 and config.WhichOneof("scheduling_choice") is None:
            config.dynamic_batching.SetInParent()
    elif config.max_batch_size > 0:  # negative values are left to validate()
        raise ConfigError(file, config.name, "max_batch_size",
                          f"is {config.max_batch_size} but the ONNX model does not support batching "
                          "(every input and output needs a dynamic first dimension)")

    if input_cnt == 0:
        for t in ins:
            _fill_io(config, config.input.add(), "input", len(config.input) - 1, t, file, name=True)
    else:
        _complete_listed(config, config.input, "input", ins, file)
    if output_cnt == 0:
        for t in outs:
            _fill_io(config, config.output.add(), "output", len(config.output) - 1, t, file, name=True)
    else:
        _complete_listed(config, config.output, "output", outs, file)


def _complete_listed(config: mc.ModelConfig, entries: Any, kind: str,
                     tensors: Sequence[_OnnxTensor], file: str) -> None:
    by_name = {t.name: t for t in tensors}
    for i, io in enumerate(entries):
        t = by_name.get(io.name)
        if t is None:
            if io.name:
                known = ", ".join(sorted(by_name)) or "none"
                raise ConfigError(file, config.name, f"{kind}[{i}].name",
                                  f"'{io.name}' is not an {kind} of the ONNX model ({kind}s: {known})")
            continue
        _fill_io(config, io, kind, i, t, file, name=False)


def _fill_io(config: mc.ModelConfig, io: Any, kind: str, index: int, t: _OnnxTensor,
             file: str, *, name: bool) -> None:
    field = f"{kind}[{index}]"
    if t.value_kind != "tensor_type":
        raise ConfigError(file, config.name, field,
                          f"ONNX {kind} '{t.name}' is a {t.value_kind.removesuffix('_type')}; "
                          "only tensors are supported")
    if name:
        io.name = t.name
    if io.data_type == mc.TYPE_INVALID:
        data_type = _ONNX_TO_CONFIG.get(t.elem_type)
        if data_type is None:
            raise ConfigError(file, config.name, f"{field}.data_type",
                              f"ONNX element type {t.elem_type} of '{t.name}' is not supported")
        io.data_type = data_type
    if not io.dims and not io.HasField("reshape"):
        dims = list(t.dims[1:] if config.max_batch_size > 0 else t.dims)
        if not dims:
            # A scalar: Triton writes dims [1], with an empty reshape when batching.
            dims = [1]
            if config.max_batch_size > 0:
                io.reshape.SetInParent()
        io.dims.extend(dims)


# --------------------------------------------------------------------------------- normalize


def normalize(config: mc.ModelConfig, model_name: str, *, gpu_available: bool = False) -> mc.ModelConfig:
    """Fill Triton's defaults; returns a new message.

    ``name`` from ``model_name`` when empty; the missing one of the platform/backend pair;
    ``default_model_filename`` for known backends; ``version_policy {latest {num_versions: 1}}``;
    ``dynamic_batching.preferred_batch_size`` = [max_batch_size] when none are given (Triton
    does this); sequence batching idle default (1 s) and oldest-strategy preferred sizes; and
    for non-ensembles pinned-memory optimization flags and ``instance_group``: one group when
    none, each group named ``<model>_<i>`` when unnamed, KIND_AUTO resolved to KIND_GPU if
    ``gpu_available`` else KIND_CPU, count 0 → 1.
    """
    out = _copy(config)
    if not out.name:
        out.name = model_name
    if out.platform in PLATFORM_TO_BACKEND and not out.backend:
        out.backend = PLATFORM_TO_BACKEND[out.platform]
    if out.backend in BACKEND_TO_PLATFORM and not out.platform:
        out.platform = BACKEND_TO_PLATFORM[out.backend]
    if not out.default_model_filename and out.backend in DEFAULT_MODEL_FILENAMES:
        out.default_model_filename = DEFAULT_MODEL_FILENAMES[out.backend]
    if not out.HasField("version_policy"):
        out.version_policy.latest.num_versions = 1

    if out.HasField("dynamic_batching"):
        db = out.dynamic_batching
        if not db.preferred_batch_size and out.max_batch_size > 0:
            db.preferred_batch_size.append(out.max_batch_size)
    if out.HasField("sequence_batching"):
        sb = out.sequence_batching
        if sb.max_sequence_idle_microseconds == 0:
            sb.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_MICROSECONDS
        if sb.HasField("oldest") and not sb.oldest.preferred_batch_size and out.max_batch_size > 0:
            sb.oldest.preferred_batch_size.append(out.max_batch_size)

    if not _is_ensemble(out):
        opt = out.optimization
        if not opt.HasField("input_pinned_memory"):
            opt.input_pinned_memory.enable = True
        if not opt.HasField("output_pinned_memory"):
            opt.output_pinned_memory.enable = True
        if not out.instance_group:
            out.instance_group.add(name=out.name)  # Triton names the default group after the model
        for i, group in enumerate(out.instance_group):
            if not group.name:
                group.name = f"{out.name}_{i}"
            if group.kind == _KIND_AUTO:
                group.kind = _KIND_GPU if gpu_available else _KIND_CPU
            if group.count == 0:
                # Triton's SetDefaultInstanceCount: 2 CPU instances for onnxruntime (and
                # tensorflow), otherwise 1.
                group.count = 2 if group.kind == _KIND_CPU and out.backend == "onnxruntime" else 1
    return out


def _is_ensemble(config: mc.ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM or config.HasField("ensemble_scheduling")


# ---------------------------------------------------------------------------------- validate


@dataclass(frozen=True)
class _Problem:
    field: str
    message: str

    def __str__(self) -> str:
        return f"field '{self.field}': {self.message}" if self.field else self.message


_Add = Callable[[str, str], None]


def validate(config: mc.ModelConfig, file: str | Path, model_dir_name: str | None) -> None:
    """Raise ConfigError (file, model, field) for the first problem ``problems`` would list."""
    found = config_errors(config, file, model_dir_name)
    if found:
        raise found[0]


def config_errors(config: mc.ModelConfig, file: str | Path, model_dir_name: str | None) -> list[ConfigError]:
    """Every problem of a (normalized) config as a ConfigError naming file, model and field."""
    model = config.name or model_dir_name or ""
    return [ConfigError(file, model, p.field, p.message) for p in _collect(config, model_dir_name)]


def problems(config: mc.ModelConfig, model_dir_name: str | None = None) -> list[str]:
    """Every problem of a (normalized) config, each as ``field '<path>': <what is wrong>``."""
    return [str(p) for p in _collect(config, model_dir_name)]


def _collect(c: mc.ModelConfig, dir_name: str | None) -> list[_Problem]:
    found: list[_Problem] = []

    def add(field: str, message: str) -> None:
        found.append(_Problem(field, message))

    if not c.name:
        add("name", "missing")
    elif dir_name is not None and c.name != dir_name:
        add("name", f"'{c.name}' does not match the model directory name '{dir_name}'")
    _check_platform(c, add)
    if c.max_batch_size < 0:
        add("max_batch_size", f"must be >= 0, got {c.max_batch_size}")
    _check_version_policy(c, add)
    _check_io(c.input, "input", c.max_batch_size, add)
    _check_io(c.output, "output", c.max_batch_size, add)
    _check_dynamic_batching(c, add)
    _check_sequence_batching(c, add)
    _check_ensemble(c, add)
    _check_instance_groups(c, add)
    return found


def _check_platform(c: mc.ModelConfig, add: _Add) -> None:
    platform, backend = c.platform, c.backend
    if not platform and not backend:
        add("backend", "missing: set 'backend' or 'platform' (known backends: "
            f"{', '.join(sorted(KNOWN_BACKENDS))}; platforms: {', '.join(sorted(KNOWN_PLATFORMS))})")
        return
    if backend and backend not in KNOWN_BACKENDS and python_based_backend(backend) is None:
        add("backend", f"unknown backend '{backend}' (known: {', '.join(sorted(KNOWN_BACKENDS))}; "
                       f"a backend written in Python: --backend-directory DIR with DIR/{backend}/model.py)")
    if platform and platform not in KNOWN_PLATFORMS:
        add("platform", f"unknown platform '{platform}' (known: {', '.join(sorted(KNOWN_PLATFORMS))})")
    if platform == ENSEMBLE_PLATFORM:
        if backend:
            add("backend", f"must be empty for platform 'ensemble', got '{backend}'")
    elif platform in PLATFORM_TO_BACKEND and backend in KNOWN_BACKENDS \
            and PLATFORM_TO_BACKEND[platform] != backend:
        add("backend", f"'{backend}' does not go with platform '{platform}' "
            f"(expected '{PLATFORM_TO_BACKEND[platform]}')")


def _check_version_policy(c: mc.ModelConfig, add: _Add) -> None:
    if not c.HasField("version_policy"):
        add("version_policy", "missing")
        return
    vp = c.version_policy
    choice = vp.WhichOneof("policy_choice")
    if choice == "latest" and vp.latest.num_versions < 1:
        add("version_policy.latest.num_versions", "must be >= 1, got 0")
    elif choice == "specific":
        if not vp.specific.versions:
            add("version_policy.specific.versions", "missing: list at least one version")
        for i, v in enumerate(vp.specific.versions):
            if v < 0:
                add(f"version_policy.specific.versions[{i}]", f"must be >= 0, got {v}")


def _element_count(shape: Sequence[int]) -> int:
    """Triton's GetElementCount: 0 for an empty shape, -1 when any dimension is variable."""
    if not shape:
        return 0
    if -1 in shape:
        return -1
    return math.prod(shape)


def _trunks(shape: Iterable[int]) -> list[int]:
    """Element counts of the runs between variable (-1) dimensions."""
    counts, current = [], 1
    for d in shape:
        if d == -1:
            counts.append(current)
            current = 1
        else:
            current *= d
    counts.append(current)
    return counts


def _check_name(name: str, field: str, seen: set[str], duplicate: str, add: _Add) -> None:
    """A tensor's name: given, and not one of ``seen`` (which it joins)."""
    if not name:
        add(f"{field}.name", "missing")
    elif name in seen:
        add(f"{field}.name", duplicate)
    seen.add(name)


def _check_io(entries: Any, kind: str, max_batch_size: int, add: _Add) -> None:
    seen: set[str] = set()
    valid_types = set(mc.DataType.values()) - {mc.TYPE_INVALID}
    for i, io in enumerate(entries):
        f = f"{kind}[{i}]"
        _check_name(io.name, f, seen, f"duplicate {kind} name '{io.name}'", add)
        if io.data_type == mc.TYPE_INVALID:
            add(f"{f}.data_type", "missing")
        elif io.data_type not in valid_types:
            add(f"{f}.data_type", f"unknown data type {io.data_type}")
        has_reshape = io.HasField("reshape")
        if not io.dims and not has_reshape:
            add(f"{f}.dims", "missing")
        for j, d in enumerate(io.dims):
            if d < 1 and d != -1:
                add(f"{f}.dims[{j}]", f"must be >= 1, or -1 for a variable dimension, got {d}")
        if not has_reshape:
            continue
        shape = list(io.reshape.shape)
        if not shape and max_batch_size == 0:
            add(f"{f}.reshape", "empty reshape (a scalar) needs max_batch_size > 0")
        bad = [d for d in shape if d < 1 and d != -1]
        if bad:
            add(f"{f}.reshape.shape", f"dimensions must be >= 1 or -1, got {bad[0]}")
            continue
        dims_size, reshape_size = _element_count(io.dims), _element_count(shape)
        if dims_size != reshape_size and (reshape_size != 0 or dims_size != 1):
            add(f"{f}.reshape", f"shape {shape} has a different element count than dims {list(io.dims)}")
        elif dims_size == -1 and _trunks(io.dims) != _trunks(shape):
            add(f"{f}.reshape", f"shape {shape} does not match dims {list(io.dims)} "
                "between variable dimensions")


def _check_preferred(sizes: Sequence[int], field: str, max_batch_size: int, add: _Add) -> None:
    for j, size in enumerate(sizes):
        if size <= 0:
            add(f"{field}[{j}]", f"must be > 0, got {size}")
        elif size > max_batch_size:
            add(f"{field}[{j}]", f"{size} exceeds max_batch_size {max_batch_size}")


def _check_dynamic_batching(c: mc.ModelConfig, add: _Add) -> None:
    if not c.HasField("dynamic_batching"):
        return
    db = c.dynamic_batching
    if c.max_batch_size == 0:
        add("dynamic_batching", "not allowed when max_batch_size is 0 (the model does not batch)")
        return
    _check_preferred(db.preferred_batch_size, "dynamic_batching.preferred_batch_size",
                     c.max_batch_size, add)
    levels = db.priority_levels
    if levels:
        if not 1 <= db.default_priority_level <= levels:
            add("dynamic_batching.default_priority_level",
                f"must be in [1, {levels}], got {db.default_priority_level}")
        for level in sorted(db.priority_queue_policy):
            if not 1 <= level <= levels:
                add(f"dynamic_batching.priority_queue_policy[{level}]",
                    f"priority level must be in [1, {levels}]")
    if db.preserve_ordering:
        if levels > 1:
            add("dynamic_batching.preserve_ordering", "needs a single priority level")
        policies = [("default_queue_policy", db.default_queue_policy)]
        policies += [(f"priority_queue_policy[{k}]", v) for k, v in sorted(db.priority_queue_policy.items())]
        for name, policy in policies:
            if policy.default_timeout_microseconds and policy.timeout_action == mc.ModelQueuePolicy.DELAY:
                add(f"dynamic_batching.{name}.timeout_action",
                    "DELAY cannot be combined with preserve_ordering")


def _check_sequence_batching(c: mc.ModelConfig, add: _Add) -> None:
    if not c.HasField("sequence_batching"):
        return
    sb = c.sequence_batching
    if sb.HasField("oldest"):
        _check_preferred(sb.oldest.preferred_batch_size, "sequence_batching.oldest.preferred_batch_size",
                         c.max_batch_size, add)
    if sb.HasField("direct") and not 0.0 <= sb.direct.minimum_slot_utilization <= 1.0:
        add("sequence_batching.direct.minimum_slot_utilization",
            f"must be in [0, 1], got {sb.direct.minimum_slot_utilization}")
    names: set[str] = set()
    kinds: set[int] = set()
    for i, ci in enumerate(sb.control_input):
        f = f"sequence_batching.control_input[{i}]"
        _check_name(ci.name, f, names, f"control tensor '{ci.name}' is listed more than once", add)
        if not ci.control:
            add(f"{f}.control", "missing")
        for j, ctl in enumerate(ci.control):
            cf = f"{f}.control[{j}]"
            kind_name = _CONTROL.Kind.Name(ctl.kind)
            if ctl.kind in kinds:
                add(f"{cf}.kind", f"{kind_name} is given more than once")
            kinds.add(ctl.kind)
            given = [(n, len(v)) for n, v in (("int32_false_true", ctl.int32_false_true),
                                              ("fp32_false_true", ctl.fp32_false_true),
                                              ("bool_false_true", ctl.bool_false_true)) if v]
            if ctl.kind == _CONTROL.CONTROL_SEQUENCE_CORRID:
                if given:
                    add(f"{cf}.{given[0][0]}", f"not allowed for {kind_name} (set data_type instead)")
                if ctl.data_type not in _CORRID_TYPES:
                    add(f"{cf}.data_type", "must be TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 "
                        f"or TYPE_STRING for {kind_name}")
            elif not given:
                add(cf, f"set one of int32_false_true, fp32_false_true or bool_false_true for {kind_name}")
            elif len(given) > 1:
                add(cf, f"set only one of {', '.join(n for n, _ in given)} for {kind_name}")
            elif given[0][1] != 2:
                add(f"{cf}.{given[0][0]}", f"must have exactly 2 entries [false, true], got {given[0][1]}")
    for i, st in enumerate(sb.state):
        f = f"sequence_batching.state[{i}]"
        for attr in ("input_name", "output_name"):
            if not getattr(st, attr):
                add(f"{f}.{attr}", "missing")
        if st.data_type == mc.TYPE_INVALID:
            add(f"{f}.data_type", "missing")
        if not st.dims:
            add(f"{f}.dims", "missing")


def _check_ensemble(c: mc.ModelConfig, add: _Add) -> None:
    has_scheduling = c.HasField("ensemble_scheduling")
    if c.platform != ENSEMBLE_PLATFORM:
        if has_scheduling:
            add("ensemble_scheduling", "only allowed with platform 'ensemble'")
        return
    if c.instance_group:
        add("instance_group", "must not be set for an ensemble")
    if not has_scheduling:
        add("ensemble_scheduling", "missing: required for platform 'ensemble'")
        return
    steps = c.ensemble_scheduling.step
    if not steps:
        add("ensemble_scheduling.step", "missing: an ensemble needs at least one step")
    for i, step in enumerate(steps):
        f = f"ensemble_scheduling.step[{i}]"
        if not step.model_name:
            add(f"{f}.model_name", "missing")
        if not step.input_map:
            add(f"{f}.input_map", "missing")
        if not step.output_map:
            add(f"{f}.output_map", "missing")


def _check_instance_groups(c: mc.ModelConfig, add: _Add) -> None:
    if _is_ensemble(c):
        return
    if not c.instance_group:
        add("instance_group", "missing")
    for i, group in enumerate(c.instance_group):
        f = f"instance_group[{i}]"
        if group.count < 0:
            add(f"{f}.count", f"must be >= 0, got {group.count}")
        if group.kind in (_KIND_CPU, _KIND_MODEL) and group.gpus:
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            add(f"{f}.gpus", f"must be empty for {kind}")
        for j, gpu in enumerate(group.gpus):
            if gpu < 0:
                add(f"{f}.gpus[{j}]", f"must be >= 0, got {gpu}")


# ----------------------------------------------------------------------------- whole pipeline


def load_model_config(model_dir: str | Path, *, override_json: str | None = None,
                      gpu_available: bool = False) -> mc.ModelConfig:
    """Parse, autocomplete, normalize and validate the config of one model directory.

    ``override_json`` is the JSON ModelConfig a repository ``load`` request may carry; as in
    Triton it replaces ``config.pbtxt`` entirely. Without either, a model directory whose
    version directories hold a model file is configured from that file alone.
    Raises ConfigError naming the file, the model and the field.
    """
    config, source = prepare_config(model_dir, override_json=override_json, gpu_available=gpu_available)
    validate(config, source, Path(model_dir).name)
    return config


def prepare_config(model_dir: str | Path, *, override_json: str | None = None,
                   gpu_available: bool = False) -> tuple[mc.ModelConfig, str]:
    """``load_model_config`` without the final validation: the normalized config and the name
    of its source (config.pbtxt path, or a description) for ``config_errors``."""
    model_dir = Path(model_dir)
    dir_name = model_dir.name
    config_path = model_dir / CONFIG_FILENAME
    if override_json is not None:
        source = f"{model_dir} (config from load request)"
        config = parse_config_json(override_json, source=source, model=dir_name)
    elif config_path.is_file():
        source = str(config_path)
        config = parse_config(config_path)
    elif not model_dir.is_dir():
        raise ConfigError(model_dir, dir_name, "", "model directory not found")
    elif available_versions(model_dir):
        source = f"{model_dir} (no {CONFIG_FILENAME}; autocompleted)"
        config = mc.ModelConfig()
    else:
        raise ConfigError(config_path, dir_name, "", "missing, and no version directory holds a model "
                          f"file to autocomplete from (expected {model_dir}/1/model.onnx)")
    _check_file_names(config, source, dir_name)  # before autocomplete reads any file they name
    config = autocomplete(config, model_dir)
    return normalize(config, dir_name, gpu_available=gpu_available), source


def _check_file_names(config: mc.ModelConfig, source: str, dir_name: str) -> None:
    """File names a config gives (also one from a load request's override) are single path
    components inside the model directory (the rule of meshserve.repository.names)."""
    named = [("default_model_filename", config.default_model_filename)]
    for i, w in enumerate(config.model_warmup):
        named += [(f"model_warmup[{i}].inputs[{k!r}].input_data_file", v.input_data_file)
                  for k, v in w.inputs.items() if v.WhichOneof("input_data_type") == "input_data_file"]
    for field, value in named:
        if value and not is_valid_model_name(value):
            raise ConfigError(source, dir_name, field, f"{value!r} is not a file name inside the model "
                              f"directory ({NAME_RULE.replace('a model name', 'a file name')})")
