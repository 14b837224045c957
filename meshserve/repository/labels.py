"""A model's classification labels (``output { label_filename }``), read once at load by the
services (services/base/serialization.py:ResponseEncoder) and by the gateway for its ensembles
(gateway/ensemble/catalog.py): the one rule of which files may be read and how.

Triton's rule (core's model.cc, Model::Init): the label file is the model folder joined with
``label_filename``; a path that escapes the folder (IsChildPathEscapingParentPath) fails the load,
and so does a file that does not read (label_provider.cc, LabelProvider::AddLabels). Here the path
is resolved (symlinks followed) before the check, so a link out of the folder is refused too, and
the file is bounded in size (``LABELS_MAX_BYTES``). Errors name the model, the output's field and
the name the config gave, never a path outside the repository (no resolved path, no content)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.repository.errors import ConfigError

Labels = dict[str, tuple[str, ...]]  # output name -> its labels, by class index

# The largest label file read (bytes): ImageNet's 1000 labels are ~20 KiB; a bigger file is a
# mistake or an attempt to hold the service's memory, and fails the load.
LABELS_MAX_BYTES = 4 << 20


def read_labels(model_dir: Path, config: mc.ModelConfig, max_bytes: int = LABELS_MAX_BYTES) -> Labels:
    """The labels of each output whose config names a ``label_filename`` (the file's lines).
    ConfigError (model and field named, no file path) when the file is outside ``model_dir``
    (after following links), is not a regular file, does not read, or is over ``max_bytes``."""
    out: Labels = {}
    root = model_dir.resolve()
    name = config.name or model_dir.name
    for i, t in enumerate(config.output):
        if not t.label_filename:
            continue
        field = f"output[{i}].label_filename"
        path = (root / t.label_filename).resolve()
        if not path.is_relative_to(root):
            # (the configured name is not repeated: it may be a host path the client should not learn)
            raise ConfigError("", name, field, "the label file is outside the model directory")
        shown = path.relative_to(root).as_posix()  # the file, relative to the model's folder
        if path.exists() and not path.is_file():  # (a FIFO would block the open, a folder not read)
            raise ConfigError("", name, field, f"label file '{shown}' is not a regular file")
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ConfigError("", name, field,
                              f"cannot read label file '{shown}': {exc.strerror or type(exc).__name__}") from None
        if len(data) > max_bytes:
            raise ConfigError("", name, field, f"label file '{shown}' is larger than {max_bytes} bytes")
        out[t.name] = tuple(data.decode("utf-8", errors="replace").splitlines())
    return out


def label_of(labels: Sequence[str], index: int) -> str:
    """The label a classification gives class ``index`` ("" for none: an index past the labels,
    or an empty label line). Triton's rule: server's classification.cc (AddClassResults) adds
    ":label" only for a non-null label, and core's InferenceResponse::ClassificationLabel gives
    null for an empty one. Used by the services' classification and the gateway's relabelling of
    an ensemble's outputs."""
    return labels[index] if index < len(labels) else ""
