"""The hot path compiled with mypyc, optional and never stale (docs/perf/native.md).

    python -m meshserve.native build     # compile MODULES into the cache, keyed by the sources
    python -m meshserve.native status    # which one a process started now would run, and why
    MESHSERVE_NATIVE=1 meshserve gateway ...   # run the build when it matches, else pure Python

``build`` copies the ``meshserve`` and ``gateway`` packages to a scratch directory, compiles
``MODULES`` there with mypyc (one group: one shared library and a small extension per module) and
moves the extensions into ``<cache>/<key>/`` with a manifest. The key is a SHA-256 over every
``.py`` file of both packages (path and bytes), the Python version and the mypy and hpack versions:
an edit anywhere in them, not only in a compiled module, gives another key (the compiled code
trusts the types of what it imports).

``enable`` (``meshserve/__init__.py`` calls it when ``MESHSERVE_NATIVE`` is set, before any
compiled module can be imported) computes the key of the sources this process would import and
installs a finder for the build of that key, all modules or none (they share one library). When
there is no build of that key, or it is not trusted (the cache directory, the build's directories
and files must belong to this user or root and be writable by nobody else: a build is code the
process runs), or one of the modules is already imported, nothing is installed and the
pure-Python modules run. Either way one line on stderr says which runs.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

try:  # (a compiled module's class that must stay patchable: @mypyc_attr(native_class=False))
    from mypy_extensions import mypyc_attr
except ImportError:  # pure Python without mypy installed: the decorator changes nothing
    def mypyc_attr(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        return lambda cls: cls

# what is compiled: the gateway's and the service's per-request HTTP/2 (gRPC) code, and the
# gateway's own per-request modules (merge keys, coalescer, hop streams, upstream, pipeline).
# Each needs mypyc-safe source (docs/perf/native.md, "What mypyc changed in meaning").
MODULES = (
    "meshserve.server.h2.frames",
    "meshserve.server.h2.connection",
    "meshserve.server.h2.server",
    "meshserve.server.h2.call",
    "meshserve.server.h2.client",
    "gateway.upstream.merging",
    "gateway.upstream.coalesce",
    "gateway.upstream.stream",
    "gateway.upstream.upstream",
    "gateway.pipeline",
)
PACKAGES = ("meshserve", "gateway")
ENV = "MESHSERVE_NATIVE"
ENV_DIR = "MESHSERVE_NATIVE_DIR"
MANIFEST = "manifest.json"
_MYPY_CONFIG = """[mypy]
python_version = {major}.{minor}
ignore_missing_imports = True
check_untyped_defs = True
warn_unused_ignores = False

