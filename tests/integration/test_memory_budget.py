"""A service's memory budget (issue 32, items 1, 5 and 7's service half), through real service
processes and the real tritonclient: a budget that holds three ~34 MB models; loading a fourth
evicts the least recently used unpinned one (statistics, index and /metrics show it); a pinned
model stays; an eviction waits for a slow request in flight and the request completes; nothing
evictable is RESOURCE_EXHAUSTED / 429 with "memory budget"; the metric families are there."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, start
from tests.support import eventually, sized_models
from tests.support.metrics import sample, scrape

N = 2896  # 2896 x 2896 FP32 weights: 33.5 MB per model
FILE_BYTES = N * N * 4
# three models fit (each measured at most ~1.29x its file; onnxruntime's one-time start is in the
# service's base: services/base/memory.py:MemoryBook.prime), a fourth never does (each is at least its file)
BUDGET = 130_000_000
SLOW_MS = 5000  # the slow request of the eviction test


def _service(kind: str, repo: Path, *args: str) -> Proc:
    return start(["service", kind, "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--model-control-mode", "explicit", *args])


def _ask(c: httpclient.InferenceServerClient, model: str, ms: float | None = None) -> float:
    x = httpclient.InferInput("x", [1, N], "FP32")
    x.set_data_from_numpy(sized_models.row_of_ones(N))
    inputs = [x]
    if ms is not None:
        slow = httpclient.InferInput("ms", [1], "FP32")
        slow.set_data_from_numpy(np.array([ms], np.float32))
        inputs.append(slow)
    y = c.infer(model, inputs).as_numpy("y")
    assert y is not None and y.shape == (1, N)
    return float(np.round(y[0, 0], 3))


@pytest.fixture(scope="module")
def onnx_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("budget")
    for i in range(4):
        sized_models.onnx_matmul(repo, f"m{i}", N, float(i + 1))
    sized_models.onnx_matmul(repo, "huge", 5800, 9.0)  # 134.6 MB: more than the whole budget
    return repo


@pytest.fixture()
def budgeted(onnx_repo: Path) -> Iterator[Proc]:
    svc = _service("onnx", onnx_repo, "--memory-budget", str(BUDGET), "--pin", "m0")
    yield svc
    svc.stop()


def test_fourth_model_evicts_the_least_recently_used_unpinned_one(budgeted: Proc) -> None:
    with httpclient.InferenceServerClient(budgeted.http) as c:
        for name in ("m0", "m1", "m2"):
            c.load_model(name)
        # m0 is pinned and used least recently of all; m1 before m2
        assert _ask(c, "m1") == 2.0
        assert _ask(c, "m2") == 3.0
        stats = {s["name"]: s["last_inference"] for s in c.get_inference_statistics()["model_stats"]}
        assert stats["m0"] == 0 < stats["m1"] <= stats["m2"]  # the LRU order, in Triton's statistics
        c.load_model("m3")
        ready = {m: c.is_model_ready(m) for m in ("m0", "m1", "m2", "m3")}
        assert ready == {"m0": True, "m1": False, "m2": True, "m3": True}
        assert _ask(c, "m0") == 1.0 and _ask(c, "m3") == 4.0
        index = {m["name"]: m for m in c.get_model_repository_index()}
        assert index["m1"]["state"] == "UNAVAILABLE" and "memory budget" in index["m1"]["reason"]
        samples = scrape(budgeted.http)
        assert sample(samples, "meshserve_model_evictions_total", model="m1") == 1
        assert not any(n == "meshserve_model_evictions_total" and ("model", "m0") in lab for n, lab in samples)
        # m1 again: the least recently used unpinned version now is m2 (m0 stays pinned)
        _ask(c, "m3")
        c.load_model("m1")
        assert [c.is_model_ready(m) for m in ("m0", "m1", "m2", "m3")] == [True, True, False, True]
        assert _ask(c, "m1") == 2.0
        samples = scrape(budgeted.http)
        assert sample(samples, "meshserve_model_loads_total", model="m1") == 2
        assert sample(samples, "meshserve_model_evictions_total", model="m2") == 1
        used = sample(samples, "meshserve_memory_used_bytes")
        sizes = {m: sample(samples, "meshserve_model_memory_bytes", model=m, version="1") for m in ("m0", "m1", "m3")}
        assert used == sum(sizes.values()) <= BUDGET
        assert all(FILE_BYTES <= s <= 1.35 * FILE_BYTES for s in sizes.values()), sizes


def test_metric_families_of_the_budget(budgeted: Proc) -> None:
    with httpclient.InferenceServerClient(budgeted.http) as c:
        c.load_model("m2")
        _ask(c, "m2")
    samples = scrape(budgeted.http)
    assert sample(samples, "meshserve_memory_budget_bytes") == BUDGET
    assert sample(samples, "meshserve_memory_used_bytes") == sample(samples, "meshserve_model_memory_bytes")
    assert 0 < sample(samples, "meshserve_memory_pressure_ratio") < 1
    assert sample(samples, "meshserve_saturation_ratio") >= 0
    assert sample(samples, "meshserve_model_loads_total", model="m2") == 1
    assert sample(samples, "meshserve_model_load_duration_seconds_count", model="m2") == 1
    assert sample(samples, "meshserve_model_load_duration_seconds_sum", model="m2") > 0
    assert sample(samples, "nv_inference_pending_request_count", model="m2", version="1") == 0
    total, used = sample(samples, "nv_cpu_memory_total_bytes"), sample(samples, "nv_cpu_memory_used_bytes")
    assert 0 < used < total
    with grpc.insecure_channel(budgeted.grpc) as ch:  # the same exposition over gRPC: what a gateway reads
        scrape_rpc = ch.unary_unary("/meshserve.Metrics/Scrape", request_serializer=None, response_deserializer=None)
        text = scrape_rpc(b"", timeout=10).decode()
    assert "meshserve_memory_budget_bytes" in text and 'meshserve_model_memory_bytes{model="m2",version="1"}' in text


def test_nothing_evictable_is_resource_exhausted(onnx_repo: Path) -> None:
    svc = _service("onnx", onnx_repo, "--memory-budget", str(BUDGET), "--pin", "m0", "--pin", "m1", "--pin", "m2")
    try:
        with httpclient.InferenceServerClient(svc.http) as c:
            for name in ("m0", "m1", "m2"):
                c.load_model(name)
            with pytest.raises(InferenceServerException) as err:
                c.load_model("m3")
            assert err.value.status() == "429" and "memory budget" in err.value.message()
            assert "/" not in err.value.message()  # no path of the host
            assert not c.is_model_ready("m3")
            assert all(c.is_model_ready(m) for m in ("m0", "m1", "m2"))
        with grpcclient.InferenceServerClient(svc.grpc) as g:
            with pytest.raises(InferenceServerException) as gerr:
                g.load_model("m3")
            assert gerr.value.status() == "StatusCode.RESOURCE_EXHAUSTED" and "memory budget" in gerr.value.message()
            with pytest.raises(InferenceServerException) as huge:  # more than the whole budget: at once
                g.load_model("huge")
            assert huge.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert "more than the whole memory budget" in huge.value.message()
            index = {m.name: m for m in g.get_model_repository_index().models}
            assert index["m3"].state == "UNAVAILABLE" and "memory budget" in index["m3"].reason
        assert sample(scrape(svc.http), "meshserve_model_loads_total", model="m2") == 1
    finally:
        svc.stop()


def test_an_eviction_waits_for_a_slow_request_in_flight(tmp_path: Path) -> None:
    """Two python models of ~34 MB of weights (~56 MB with their worker): the budget holds one.
    Loading the second while the first serves a 2 s request waits for it, then evicts the first."""
    repo = tmp_path / "repo"
    for i, name in enumerate(("slow_a", "slow_b")):
        sized_models.python_weights(repo, name, N, float(i + 1))
    svc = _service("python", repo, "--memory-budget", "100M")
    try:
        with httpclient.InferenceServerClient(svc.http, network_timeout=60) as c:
            c.load_model("slow_a")
            answers: list[float] = []

            def slow_request() -> None:  # its own client: tritonclient's HTTP client is one thread's
                with httpclient.InferenceServerClient(svc.http, network_timeout=60) as own:
                    answers.append(_ask(own, "slow_a", ms=SLOW_MS))

            sent = time.monotonic()
            slow = threading.Thread(target=slow_request)
            slow.start()
            eventually(lambda: sample(scrape(svc.http), "nv_inference_pending_request_count", model="slow_a") == 1,
                       what="the slow request in flight")
            loaded: list[float] = []

            def load() -> None:  # returns once slow_a's request is over and slow_a is gone
                with httpclient.InferenceServerClient(svc.http, network_timeout=60) as own:
                    own.load_model("slow_b")
                    loaded.append(time.monotonic())

            loader = threading.Thread(target=load)
            loader.start()
            # while its request runs (it cannot end before SLOW_MS after it was sent), slow_a stays
            # in service: the waiting load did not take it away under its request
            seen = []
            while time.monotonic() < sent + SLOW_MS / 1000 - 0.5:
                seen.append(c.is_model_ready("slow_a"))
                time.sleep(0.05)  # the point: watch the model through the request's whole run
            assert seen and all(seen)
            loader.join(60)
            slow.join(30)
            assert answers == [1.0], "the request in flight was answered"
            assert loaded and loaded[0] - sent >= SLOW_MS / 1000, "the load waited for the request"
            assert not c.is_model_ready("slow_a") and c.is_model_ready("slow_b")
            assert _ask(c, "slow_b") == 2.0
            samples = scrape(svc.http)
            assert sample(samples, "meshserve_model_evictions_total", model="slow_a") == 1
            stats = c.get_inference_statistics("slow_b")["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 1
    finally:
        svc.stop()


def test_at_start_pinned_models_load_first_and_the_rest_only_while_they_fit(onnx_repo: Path) -> None:
    """--load-model '*' under a budget of about two models: the pinned one (last by name) loads
    first, one more fits, the others are not loaded (their reason names the budget); nothing is
    evicted at start."""
    svc = _service("onnx", onnx_repo, "--load-model", "*", "--memory-budget", "90M", "--pin", "m3")
    try:
        with httpclient.InferenceServerClient(svc.http) as c:
            ready = {m: c.is_model_ready(m) for m in ("m0", "m1", "m2", "m3", "huge")}
            assert ready["m3"] and sum(ready.values()) == 2, ready
            index = {m["name"]: m for m in c.get_model_repository_index()}
            for name, up in ready.items():
                assert up or "memory budget" in index[name]["reason"], index[name]
        samples = scrape(svc.http)
        assert sample(samples, "meshserve_memory_used_bytes") <= 90_000_000
        assert not any(n == "meshserve_model_evictions_total" for n, _ in samples)
    finally:
        svc.stop()


def test_evictions_under_traffic_lose_no_admitted_request(budgeted: Proc) -> None:
    """Four clients call m1, m2, m3 and m0 without pause while loads cycle through the four
    (three fit): every answer is its own model's, and a request fails only as a model that is
    not loaded at that moment does (NOT_FOUND / UNAVAILABLE, before it was admitted), never
    mid-flight (INTERNAL, CANCELLED, a dropped connection)."""
    stop = threading.Event()
    outcomes: dict[str, list[str]] = {f"m{i}": [] for i in range(4)}

    def client(model: str, value: float) -> None:
        with grpcclient.InferenceServerClient(budgeted.grpc) as g:
            x = grpcclient.InferInput("x", [1, N], "FP32")
            x.set_data_from_numpy(sized_models.row_of_ones(N))
            while not stop.is_set():
                try:
                    y = g.infer(model, [x]).as_numpy("y")
                    outcomes[model].append("ok" if y is not None and abs(float(y[0, 0]) - value) < 1e-3 else "WRONG")
                except InferenceServerException as exc:
                    outcomes[model].append(str(exc.status()))

    with httpclient.InferenceServerClient(budgeted.http) as c:
        for name in ("m0", "m1", "m2"):
            c.load_model(name)
        threads = [threading.Thread(target=client, args=(f"m{i}", float(i + 1))) for i in range(4)]
        for t in threads:
            t.start()
        try:
            eventually(lambda: all("ok" in outcomes[f"m{i}"] for i in range(3)), what="every loaded model answering")
            for _ in range(6):  # each round loads the one model not loaded: it must evict one of the three
                ready = {m["name"] for m in c.get_model_repository_index() if m.get("state") == "READY"}
                cold = sorted({f"m{i}" for i in range(4)} - ready)
                assert len(cold) == 1, (ready, cold)
                c.load_model(cold[0])  # evicts an idle one when it can, waits otherwise
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        evictions = sum(v for (n, _), v in scrape(budgeted.http).items() if n == "meshserve_model_evictions_total")
    assert evictions >= 6
    for model, seen in outcomes.items():
        kinds = set(seen)
        assert "ok" in kinds, (model, kinds)
        assert kinds <= {"ok", "StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE"}, (model, kinds)
