"""meshserve/native.py: a compiled module runs only when its build's key is the sources' key,
pure Python otherwise, and one stderr line says which (docs/perf/native.md).

The tests that need a real build (mypyc, ~1-2 min of CPU on 2 cores) run when
MESHSERVE_NATIVE_TESTS=1; they reuse the build in $MESHSERVE_NATIVE_DIR when there is one:

    MESHSERVE_NATIVE_TESTS=1 MESHSERVE_NATIVE_DIR=/tmp/native-cache python -m pytest -q tests/unit/test_native.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshserve import native

ROOT = Path(__file__).resolve().parents[2]
REAL = os.environ.get("MESHSERVE_NATIVE_TESTS") == "1"
real_build = pytest.mark.skipif(not REAL, reason="MESHSERVE_NATIVE_TESTS=1: builds with mypyc")
PROBE = ("import meshserve.native as n, meshserve.server.h2.server as s, gateway.upstream.merging as m; "
         "print(n.STATE['running'], n.running(s), n.running(m), s.__file__)")


def _tree(base: Path) -> Path:
    """A copy of this checkout's two packages (what source_key reads), without build outputs."""
    for pkg in native.PACKAGES:
        shutil.copytree(ROOT / pkg, base / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return base


def _probe(tree: Path, cache: Path, native_on: str = "1") -> tuple[list[str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_NATIVE")}
    env.update(MESHSERVE_NATIVE=native_on, MESHSERVE_NATIVE_DIR=str(cache), PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), proc.stderr


def test_the_key_changes_with_any_source_of_the_packages_and_only_with_them(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "a")
    key = native.source_key(tree)
    assert key == native.source_key(ROOT) == native.source_key(tree)  # (path and bytes: not where it lies)
    (tree / "README.txt").write_text("not a source")
    assert native.source_key(tree) == key
    compiled = tree / "meshserve/server/h2/frames.py"
    compiled.write_text(compiled.read_text() + "\n")
    assert native.source_key(tree) != key
    compiled.write_text(compiled.read_text()[:-1])
    assert native.source_key(tree) == key
    other = tree / "meshserve/protocol/errors.py"  # not compiled, but the compiled code trusts its types
    other.write_text(other.read_text() + "# edited\n")
    assert native.source_key(tree) != key


def test_without_a_build_the_pure_modules_run_and_the_line_says_why(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "src")
    out, err = _probe(tree, tmp_path / "empty-cache")
    assert out[:3] == ["pure", "pure", "pure"] and out[3] == str(tree / "meshserve/server/h2/server.py")
    assert "meshserve native: running pure Python: no build for these sources" in err
    out, err = _probe(tree, tmp_path / "empty-cache", native_on="0")
    assert out[:3] == ["pure", "pure", "pure"] and err == ""  # (off: no line)


def test_a_manifest_of_another_key_or_missing_files_is_not_used(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "src")
    key = native.source_key(tree)
    cache = tmp_path / "cache"
    files = {m: m.replace(".", "/") + ".so" for m in native.MODULES}
    for name, manifest_key in ((key, "0" * 32), (key, key)):  # a stale manifest; then its files missing
        (cache / name).mkdir(parents=True, exist_ok=True)
        (cache / name / native.MANIFEST).write_text(json.dumps({"key": manifest_key, "modules": list(native.MODULES),
                                                                "files": files}))
        out, err = _probe(tree, cache)
        assert out[:3] == ["pure", "pure", "pure"] and "no build for these sources" in err


def test_a_build_others_may_write_is_not_used(tmp_path: Path) -> None:
    """A build is code the process runs: a manifest that matches but sits in a directory (or
    names files) that another user could have written is refused."""
    key = "k" * 32
    where = tmp_path / "cache" / key
    files = {}
    for m in native.MODULES:
        f = where / (m.replace(".", "/") + ".so")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
        files[m] = str(f.relative_to(where))
    (where / native.MANIFEST).write_text(json.dumps({"key": key, "modules": list(native.MODULES), "files": files}))
    for p in [tmp_path / "cache", *sorted(where.rglob("*")), where]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    assert native._manifest(where, key) is not None
    for loose in (where / files[native.MODULES[2]], where / native.MANIFEST, where, tmp_path / "cache",
                  (where / files[native.MODULES[0]]).parent):
        mode = loose.stat().st_mode
        loose.chmod(mode | 0o002)
        assert native._manifest(where, key) is None, loose
        loose.chmod(mode | 0o020)
        assert native._manifest(where, key) is None, loose
        loose.chmod(mode)
    assert native._manifest(where, key) is not None
    escaping = dict(files, **{native.MODULES[0]: "../elsewhere.so"})  # a file outside the build
    (tmp_path / "cache" / "elsewhere.so").write_bytes(b"")
    (where / native.MANIFEST).write_text(json.dumps({"key": key, "modules": list(native.MODULES), "files": escaping}))
    assert native._manifest(where, key) is None


def test_the_finder_answers_only_the_names_of_its_manifest(tmp_path: Path) -> None:
    finder = native._Finder(tmp_path, {"meshserve.server.h2.frames": "x/frames.so"})
    spec = finder.find_spec("meshserve.server.h2.frames")
    assert spec is not None and spec.origin == str(tmp_path / "x/frames.so")
    assert finder.find_spec("meshserve.server.h2.requests") is None and finder.find_spec("json") is None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = Path(os.environ.get(native.ENV_DIR) or tmp_path_factory.mktemp("native-cache"))
    native.build(ROOT, cache)
    yield cache


@real_build
def test_a_build_loads_compiled_until_a_source_changes(built: Path, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "src")
    out, err = _probe(tree, built)
    assert out[:3] == ["compiled", "compiled", "compiled"] and out[3].startswith(str(built))
    assert f"running compiled ({len(native.MODULES)} modules): build {native.source_key(tree)}" in err
    edited = tree / "meshserve/server/h2/connection.py"
    edited.write_text(edited.read_text() + "# edited after the build\n")
    out, err = _probe(tree, built)  # (the stale build is never used: the edited source runs)
    assert out[:3] == ["pure", "pure", "pure"] and out[3] == str(tree / "meshserve/server/h2/server.py")


@real_build
def test_a_compiled_gateway_and_service_answer_the_real_tritonclient(built: Path, model_repo: Path) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from tests.conftest import service_and_gateway

    env = {"MESHSERVE_NATIVE": "1", native.ENV_DIR: str(built)}
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 0.5, dtype=np.float32)
    with service_and_gateway("onnx", ["--repository", str(model_repo)], env=env) as (service, gateway):
        for proc in (service, gateway):
            assert any("meshserve native: running compiled" in line for line in proc.output), proc.log()
        for mod, url in ((grpcclient, gateway.grpc), (httpclient, gateway.http)):
            for _ in range(3):  # (the second on: the HPACK block cache's path on gRPC)
                inputs = [mod.InferInput("INPUT0", [2, 16], "FP32"), mod.InferInput("INPUT1", [2, 16], "FP32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(b)
                client = mod.InferenceServerClient(url)
                try:
                    res = client.infer("add_sub", inputs)
                finally:
                    client.close()
                np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
                np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)


LEFT_OPEN = """
import asyncio, sys
from tests.unit.server import test_h2client as t

async def main():
    async with t.serving("h2grpc") as s:  # a request stream left open when its server stops
        c = await t.connect(s.target, timeout=5)
        first = t.Call(c, "Echo")
        first.send(b"x")
        assert await first.received(1) == [b"x"]
        c.close()
    assert sys.exc_info() == (None, None, None), sys.exc_info()
    async with t.serving("h2grpc") as s:  # then a stream on a new server ends OK
        c = await t.connect(s.target, timeout=5)
        call = t.Call(c, "Echo")
        call.send(b"y")
        assert await call.received(1) == [b"y"]
        call.send(b"end")
        print(await call.closed())
        c.close()

asyncio.run(main())
"""


@real_build
def test_a_cancelled_stream_leaves_no_exception_for_the_next_call(built: Path) -> None:
    """mypyc 2.4 leaves the exception a coroutine unwound through an ``await`` in ``finally`` as
    the thread's handled exception, and a later call raises it again: the response-streaming
    loop stays interpreted (meshserve/server/h2/requests.py:answered). Before that, every
    request stream after one cancelled at a server's stop ended CANCELLED."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_NATIVE")}
    env.update(MESHSERVE_NATIVE="1", MESHSERVE_NATIVE_DIR=str(built), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", LEFT_OPEN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert "meshserve native: running compiled" in proc.stderr
    assert proc.returncode == 0 and proc.stdout.split("\n")[-2] == "(0, '')", proc.stdout + proc.stderr