[mypy-meshserve._proto.*]
ignore_errors = True
follow_imports = skip
"""

# what enable() decided in this process: "compiled" or "pure", and why
STATE: dict[str, Any] = {"running": "pure", "reason": f"{ENV} not set"}


def root() -> Path:
    """The directory holding the ``meshserve`` and ``gateway`` packages this process imports."""
    return Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "meshserve" / "native")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def source_key(base: Path | None = None) -> str:
    """SHA-256 of every .py file of PACKAGES under ``base`` (path and bytes), Python's version
    and the mypy and hpack versions."""
    base = base or root()
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag} {sys.version} mypy {_version('mypy')} "
             f"hpack {_version('hpack')}\n".encode())
    for pkg in PACKAGES:
        for path in sorted((base / pkg).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            h.update(str(path.relative_to(base)).encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:32]


class _Finder(importlib.abc.MetaPathFinder):
    """The build's extensions for exactly the names in its manifest (MODULES and their shared
    library); every other name goes on to the usual finders."""

    def __init__(self, where: Path, files: dict[str, str]):
        self.where = where
        self.files = files

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        rel = self.files.get(name)
        if rel is None:
            return None
        file = str(self.where / rel)
        return importlib.util.spec_from_file_location(name, file,
                                                      loader=importlib.machinery.ExtensionFileLoader(name, file))


def _trusted(path: Path) -> bool:
    """``path`` is owned by this user (or root) and nobody else may write it: a build is code
    this process will run, so its directory and files get the trust of the sources themselves."""
    st = path.stat()
    return st.st_uid in (os.getuid(), 0) and not st.st_mode & 0o022


def _manifest(where: Path, key: str) -> dict[str, Any] | None:
    """The manifest of the build in ``where`` when it is the build of ``key``, complete and
    trusted (``_trusted``: the directories from the cache down, the manifest, every file)."""
    try:
        manifest = json.loads((where / MANIFEST).read_text())
        if manifest.get("key") != key or manifest.get("modules") != list(MODULES):
            return None
        top = where.resolve()
        files = [(top / rel).resolve() for rel in manifest["files"].values()]  # (links followed)
        if not all(f.is_file() and top in f.parents for f in files):
            return None
        dirs = {top.parent, top, *(p for f in files for p in f.parents if top in p.parents)}
        if not all(_trusted(p) for p in [*dirs, top / MANIFEST, *files]):
            return None
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return manifest  # type: ignore[no-any-return]


def enable(quiet: bool = False) -> bool:
    """Install the finder of the build whose key is this process's sources' key; False (pure
    Python) when there is none or it is too late. One line on stderr says which."""
    try:
        key = source_key()
        where = cache_dir() / key
        early = [m for m in MODULES if m in sys.modules]
        manifest = None if early else _manifest(where, key)
        if early:
            reason = f"already imported before enable(): {', '.join(early)}"
        elif manifest is None:
            reason = (f"no build for these sources that this user owns and only it may write (key {key} in "
                      f"{cache_dir()}: python -m meshserve.native build)")
        else:
            sys.meta_path.insert(0, _Finder(where, manifest["files"]))
            reason = f"build {key}"
    except OSError as exc:  # an unreadable source or cache: pure Python
        manifest, reason = None, f"cannot check the build: {exc}"
    STATE.update(running="compiled" if manifest else "pure", reason=reason)
    if not quiet:
        what = f"compiled ({len(MODULES)} modules)" if manifest else "pure Python"
        print(f"meshserve native: running {what}: {reason}", file=sys.stderr, flush=True)
    return manifest is not None


def running(module: ModuleType) -> str:
    """"compiled" when ``module`` was loaded from an extension, else "pure"."""
    return "compiled" if str(getattr(module, "__file__", "")).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) \
        else "pure"


def build(base: Path | None = None, out: Path | None = None, jobs: int | None = None) -> Path:
    """Compile MODULES of the sources under ``base`` into ``out/<key>`` (made atomically); the
    directory of the build. An existing build of the same key is kept."""
    base = base or root()
    out = out or cache_dir()
    key = source_key(base)
    final = out / key
    if _manifest(final, key) is not None:
        return final
    out.mkdir(parents=True, exist_ok=True, mode=0o755)
    with tempfile.TemporaryDirectory(prefix="native-", dir=out) as tmp:
        work = Path(tmp) / "src"
        for pkg in PACKAGES:
            shutil.copytree(base / pkg, work / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        (work / "mypy.ini").write_text(_MYPY_CONFIG.format(major=sys.version_info[0], minor=sys.version_info[1]))
        files = [m.replace(".", "/") + ".py" for m in MODULES]
        env = dict(os.environ, MYPYC_OPT_LEVEL=os.environ.get("MYPYC_OPT_LEVEL", "3"))
        env.pop(ENV, None)
        if jobs:
            env["MAKEFLAGS"] = f"-j{jobs}"
        proc = subprocess.run([sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *files], cwd=work,
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
        stage = Path(tmp) / key
        found: dict[str, str] = {}
        for module in MODULES:
            stem = work / module.replace(".", "/")
            ext = next((p for p in stem.parent.glob(stem.name + ".*") if p.suffix == ".so" or p.suffix == ".pyd"),
                       None)
            if ext is None:
                raise RuntimeError(f"mypyc made no extension for {module}")
            rel = ext.relative_to(work)
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ext, stage / rel)
            found[module] = str(rel)
        for lib in work.glob("*__mypyc.*"):  # the group's shared library, a top-level module
            shutil.copy2(lib, stage / lib.name)
            found[lib.name.split(".", 1)[0]] = lib.name
        (stage / MANIFEST).write_text(json.dumps({"key": key, "modules": list(MODULES), "files": found,
                                                  "python": sys.version, "mypy": _version("mypy")}, indent=1))
        try:
            stage.rename(final)
        except OSError:  # made meanwhile by another build of the same key
            if _manifest(final, key) is None:
                raise
    return final


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m meshserve.native", description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("build", "status", "key"))
    ap.add_argument("--cache", type=Path, help=f"build cache (default: ${ENV_DIR} or ~/.cache/meshserve/native)")
    args = ap.parse_args(argv)
    if args.cache:
        os.environ[ENV_DIR] = str(args.cache)
    if args.command == "key":
        print(source_key())
    elif args.command == "build":
        print(build())
    else:
        key = source_key()
        ok = _manifest(cache_dir() / key, key) is not None
        print(f"sources {root()} key {key}: {'built' if ok else 'not built'} in {cache_dir()}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
