"""Device memory in the mesh's budget on a GPU host (docs/model-mesh.md, "GPU memory"): a
torchscript service whose KIND_GPU models' device memory is counted per GPU against
--gpu-memory-budget (its host budget large): a second model that does not fit on the GPU evicts
the first; one larger than the GPU's budget is refused naming it; the figures are on /metrics and
in what a lazy gateway shows (GET /v2/placement). Real processes and the real tritonclient;
skipped on a host without a CUDA device (the logic without one: tests/unit/services/test_gpu_memory.py)."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import _wait_http_ready, start
from tests.support import eventually, sized_models
from tests.support.metrics import sample, scrape

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")

N = 2896  # 33.5 MB of FP32 weights per model
FILE_BYTES = N * N * 4
GPU_BUDGET = 60_000_000  # one model (its first estimate: 1.2 x its file), never two (each at least its file)


def _gpu_model(repo: Path, name: str, n: int, value: float) -> None:
    folder = sized_models.torch_linear(repo, name, n, value)
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("count: 1 kind: KIND_CPU", "count: 1 kind: KIND_GPU gpus: [ 0 ]"))


def _ask(c: httpclient.InferenceServerClient, model: str) -> float:
    x = httpclient.InferInput("INPUT__0", [1, N], "FP32")
    x.set_data_from_numpy(sized_models.row_of_ones(N))
    y = c.infer(model, [x]).as_numpy("OUTPUT__0")
    assert y is not None
    return round(float(y[0, 0]), 3)


def test_gpu_models_are_counted_and_evicted_under_the_gpu_budget(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _gpu_model(repo, "g0", N, 1.0)
    _gpu_model(repo, "g1", N, 2.0)
    _gpu_model(repo, "huge", 4500, 3.0)  # 81 MB: more than the GPU's whole budget
    svc = start(["service", "torchscript", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                 "--model-control-mode", "explicit", "--memory-budget", "2G",
                 "--gpu-memory-budget", f"0={GPU_BUDGET}", "--eviction-grace", "0"])
    gateway = None
    try:
        with httpclient.InferenceServerClient(svc.http) as c:
            c.load_model("g0")
            assert _ask(c, "g0") == 1.0
            samples = scrape(svc.http)
            assert sample(samples, "meshserve_gpu_memory_budget_bytes", gpu="0") == GPU_BUDGET
            size = sample(samples, "meshserve_model_gpu_memory_bytes", model="g0", version="1", gpu="0")
            assert FILE_BYTES <= size <= GPU_BUDGET
            assert sample(samples, "meshserve_gpu_memory_used_bytes", gpu="0") == size
            c.load_model("g1")  # the host budget has room; GPU 0 does not: g0 goes
            assert [c.is_model_ready("g0"), c.is_model_ready("g1")] == [False, True]
            assert _ask(c, "g1") == 2.0
            with pytest.raises(InferenceServerException) as err:
                c.load_model("huge")
            assert err.value.status() == "429"
            assert "more than the whole memory budget of GPU 0" in err.value.message(), err.value.message()
        samples = scrape(svc.http)
        assert sample(samples, "meshserve_model_evictions_total", model="g0") == 1
        assert sample(samples, "meshserve_gpu_memory_used_bytes", gpu="0") <= GPU_BUDGET
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc,
                         "--model-control-mode", "lazy", "--placement-interval", "0.5"])
        _wait_http_ready(gateway.http)

        def gpus() -> dict:
            with urllib.request.urlopen(f"http://{gateway.http}/v2/placement", timeout=10) as r:
                return json.load(r)["replicas"][0]["gpus"] or {}

        eventually(lambda: gpus().get("0", {}).get("budget_bytes") == GPU_BUDGET, what="the GPU figures read")
        assert 0 < gpus()["0"]["used_bytes"] <= GPU_BUDGET
    finally:
        if gateway is not None:
            gateway.stop()
        svc.stop()
