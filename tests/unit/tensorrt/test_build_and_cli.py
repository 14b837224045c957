"""`meshserve build-trt` profile math and config hint, and both TensorRT commands refusing to
run without the [tensorrt] extra."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from services.tensorrt.build import BatchRange, BuildError, config_hint, profile_shapes
from tests.conftest import ROOT

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def test_batch_range() -> None:
    assert BatchRange.from_args(1, None, 8) == BatchRange(1, 8, 8)
    assert BatchRange.from_args(2, 4, 16) == BatchRange(2, 4, 16)
    for bad in ((0, None, 8), (4, 2, 8), (1, 9, 8), (9, None, 8)):
        with pytest.raises(BuildError, match="--min-batch"):
            BatchRange.from_args(*bad)


def test_profile_shapes_batch_dimension_only() -> None:
    batch = BatchRange(1, 4, 8)
    shapes = profile_shapes([("x", (-1, 3, 224, 224)), ("static", (2, 2))], batch)
    assert shapes == {"x": ((1, 3, 224, 224), (4, 3, 224, 224), (8, 3, 224, 224))}
    assert profile_shapes([("a", (1, 4))], batch) == {}
    with pytest.raises(BuildError, match=r"'seq' \[-1, -1\]"):
        profile_shapes([("seq", (-1, -1)), ("ok", (-1, 4))], batch)


def test_config_hint() -> None:
    hint = config_hint([("INPUT0", (-1, 16), "FP32")], [("OUTPUT0", (-1, 16), "FP32")], True, 8)
    assert 'platform: "tensorrt_plan"' in hint and "max_batch_size: 8" in hint
    assert '{ name: "INPUT0" data_type: TYPE_FP32 dims: [16] }' in hint and "dynamic_batching" in hint
    static = config_hint([("x", (2, 2), "INT32")], [("y", (2,), "INT32")], False, 8)
    assert "max_batch_size: 0" in static and "dims: [2, 2]" in static and "dynamic_batching" not in static


def _meshserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshserve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
def test_service_refuses_to_start_without_tensorrt(tmp_path: Path) -> None:
    res = _meshserve("service", "tensorrt", "--repository", str(tmp_path), "--grpc-port", "0")
    assert res.returncode != 0
    assert "TensorRT Python package is not installed" in res.stderr
    assert "[tensorrt]" in res.stderr
    assert "MESHSERVE_READY" not in res.stdout


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is installed")
def test_build_trt_refuses_without_tensorrt(tmp_path: Path) -> None:
    res = _meshserve("build-trt", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "model.plan"))
    assert res.returncode != 0
    assert res.stderr.strip().startswith("meshserve build-trt:") and "[tensorrt]" in res.stderr
    assert not (tmp_path / "model.plan").exists()
