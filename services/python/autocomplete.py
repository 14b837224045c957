"""Triton's ``auto_complete_config`` for python models, and the JSON form of a config a model sees.

The python service registers :func:`complete` for backend "python" with the repository's config
pipeline (meshserve.repository.config.BACKEND_COMPLETERS). It runs the model's
``TritonPythonModel.auto_complete_config(auto_complete_model_config)`` in a short-lived worker
process (the model's code never runs in the service), as Triton does at load whether
config.pbtxt is complete, incomplete or absent, and parses the result back. Results are cached
by the model file and the config, since the repository is scanned more than once.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository.config import DEFAULT_MODEL_FILENAMES, ConfigError
from meshserve.repository.kinds import python_based_backend
from meshserve.repository.versions import available_versions
from services.base.runtime import RuntimeLoadError, config_parameter
from services.python import execution_env

_ROOT = str(Path(__file__).resolve().parents[2])
TIMEOUT_S = 60.0
# int64 fields protobuf's JSON writes as strings; Triton's JSON has them as numbers
_INT64_KEYS = frozenset({"dims", "shape", "max_queue_delay_microseconds", "default_timeout_microseconds",
                         "max_sequence_idle_microseconds", "priority_levels", "default_priority_level",
                         "max_queue_size", "preferred_batch_size", "gpu_execution_accelerator"})


def _ints(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _ints(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v, key) for v in value]
    if key in _INT64_KEYS and isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def config_json(config: mc.ModelConfig) -> str:
    """The config as Triton hands it to a python model (``args['model_config']``)."""
    as_dict = json_format.MessageToDict(config, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    return json.dumps(_ints(as_dict))


def model_py(config: mc.ModelConfig, model_dir: Path) -> Path | None:
    """The model.py of the highest version that has one (a python-based backend's own)."""
    if (backend_py := python_based_backend(config.backend)) is not None:
        return backend_py
    filename = config.default_model_filename or DEFAULT_MODEL_FILENAMES["python"]
    for version in reversed(available_versions(model_dir)):
        candidate = model_dir / str(version) / filename
        if candidate.is_file():
            return candidate
    return None


# Characters the python backend refuses in a stub's name (the model's, for auto-complete; an
# instance's, to run): python_backend src/pb_utils.h INVALID_CHARS, IsValidIdentifier.
STUB_NAME_INVALID_CHARS = frozenset(";|&$`<>()[]{}\\\"'*?~#!")
INVALID_STUB_NAME = "Invalid stub name: contains invalid characters"


def stub_name_ok(name: str) -> bool:
    """Whether the python backend starts a stub named ``name`` (non-empty, none of its invalid
    characters)."""
    return bool(name) and not STUB_NAME_INVALID_CHARS.intersection(name)


def complete(config: mc.ModelConfig, model_dir: Path) -> mc.ModelConfig:
    """``config`` completed by the model's ``auto_complete_config`` (unchanged when there is no
    model.py; ConfigError when the function fails, or when the model's name is one the python
    backend starts no stub for: its words)."""
    name = config.name or model_dir.name
    if not stub_name_ok(name):
        raise ConfigError(model_dir, name, "name", INVALID_STUB_NAME)
    path = model_py(config, model_dir)
    if path is None:
        return config
    stat = path.stat()
    text = _complete(str(path), stat.st_mtime_ns, stat.st_size, config.SerializeToString(deterministic=True),
                     str(model_dir))
    out = mc.ModelConfig()
    out.ParseFromString(text)
    return out


@functools.lru_cache(maxsize=256)
def _complete(path: str, mtime_ns: int, size: int, serialized: bytes, model_dir: str) -> bytes:
    """The model's auto_complete_config in a python of its own (its EXECUTION_ENV_PATH's when it
    has one, ``$$TRITON_MODEL_DIRECTORY`` being ``model_dir``: the model's imports are there, as in
    Triton's stub)."""
    config = mc.ModelConfig.FromString(serialized)
    python, env = sys.executable, dict(os.environ)
    if (env_path := (config_parameter(config, execution_env.PARAMETER) or "").strip()):
        try:
            own = execution_env.resolve(env_path, Path(model_dir), config.name)
        except RuntimeLoadError as exc:
            raise ConfigError(path, config.name, f"parameters.{execution_env.PARAMETER}", str(exc)) from None
        python, env = str(own.python), own.environ(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([python, "-m", "services.python.worker", "--autocomplete", path],
                              input=config_json(config), capture_output=True, text=True, env=env,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(path, config.name, "", f"auto_complete_config did not return within {TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        raise ConfigError(path, config.name, "", "auto_complete_config failed: " + (lines[-1] if lines else
                                                                                      f"exit code {done.returncode}"))
    try:
        completed = json_format.Parse(done.stdout, mc.ModelConfig())
    except json_format.ParseError as exc:
        raise ConfigError(path, config.name, "", f"auto_complete_config returned an invalid config: {exc}") from None
    return completed.SerializeToString(deterministic=True)
