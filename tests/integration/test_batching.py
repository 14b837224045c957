"""Dynamic batching, proven through the statistics extension (as Triton's qa/L0_batcher does)."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def _stats(url: str, model: str) -> dict:
    with httpclient.InferenceServerClient(url) as c:
        return c.get_inference_statistics(model)["model_stats"][0]


def test_32_concurrent_clients_share_batches(stack) -> None:
    before = _stats(stack.gateway.http, "small_mlp")
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)

    def worker(i: int) -> int:
        ok = 0
        with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
            for _ in range(10):
                inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
                inp.set_data_from_numpy(x * i)
                out = c.infer("small_mlp", [inp]).as_numpy("OUTPUT0")
                ok += out.shape == (1, 64)
        return ok

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert sum(pool.map(worker, range(32))) == 320
    after = _stats(stack.gateway.http, "small_mlp")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 320
    # 32 clients against a 5 ms queue delay: requests must share executions.
    assert executions <= inferences / 3, (inferences, executions)
    # every member of inference_stats is reported, and queue.count moves per request
    assert after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"] == 320
    sizes = {b["batch_size"] for b in after["batch_stats"]}
    assert max(sizes) > 1


def test_statistics_for_all_models_and_unknown(stack) -> None:
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        all_stats = c.get_inference_statistics()["model_stats"]
        names = {s["name"] for s in all_stats}
        assert {"add_sub", "small_mlp", "scale"} <= names
        for s in all_stats:
            assert set(s["inference_stats"]) >= {"success", "fail", "queue", "compute_input",
                                                  "compute_infer", "compute_output", "cache_hit", "cache_miss"}
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        try:
            c.get_inference_statistics("nope")
            raise AssertionError("expected an error")
        except Exception as exc:  # tritonclient raises InferenceServerException
            assert "nope" in str(exc)


def test_repository_index(stack) -> None:
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        index = c.get_model_repository_index()
    entries = {(m["name"], m.get("version", "")) for m in index}
    assert ("scale", "1") in entries and ("scale", "2") in entries and ("add_sub", "1") in entries
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        gindex = c.get_model_repository_index()
    assert {(m.name, m.version) for m in gindex.models} == entries
