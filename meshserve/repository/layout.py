"""Triton repository layout: scan ``<repo>/<model>/{config.pbtxt,<version>/<file>}``.

Also maps each model to the meshserve service kind that hosts it (the kinds are
meshserve/repository/kinds.py's rows).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository import kinds
from meshserve.repository.config import (
    CONFIG_FILENAME,
    DEFAULT_MODEL_FILENAMES,
    ENSEMBLE_PLATFORM,
    PLATFORM_TO_BACKEND,
    ConfigError,
    config_errors,
    parse_config_json,
    prepare_config,
)
from meshserve.repository.names import is_valid_model_name
from meshserve.repository.versions import available_versions, select_versions

__all__ = [
    "SERVICE_KINDS",
    "ModelEntry",
    "available_versions",
    "kind_from_files",
    "model_dirs",
    "model_file",
    "override_kind",
    "scan",
    "scan_model",
    "select_versions",
    "service_kind",
]

SERVICE_KINDS: tuple[str, ...] = tuple(k.name for k in kinds.KINDS)
_SEQUENCE_BACKENDS = tuple(b for k in kinds.KINDS for b in k.sequence_backends)


@dataclass
class ModelEntry:
    """One model directory of a repository, as found by ``scan``.

    ``config`` is the effective (autocompleted, normalized, validated) config or None when it
    could not be built. ``problems`` lists everything wrong, each naming file, model and field;
    ``error`` joins them (None when there are none). ``version_errors`` maps a selected version
    to what is wrong with it alone (e.g. its model file is missing), so the other versions
    can still be served.
    """

    name: str
    path: Path
    config: mc.ModelConfig | None = None
    error: str | None = None
    available_versions: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kind: str | None = None
    problems: list[str] = field(default_factory=list)
    version_errors: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the model has no problems at all."""
        return not self.problems

    @property
    def loadable_versions(self) -> list[int]:
        """Selected versions without a version-specific problem (empty when config is None)."""
        if self.config is None:
            return []
        return [v for v in self.versions if v not in self.version_errors]


def _backend(config: mc.ModelConfig) -> str:
    return config.backend or PLATFORM_TO_BACKEND.get(config.platform, "")


def service_kind(config: mc.ModelConfig) -> str | None:
    """The meshserve service that hosts this model, or None when none can (meshserve/repository/kinds.py).

    ``"ensemble"`` for platform ensemble (run by the gateway); ``"sequence"`` for ONNX and
    TorchScript models with ``sequence_batching``; else ``"onnx"``, ``"torchscript"`` or
    ``"tensorrt"`` by backend; ``"python"`` for Triton's python backend (``model.py``, sequence
    batching included: the python service batches its sequences). TensorRT models with sequence
    batching → None.
    """
    return kinds.kind_for(config.platform, _backend(config), config.HasField("sequence_batching"))


def kind_from_files(file_names: Iterable[str], sequence: bool = False) -> str | None:
    """The service kind model files point to (``1/model.onnx`` → onnx), when they point to one:
    for a model whose config names neither platform nor backend."""
    return kinds.kind_of_files(tuple(file_names), sequence)


def override_kind(name: str, config_json: str, file_names: Iterable[str] = ()) -> str | None:
    """The service kind of a model as a load request's ``config`` override (and its ``file:``
    names) describe it: ``service_kind`` of the config, or by the model files' suffix when the
    config names no platform or backend. Raises ConfigError for JSON that is no ModelConfig."""
    config = parse_config_json(config_json, source=f"load request for model '{name}'", model=name)
    if config.platform or config.backend:
        return service_kind(config)
    return kind_from_files(file_names, config.HasField("sequence_batching"))


def model_file(entry_or_dir: ModelEntry | str | Path, config: mc.ModelConfig, version: int) -> Path:
    """``<model dir>/<version>/<default_model_filename>``, or the backend's default file name
    (model.onnx, model.pt, model.plan, model.py; model.pt2 when a version holds only that).
    Raises ValueError for ensembles and models whose backend has no known file name."""
    base = entry_or_dir.path if isinstance(entry_or_dir, ModelEntry) else Path(entry_or_dir)
    if config.platform == ENSEMBLE_PLATFORM:
        raise ValueError(f"model '{config.name}': an ensemble has no model file")
    if (backend_py := kinds.python_based_backend(config.backend)) is not None:
        return backend_py  # a python-based backend's model.py serves every model of that backend
    filename = config.default_model_filename or DEFAULT_MODEL_FILENAMES.get(_backend(config), "")
    if not filename:
        raise ValueError(f"model '{config.name}': no model file name known for "
                         f"platform '{config.platform}' backend '{config.backend}'")
    path = base / str(version) / filename
    if not path.exists():  # a backend's other file in place of its default (model.pt2, a torch.export archive)
        for other in _OTHER_FILES.get(filename, ()):
            if (path.parent / other).exists():
                return path.parent / other
    return path


