"""EXECUTION_ENV_PATH's forms and refusals (services/python/execution_env.py): a packed
environment unpacked once into the cache, an unpacked one, its conda-pack activation script; an
archive member outside the folder, a relative path, a python without numpy refused naming the
model and the parameter. (A model served in one: tests/integration/test_python_backend.py.)"""
from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from services.base.runtime import RuntimeLoadError
from services.python import execution_env


def _venv(path: Path, numpy: bool = True) -> Path:
    args = [sys.executable, "-m", "venv", "--copies", "--without-pip", str(path)]
    subprocess.run(args + (["--system-site-packages"] if numpy else []), check=True, timeout=60)
    return path


def _pack(env: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(env, arcname=".")
    return archive


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "python-envs"


def test_an_archive_is_unpacked_once_and_its_python_runs_the_worker(tmp_path: Path, cache: Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    _pack(_venv(tmp_path / "env"), model_dir / "env.tar.gz")
    env = execution_env.resolve("$$TRITON_MODEL_DIRECTORY/env.tar.gz", model_dir, "m")
    assert env.root.parent == cache and (env.root / ".complete").exists()
    assert env.python == env.root / "bin" / "python3"
    again = execution_env.resolve(f"{model_dir}/env.tar.gz", model_dir, "m")
    assert again == env and len(list(cache.iterdir())) == 1  # (no second unpack)
    activated = env.environ({"PATH": "/usr/bin", "PYTHONHOME": "/elsewhere"})
    assert activated["PATH"].split(":")[0] == str(env.root / "bin") and "PYTHONHOME" not in activated


def test_an_unpacked_environment_or_its_activation_script(tmp_path: Path, cache: Path) -> None:
    root = _venv(tmp_path / "env")
    assert execution_env.resolve(str(root), tmp_path, "m").root == root
    script = root / "lib" / "python3.11" / "site-packages" / "conda_pack" / "scripts" / "posix" / "activate"
    script.parent.mkdir(parents=True)
    script.write_text("# conda-pack's\n")
    assert execution_env.resolve(str(script), tmp_path, "m").root == root


def test_a_member_outside_the_folder_is_refused(tmp_path: Path, cache: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"x"
        member = tarfile.TarInfo("../outside.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    with pytest.raises(RuntimeLoadError, match=r"model 'm': parameter EXECUTION_ENV_PATH '.*evil.tar.gz': the "
                                               r"archive holds a member that is not allowed \(\w+\): '../outside.txt'$") as err:
        execution_env.resolve(str(archive), tmp_path, "m")
    assert str(cache) not in str(err.value)  # (the cache's folder is not named to a client)
    assert not (tmp_path / "outside.txt").exists() and not (cache.parent / "outside.txt").exists()
    assert [p for p in cache.iterdir()] == []  # (its scratch folder went too)


@pytest.mark.parametrize(("value", "why"), [
    ("env.tar.gz", "the path must be absolute"),
    ("$$TRITON_MODEL_DIRECTORY/nothere.tar.gz", "no such file or folder"),
    ("$$TRITON_MODEL_DIRECTORY/config.pbtxt", "neither a conda-pack archive"),
])
def test_a_path_that_names_no_environment_is_refused(value: str, why: str, tmp_path: Path, cache: Path) -> None:
    (tmp_path / "config.pbtxt").write_text("")
    with pytest.raises(RuntimeLoadError, match=f"model 'm': parameter EXECUTION_ENV_PATH '.*': {why}"):
        execution_env.resolve(value, tmp_path, "m")


def test_an_environment_without_numpy_is_refused(tmp_path: Path, cache: Path) -> None:
    root = _venv(tmp_path / "bare", numpy=False)
    with pytest.raises(RuntimeLoadError, match="its python cannot import numpy"):
        execution_env.resolve(str(root), tmp_path, "m")
