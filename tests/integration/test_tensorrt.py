"""The TensorRT service with a real engine: `meshserve build-trt` builds a plan from an ONNX
model, the service loads it, the gateway fronts it, tritonclient drives it (HTTP + gRPC).

Skips unless `tensorrt` (the [tensorrt] extra) imports and a CUDA device is visible.
"""
from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, Proc, service_and_gateway
from tests.support import models

pytest.importorskip("tensorrt", reason="the TensorRT tests need the [tensorrt] extra")


def _gpus() -> int:
    try:
        from services.tensorrt.trt_engine import gpu_count
    except ImportError:
        return 0
    return gpu_count()


pytestmark = pytest.mark.skipif(_gpus() == 0, reason="TensorRT needs a CUDA GPU")

CONFIG = models.pair_config("trt_add_sub", "tensorrt_plan", 16, extra="""instance_group [ { kind: KIND_GPU count: 2 } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
""")


def _onnx_add_sub(path: Path) -> None:
    from onnx import TensorProto

    models.save_onnx(models.add_sub(TensorProto.FLOAT), path)


@pytest.fixture(scope="module")
def trt_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    work = tmp_path_factory.mktemp("tensorrt")
    _onnx_add_sub(work / "add_sub.onnx")
    plan = work / "repo" / "trt_add_sub" / "1" / "model.plan"
    res = subprocess.run([sys.executable, "-m", "meshserve", "build-trt", str(work / "add_sub.onnx"), "-o", str(plan),
                          "--min-batch", "1", "--opt-batch", "4", "--max-batch", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert 'platform: "tensorrt_plan"' in res.stdout
    (plan.parent.parent / "config.pbtxt").write_text(CONFIG)
    with service_and_gateway("tensorrt", ["--repository", str(work / "repo")], timeout=300) as both:
        yield both


def _inputs(module: Any, a: np.ndarray, b: np.ndarray) -> list[Any]:
    ins = [module.InferInput("INPUT0", list(a.shape), "FP32"), module.InferInput("INPUT1", list(b.shape), "FP32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    return ins


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_real_engine_add_sub(trt_stack: tuple[Proc, Proc], proto: str) -> None:
    _, gateway = trt_stack
    module: Any = httpclient if proto == "http" else grpcclient
    url = gateway.http if proto == "http" else gateway.grpc
    a = np.arange(48, dtype=np.float32).reshape(3, 16)
    b = np.full((3, 16), 0.5, dtype=np.float32)
    with module.InferenceServerClient(url) as c:
        result = c.infer("trt_add_sub", _inputs(module, a, b))
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)
        with pytest.raises(InferenceServerException) as err:
            c.infer("trt_add_sub", _inputs(module, np.ones((1, 15), np.float32), np.ones((1, 15), np.float32)))
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_real_engine_batches(trt_stack: tuple[Proc, Proc]) -> None:
    _, gateway = trt_stack

    def stats() -> dict:
        with httpclient.InferenceServerClient(gateway.http) as c:
            return c.get_inference_statistics("trt_add_sub")["model_stats"][0]

    before = stats()

    def worker(i: int) -> bool:
        a = np.full((1, 16), i, dtype=np.float32)
        with grpcclient.InferenceServerClient(gateway.grpc) as c:
            return all(np.array_equal(c.infer("trt_add_sub", _inputs(grpcclient, a, a)).as_numpy("OUTPUT0"), a * 2)
                       for _ in range(4))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(pool.map(worker, range(16)))
    after = stats()
    inferences = after["inference_count"] - before["inference_count"]
    assert inferences == 64
    assert after["execution_count"] - before["execution_count"] < inferences
