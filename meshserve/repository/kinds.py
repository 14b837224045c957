"""The backend kinds: one row per kind of model meshserve serves, the one place that says what a kind is.

A kind is what one service process hosts (``meshserve service KIND``; the ensemble kind runs in
the gateway). Its row says which config ``backend``s and ``platform``s it serves, the model file
names of those backends, the module whose ``main(args)`` runs its service, what must be installed
for that (and the pip extra that installs it) and its name in deploy/. Everything that must know
the kinds reads them here: the CLI (``meshserve up``, ``meshserve service`` and its choices),
the repository layout (config → kind, model files), the config pipeline (platform ↔ backend,
``default_model_filename``, the known backends), the services (the adapters a kind may register)
and, through the layout, the gateway's model control. A new backend is its ``services/<kind>/``
folder plus one row in ``KINDS`` (docs/architecture.md, "Where to add a backend").

Rows added outside the tree: ``MESHSERVE_EXTRA_KINDS`` (JSON, a list of objects with the fields of
``Kind``), read once when this module is imported, in every process that inherits it (``meshserve
up``'s services and gateway do). It is the operator's, like ``PYTHONPATH``: an ``entry`` names a
module the CLI imports.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "BACKEND_DIR_ENV",
    "add_backend_directory",
    "EXTRA_KINDS_ENV",
    "KINDS",
    "Kind",
    "by_name",
    "kind_for",
    "kind_of_files",
    "parse_rows",
    "python_based_backend",
]

EXTRA_KINDS_ENV = "MESHSERVE_EXTRA_KINDS"
# Triton's --backend-directory, for its python-based backends: a config ``backend: "X"`` that no
# kind serves, where ``<directory>/X/model.py`` exists, is a python model whose model.py is that one
# (`meshserve up/gateway/service --backend-directory`, which set it for the processes they start)
BACKEND_DIR_ENV = "MESHSERVE_BACKEND_DIRECTORY"
_BACKEND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Kind:
    """One backend kind (a row of the registry)."""

    name: str  # `meshserve service NAME`; the kind a service announces to gateways
    # config backend -> its model file names, the first its default_model_filename; a later one is
    # used in its place when a version holds only that (model.pt2, a torch.export archive)
    backends: dict[str, tuple[str, ...]] = field(default_factory=dict)
    platforms: dict[str, str] = field(default_factory=dict)  # config platform -> its backend ("": none)
    sequence_backends: tuple[str, ...] = ()  # backends whose sequence-batching models this kind hosts
    entry: str = ""  # the module whose main(args) runs the service ("": no service process)
    requires: tuple[str, ...] = ()  # modules the service needs: when one is missing, `up` skips the kind
    extra: str = ""  # the pip extra that installs them: pip install 'meshserve[EXTRA]'
    deploy: str = ""  # its Deployment, Service and DNS name in deploy/k8s and deploy/compose.yaml
    gpu_only: bool = False  # deployed with the GPU overlay / compose profile only
    in_gateway: bool = False  # run by the gateway itself (ensembles), no service process

    @property
    def served_backends(self) -> frozenset[str]:
        """The config backends whose models this kind hosts (with or without sequence batching)."""
        return frozenset({*self.backends, *self.sequence_backends})

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The suffixes of its own model files (.onnx), which point a config naming no backend here."""
        return tuple(dict.fromkeys(PurePosixPath(f).suffix for names in self.backends.values() for f in names))


KINDS: tuple[Kind, ...] = (
    Kind("onnx", backends={"onnxruntime": ("model.onnx",)}, platforms={"onnxruntime_onnx": "onnxruntime"},
         entry="services.onnx.main", requires=("onnxruntime",), extra="cpu", deploy="onnx"),
    Kind("torchscript", backends={"pytorch": ("model.pt", "model.pt2")}, platforms={"pytorch_libtorch": "pytorch"},
         entry="services.torchscript.main", requires=("torch",), extra="torch", deploy="torchscript"),
    Kind("tensorrt", backends={"tensorrt": ("model.plan",)}, platforms={"tensorrt_plan": "tensorrt"},
         entry="services.tensorrt.main", requires=("tensorrt",), extra="tensorrt", deploy="tensorrt",
         gpu_only=True),
    # stateful ONNX and TorchScript models: a scheduler over those kinds' adapters, no files of its own
    Kind("sequence", sequence_backends=("onnxruntime", "pytorch"), entry="services.sequence.main",
         requires=("onnxruntime",), extra="cpu", deploy="sequence"),
    # Triton's python backend (model.py); it batches its sequences itself
    Kind("python", backends={"python": ("model.py",)}, sequence_backends=("python",),
         entry="services.python.main", deploy="python"),
    # Triton's FIL backend: tree models; the file name follows the model_type parameter (services/fil/params.py)
    Kind("fil", backends={"fil": ("xgboost.model", "xgboost.json", "xgboost.ubj", "model.txt", "checkpoint.tl")},
         entry="services.fil.main", requires=("treelite",), extra="fil", deploy="fil"),
    Kind("ensemble", platforms={"ensemble": ""}, in_gateway=True),
)


