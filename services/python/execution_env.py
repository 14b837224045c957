"""A python model's own execution environment (Triton's ``EXECUTION_ENV_PATH`` parameter).

The parameter names a conda-pack archive (``.tar.gz``, ``.tgz``, ``.tar``), an unpacked
environment (a folder with ``bin/python3``), or an unpacked one's conda-pack activation script
(``<env>/lib/pythonX.Y/site-packages/conda_pack/scripts/posix/activate``), as the python backend
accepts them; ``$$TRITON_MODEL_DIRECTORY`` in it is the model's folder. The model's workers then
run that environment's ``python`` (services/python/instance.py), with the environment's ``bin``
first on PATH and its ``lib`` first on LD_LIBRARY_PATH, as conda-pack's activation sets them; the
worker's own modules come from this tree (PYTHONPATH), numpy from the environment (the python
backend requires it there too).

An archive is unpacked once per content (its path, size and modification time) into the cache
(``$MESHSERVE_CACHE`` or ``~/.cache/meshserve``, ``python-envs/``): a second model naming it, or
the next start, finds it there. Unpacking is bounded (``MAX_UNPACKED_BYTES``, ``MAX_MEMBERS``) and
goes through tarfile's ``data`` filter: no member outside the folder, no absolute path, no link
out of it, no device (docs/security.md, "Session 25: execution environments").
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.base.runtime import RuntimeLoadError

log = logging.getLogger("meshserve.python")

PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
MAX_UNPACKED_BYTES = 32 << 30  # a conda environment with torch and CUDA libraries is ~10 GiB
MAX_MEMBERS = 1_000_000
_ACTIVATE = ("conda_pack", "scripts", "posix", "activate")
_ARCHIVES = (".tar.gz", ".tgz", ".tar")
# the worker's own code needs this much (dataclass slots, zip(strict=...))
MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class ExecutionEnv:
    """An environment a model's workers run in: its root and its python."""

    root: Path
    python: Path

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this environment activated (conda-pack's activate: PATH, CONDA_PREFIX;
        its lib for the shared libraries its packages load)."""
        env = dict(base)
        env.pop("PYTHONHOME", None)
        env["PATH"] = os.pathsep.join(p for p in (str(self.root / "bin"), base.get("PATH", "")) if p)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.root / "lib"), base.get("LD_LIBRARY_PATH", ""))
                                                 if p)
        env["CONDA_PREFIX"] = str(self.root)
        env["PYTHONNOUSERSITE"] = "1"  # (the python backend's advice for packed environments)
        return env


def resolve(value: str, model_dir: Path, model: str) -> ExecutionEnv:
    """The environment ``value`` (the parameter's string) names for ``model`` (its folder
    ``model_dir``), unpacked when it is an archive and checked to run the worker;
    RuntimeLoadError naming the model, the parameter and what is wrong otherwise."""
    where = f"model '{model}': parameter {PARAMETER} '{value}'"
    path = Path(value.replace(MODEL_DIRECTORY, str(model_dir))).expanduser()
    if not path.is_absolute():
        raise RuntimeLoadError(f"{where}: the path must be absolute (or start with {MODEL_DIRECTORY})")
    if not path.exists():
        raise RuntimeLoadError(f"{where}: no such file or folder")
    if path.is_dir():
        root = path
    elif path.name.endswith(_ARCHIVES):
        root = _unpacked(path, where)
    elif path.parts[-len(_ACTIVATE):] == _ACTIVATE and len(path.parts) > len(_ACTIVATE) + 3:
        root = path.parents[len(_ACTIVATE) + 2]  # <env>/lib/pythonX.Y/site-packages/conda_pack/...
    else:
        raise RuntimeLoadError(f"{where}: neither a conda-pack archive ({', '.join(_ARCHIVES)}), an environment "
                               "folder, nor its conda_pack/scripts/posix/activate script")
    python = next((root / "bin" / n for n in ("python3", "python") if (root / "bin" / n).is_file()), None)
    if python is None:
        raise RuntimeLoadError(f"{where}: the environment has no bin/python3")
    env = ExecutionEnv(root, python)
    _check(env, where)
    return env


# the pythons that passed _check, by path and modification time: a model's auto-complete and its
# load resolve the same environment one after the other, and each probe starts a python with numpy
_CHECKED: set[tuple[str, int]] = set()


def _check(env: ExecutionEnv, where: str) -> None:
    """The environment's python runs, is recent enough for the worker, and has numpy (once per
    python, while it is unchanged)."""
    key = (str(env.python), env.python.stat().st_mtime_ns)
    if key in _CHECKED:
        return
    probe = "import sys, numpy; print('%d.%d' % sys.version_info[:2])"
    try:
        done = subprocess.run([str(env.python), "-c", probe], capture_output=True, text=True, timeout=60,
                              env=env.environ(dict(os.environ)), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise RuntimeLoadError(f"{where}: its python does not run: {why}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeLoadError(f"{where}: its python cannot import numpy (the worker needs it there): {last}")
    major, minor = (int(x) for x in done.stdout.strip().split("."))
    if (major, minor) < MIN_PYTHON:
        raise RuntimeLoadError(f"{where}: its python is {major}.{minor}; the worker needs "
                               f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer")
    _CHECKED.add(key)


def cache_root() -> Path:
    return Path(os.environ.get("MESHSERVE_CACHE") or Path.home() / ".cache" / "meshserve") / "python-envs"


def _unpacked(archive: Path, where: str) -> Path:
    """The folder ``archive`` unpacks to, in the cache; unpacked now when it is not there."""
    stat = archive.stat()
    key = hashlib.sha256(f"{archive.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    dest = cache_root() / key
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=dest.parent))
    try:
        log.warning("%s: unpacking %.1f MB into %s (once: later loads reuse it)", where, stat.st_size / 1e6, dest)
        with tarfile.open(archive, "r:*") as tar:
            members, total = [], 0
            for member in tar:
                members.append(member)
                total += max(0, member.size)
                if len(members) > MAX_MEMBERS or total > MAX_UNPACKED_BYTES:
                    raise RuntimeLoadError(f"{where}: the archive unpacks to more than {MAX_MEMBERS} files or "
                                           f"{MAX_UNPACKED_BYTES >> 30} GiB")
            try:
                tar.extractall(scratch, members=members, filter="data")
            except tarfile.FilterError as exc:  # (its text names the cache's folder: the member only)
                raise RuntimeLoadError(f"{where}: the archive holds a member that is not allowed "
                                       f"({type(exc).__name__}): {exc.tarinfo.name!r}") from None
        (scratch / ".complete").touch()
        if dest.exists() and not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)  # an unpack that did not finish (the service died)
        try:
            scratch.rename(dest)
        except OSError:  # another load unpacked it meanwhile
            if not (dest / ".complete").exists():
                raise
        return dest
    except (OSError, tarfile.TarError) as exc:  # (no file name: the cache's folder is not the client's to see)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise RuntimeLoadError(f"{where}: cannot unpack it: {why}") from None
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
