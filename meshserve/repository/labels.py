"""A model's classification labels (``output { label_filename }``), read once at load by the
services (services/base/serialization.py:ResponseEncoder) and by the gateway for its ensembles
(gateway/ensemble/catalog.py): the one rule of which files may be read and how.

Triton's rule (core's model.cc, Model::Init): the label file is the model folder joined with
``label_filename``; a path that escapes the folder (IsChildPathEscapingParentPath) fails the load,
and so does a file that does not read (label_provider.cc, LabelProvider::AddLabels). Here the path
is resolved (symlinks followed) before the check, so a link out of the folder is refused too, and
the file is bounded in size (``LABELS_MAX_BYTES``). The file is then opened one component at a
time from the model folder, none followed if it is a link (``_open_inside``): a link swapped in
between the check and the open fails the load instead of being read. Errors name the model, the
output's field and the name the config gave, never a path outside the repository (no resolved
path, no content).

Lines are split as Triton splits them (``std::getline``: on ``\n`` only, a last line without one
kept, no line after a final ``\n``, a ``\r`` kept in its label): str.splitlines would also split
on ``\r``, ``\x0b``, ``\x0c``, ``\x1c``-``\x1e``, ``\x85``, U+2028 and U+2029, and give a later
class another class's label."""
from __future__ import annotations

import errno
import os
import stat
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
        inside = path.relative_to(root)
        shown = inside.as_posix()  # the file, relative to the model's folder
        try:
            fd = _open_inside(root, inside.parts)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # (a folder is not read; a FIFO was not waited on)
                    raise ConfigError("", name, field, f"label file '{shown}' is not a regular file")
                with open(fd, "rb", closefd=False) as f:
                    data = f.read(max_bytes + 1)
            finally:
                os.close(fd)
        except _Link:
            raise ConfigError("", name, field, f"label file '{shown}' became a link after it was checked") from None
        except OSError as exc:
            raise ConfigError("", name, field,
                              f"cannot read label file '{shown}': {exc.strerror or type(exc).__name__}") from None
        if len(data) > max_bytes:
            raise ConfigError("", name, field, f"label file '{shown}' is larger than {max_bytes} bytes")
        out[t.name] = _lines(data.decode("utf-8", errors="replace"))
    return out


class _Link(Exception):
    """A component of the label file's path became a link after the check."""


def _open_inside(root: Path, parts: tuple[str, ...]) -> int:
    """The descriptor of ``root``/``parts`` (the path found inside ``root`` with every link
    resolved), opened one component at a time from ``root``, following no link: a component
    that is a link now (swapped in since the path was resolved) raises _Link. The file is opened
    non-blocking: a FIFO's open does not wait for a writer (the caller refuses it by its type)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for i, part in enumerate(parts):
        flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if i == len(parts) - 1 else os.O_DIRECTORY)
        try:
            nxt = os.open(part, flags, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                raise _Link from None
            raise
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _is_link(part: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _lines(text: str) -> tuple[str, ...]:
    """The lines of ``text`` as Triton's std::getline reads them (see the module's docstring)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return tuple(lines)


def label_of(labels: Sequence[str], index: int) -> str:
    """The label a classification gives class ``index`` ("" for none: an index past the labels,
    or an empty label line). Triton's rule: server's classification.cc (AddClassResults) adds
    ":label" only for a non-null label, and core's InferenceResponse::ClassificationLabel gives
    null for an empty one. Used by the services' classification and the gateway's relabelling of
    an ensemble's outputs."""
    return labels[index] if index < len(labels) else ""