def parse_rows(text: str, known: tuple[Kind, ...] = KINDS) -> tuple[Kind, ...]:
    """Rows from JSON (a list of objects with ``Kind``'s fields), checked against ``known``: a
    name, backend, platform or file suffix that another row has already is refused (ValueError)."""
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{EXTRA_KINDS_ENV}: not JSON ({exc})") from None
    if not isinstance(items, list):
        raise ValueError(f"{EXTRA_KINDS_ENV}: a JSON list of kinds, not {type(items).__name__}")
    names = {f.name for f in fields(Kind)}
    rows: list[Kind] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or set(item) - names:
            raise ValueError(f"{EXTRA_KINDS_ENV}: each kind is an object with a name and only the fields "
                             f"{', '.join(sorted(names))}: {item!r}")
        try:
            rows.append(_row(item))
        except (TypeError, AttributeError) as exc:  # e.g. backends not an object
            raise ValueError(f"{EXTRA_KINDS_ENV}: kind '{item['name']}': {exc}") from None
    for i, row in enumerate(rows):
        _check_new(row, (*known, *rows[:i]))
    return tuple(rows)


def _row(item: dict[str, Any]) -> Kind:
    def strings(value: Any) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{EXTRA_KINDS_ENV}: kind '{item['name']}': expected a list of strings, got {value!r}")
        return tuple(value)

    kw: dict[str, Any] = dict(item)
    kw["backends"] = {b: strings(files) for b, files in dict(item.get("backends", {})).items()}
    kw["platforms"] = dict(item.get("platforms", {}))
    if not all(isinstance(v, str) for v in (*kw["platforms"], *kw["platforms"].values())):
        raise ValueError(f"{EXTRA_KINDS_ENV}: kind '{item['name']}': platforms map names to backends: {kw['platforms']}")
    for key in ("sequence_backends", "requires"):
        if key in item:
            kw[key] = strings(item[key])
    return Kind(**kw)


def _check_new(row: Kind, others: tuple[Kind, ...]) -> None:
    def clash(what: str, mine: set[str], theirs: set[str]) -> None:
        if mine & theirs:
            raise ValueError(f"{EXTRA_KINDS_ENV}: kind '{row.name}': {what} {sorted(mine & theirs)} "
                             "belong to another kind already")

    clash("name", {row.name}, {k.name for k in others})
    clash("backends", set(row.backends), {b for k in others for b in k.backends})
    clash("platforms", set(row.platforms), {p for k in others for p in k.platforms})
    clash("file suffixes", set(row.suffixes), {s for k in others for s in k.suffixes})
    clash("sequence backends", set(row.sequence_backends), {b for k in others for b in k.sequence_backends})


if os.environ.get(EXTRA_KINDS_ENV):
    KINDS = (*KINDS, *parse_rows(os.environ[EXTRA_KINDS_ENV]))

_BY_NAME = {k.name: k for k in KINDS}
_BY_BACKEND = {b: k.name for k in KINDS for b in k.backends}
_BY_SEQUENCE_BACKEND = {b: k.name for k in KINDS for b in k.sequence_backends}
_BY_PLATFORM = {p: k.name for k in KINDS for p, b in k.platforms.items() if not b}  # platforms without a backend
_BY_SUFFIX = {s: b for k in KINDS for b, files in k.backends.items() for s in
              dict.fromkeys(PurePosixPath(f).suffix for f in files)}
_BY_FILE_NAME = {f: b for k in KINDS for b, files in k.backends.items() for f in files}


def by_name(name: str) -> Kind | None:
    """The row of kind ``name``, or None."""
    return _BY_NAME.get(name)


def kind_for(platform: str, backend: str, sequence: bool) -> str | None:
    """The kind that hosts a model of this platform and backend (the backend already completed from
    the platform), with sequence batching or not; None when no kind does. A python-based backend
    (``python_based_backend``) is the python kind's."""
    if platform in _BY_PLATFORM:
        return _BY_PLATFORM[platform]
    kind = (_BY_SEQUENCE_BACKEND if sequence else _BY_BACKEND).get(backend)
    if kind is None and python_based_backend(backend) is not None:
        return "python"
    return kind


def python_based_backend(backend: str) -> Path | None:
    """The model.py of Triton's python-based backend ``backend``: ``<backend directory>/<backend>/
    model.py`` (BACKEND_DIR_ENV), for a backend no kind serves; None when there is none (no
    directory set, a backend name that is no plain folder name, no such file)."""
    root = os.environ.get(BACKEND_DIR_ENV)
    if not root or not backend or backend in _BY_BACKEND or backend in _BY_SEQUENCE_BACKEND \
            or not _BACKEND_NAME.fullmatch(backend):
        return None
    path = Path(root) / backend / "model.py"
    return path if path.is_file() else None


def kind_of_files(file_names: list[str] | tuple[str, ...], sequence: bool) -> str | None:
    """The kind model files point to (``1/model.onnx`` → onnx), when they point to one backend: by
    the backends' own file names when there are any (``model.onnx`` beside a ``labels.txt``), else
    by their suffixes (``1/net.onnx``; FIL's are common ones: .txt, .json)."""
    backends = {_BY_FILE_NAME.get(PurePosixPath(f).name) for f in file_names} - {None} \
        or {_BY_SUFFIX.get(PurePosixPath(f).suffix) for f in file_names} - {None}
    if len(backends) != 1:
        return None
    return kind_for("", str(backends.pop()), sequence)


def add_backend_directory(ap: argparse.ArgumentParser) -> None:
    """--backend-directory (`up`, `gateway`, `service`, `check-repo`): meshserve/cli.py:main hands
    it to the processes through BACKEND_DIR_ENV, so they, and every process `up` starts, agree on
    which backends are python-based."""
    ap.add_argument("--backend-directory", type=Path, default=None, metavar="DIR",
                    help="Triton's --backend-directory: a config backend X that no kind serves is a python-based "
                         "backend when DIR/X/model.py exists (served by the python service; docs/python-backend.md)")