# a backend's default model file name -> the names that may stand in for it (model.pt -> model.pt2)
_OTHER_FILES = {files[0]: files[1:] for k in kinds.KINDS for files in k.backends.values() if len(files) > 1}


def scan_model(model_dir: str | Path, *, override_json: str | None = None,
               gpu_available: bool = False) -> ModelEntry:
    """Build the entry of one model directory. Never raises for a broken model: what is wrong
    ends up in ``problems``/``error``. ``override_json`` as in ``load_model_config``."""
    model_dir = Path(model_dir)
    entry = ModelEntry(name=model_dir.name, path=model_dir)
    try:
        entry.available_versions = available_versions(model_dir)
        _fill(entry, override_json, gpu_available)
    except ConfigError as e:
        entry.problems.append(str(e))
    except Exception as e:  # one unreadable model must not stop the scan
        entry.problems.append(f"{model_dir}: model '{entry.name}': {type(e).__name__}: {e}")
    entry.error = "; ".join(entry.problems) if entry.problems else None
    return entry


def _fill(entry: ModelEntry, override_json: str | None, gpu_available: bool) -> None:
    config, source = prepare_config(entry.path, override_json=override_json, gpu_available=gpu_available)
    invalid = config_errors(config, source, entry.name)
    if invalid:  # report them all; a model with an invalid config gets no config
        entry.problems.extend(map(str, invalid))
        return
    entry.config = config
    entry.kind = service_kind(config)
    config_path = entry.path / CONFIG_FILENAME
    config_file = str(config_path if config_path.is_file() else entry.path)

    def problem(fld: str, message: str, file: str | Path = config_file) -> str:
        text = str(ConfigError(file, entry.name, fld, message))
        entry.problems.append(text)
        return text

    if entry.kind is None:
        backend = _backend(config) or config.platform
        if config.HasField("sequence_batching") and backend not in _SEQUENCE_BACKENDS:
            problem("sequence_batching", f"sequence batching is served for {_SEQUENCE_SERVED} "
                    f"models only, not '{backend}'")
        else:
            problem("backend", f"'{backend}' is not served by meshserve (served: {_SERVED})")

    try:
        entry.versions = select_versions(config.version_policy, entry.available_versions)
    except ConfigError as e:
        entry.problems.append(str(e.located(config_file, entry.name)))
        return
    if not entry.versions:
        shown = ", ".join(map(str, entry.available_versions)) or "none"
        problem("version_policy", f"selects no version (version directories: {shown}); "
                "at least one version must be available")
        return

    if config.platform == ENSEMBLE_PLATFORM or entry.kind is None:
        return  # ensembles need only an (empty) version directory
    for version in entry.versions:
        path = model_file(entry, config, version)
        if not path.exists():
            entry.version_errors[version] = problem("", f"version {version}: model file not found", path)


_SEQUENCE_SERVED = ", ".join(_SEQUENCE_BACKENDS[:-1]) + " and " + _SEQUENCE_BACKENDS[-1]  # the words of _fill's
_SERVED = ", ".join([*DEFAULT_MODEL_FILENAMES, *(p for k in kinds.KINDS for p, b in k.platforms.items() if not b)])


def scan(repo: str | Path, gpu_available: bool = False) -> list[ModelEntry]:
    """Every model directory of a repository, sorted by name.

    Files and hidden directories are ignored. A broken model becomes an entry with ``error``
    set; only a missing repository raises (FileNotFoundError / NotADirectoryError naming it).
    """
    repo = Path(repo)
    if not repo.exists():
        raise FileNotFoundError(f"model repository '{repo}' does not exist")
    if not repo.is_dir():
        raise NotADirectoryError(f"model repository '{repo}' is not a directory")
    return [scan_model(d, gpu_available=gpu_available) for d in model_dirs(repo)]


def model_dirs(repo: str | Path) -> list[Path]:
    """The model directories of a repository, sorted by name: hidden entries, files and names that
    break the name rule (meshserve.repository.names; a name no client could address) are left out.
    A model directory may be a symlink placed by the operator; it is followed, as in Triton."""
    return sorted((p for p in Path(repo).iterdir()
                   if not p.name.startswith(".") and is_valid_model_name(p.name) and p.is_dir()),
                  key=lambda p: p.name)
