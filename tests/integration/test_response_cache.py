"""Triton's response cache in the gateway (--cache-config local,size=BYTES; gateway/cache.py),
through the real tritonclient over HTTP and gRPC: a repeat is a hit (the gateway's statistics and
nv_cache_* say so, the service's own statistics show no new request, the answer carries the
request's own id and the client's binary/JSON choice), a changed input byte or parameter is a
miss, a reload invalidates, a tenant without the model gets 403 / PERMISSION_DENIED and no hit,
and 32 identical concurrent misses run the model once."""
from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, service_and_gateway, start
from tests.integration.test_gateway_tenants import tenants_yaml
from tests.support import eventually, models
from tests.support import redis as support_redis
from tests.support.metrics import metric

MODULES: dict[str, Any] = {"http": httpclient, "grpc": grpcclient}
CACHE = ["--cache-config", "local,size=1048576"]


@pytest.fixture(scope="module")
def repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cached")
    shutil.copytree(model_repo / "add_sub", root / "add_sub")
    shutil.copytree(model_repo / "identity_fp32", root / "identity_fp32")  # an ensemble's uncached step
    config = root / "add_sub" / "config.pbtxt"
    config.write_text(config.read_text() + "\nresponse_cache { enable: true }\n")
    return root


@pytest.fixture(scope="module")
def stack(repo: Path) -> Iterator[tuple[Proc, Proc]]:
    with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit",
                                      "--load-model", "add_sub", "--load-model", "identity_fp32"], CACHE) as both:
        yield both


def inputs(mod: Any, a: np.ndarray, b: np.ndarray, binary: bool = True) -> list[Any]:
    kw = {"binary_data": binary} if mod is httpclient else {}
    pair = [mod.InferInput(name, list(value.shape), "FP32") for name, value in (("INPUT0", a), ("INPUT1", b))]
    pair[0].set_data_from_numpy(a, **kw)
    pair[1].set_data_from_numpy(b, **kw)
    return pair


def infer(proto: str, url: str, a: np.ndarray, b: np.ndarray, **kw: Any) -> Any:
    mod = MODULES[proto]
    binary = kw.pop("binary", True)
    outputs = kw.pop("outputs", None)
    requested = None
    if outputs is not None:
        requested = [mod.InferRequestedOutput(n, binary_data=binary) if mod is httpclient
                     else mod.InferRequestedOutput(n) for n in outputs]
    with mod.InferenceServerClient(url) as c:
        return c.infer("add_sub", inputs(mod, a, b, binary), outputs=requested, **kw)


def service_success(svc: Proc, name: str = "add_sub") -> int:
    with grpcclient.InferenceServerClient(svc.grpc) as c:
        stats = c.get_inference_statistics(name, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"]["success"].get("count", 0))


def gateway_cache(gw: Proc, name: str = "add_sub") -> tuple[int, int]:
    with httpclient.InferenceServerClient(gw.http) as c:
        stats = c.get_inference_statistics(name)["model_stats"][0]["inference_stats"]
    return int(stats["cache_hit"]["count"]), int(stats["cache_miss"]["count"])


def fresh(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((1, 16), dtype=np.float32), rng.random((1, 16), dtype=np.float32)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_repeat_is_a_hit(proto: str, stack: tuple[Proc, Proc]) -> None:
    svc, gw = stack
    url = getattr(gw, proto)
    a, b = fresh(1 if proto == "http" else 2)
    hits, misses = gateway_cache(gw)
    runs = service_success(svc)
    metric_hits = metric(gw.http, "nv_cache_num_hits_per_model", model="add_sub", version="1") \
        if hits else 0.0
    both = ["OUTPUT0", "OUTPUT1"]
    first = infer(proto, url, a, b, request_id="first", outputs=both)
    assert service_success(svc) == runs + 1
    assert gateway_cache(gw) == (hits, misses + 1)
    second = infer(proto, url, a, b, request_id="second", outputs=both, binary=False)  # JSON this time (HTTP)
    assert service_success(svc) == runs + 1  # the service saw no request
    assert gateway_cache(gw) == (hits + 1, misses + 1)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT1"), a - b)
    np.testing.assert_array_equal(first.as_numpy("OUTPUT0"), second.as_numpy("OUTPUT0"))
    response = second.get_response()
    assert (response["id"] if proto == "http" else response.id) == "second"
    if proto == "http":  # the client's JSON choice honoured on a hit
        assert "data" in response["outputs"][0] and "parameters" not in response["outputs"][0]
    assert metric(gw.http, "nv_cache_num_hits_per_model", model="add_sub", version="1") == metric_hits + 1
    assert metric(gw.http, "nv_cache_num_misses_per_model", model="add_sub", version="1") >= 1
    assert metric(gw.http, "nv_cache_hit_duration_per_model", model="add_sub", version="1") >= 0
    # a request for one output is another entry; its answer has that output only
    only = infer(proto, url, a, b, outputs=["OUTPUT1"])
    assert only.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)
    assert service_success(svc) == runs + 2
    infer(proto, url, a, b, outputs=["OUTPUT1"], binary=False)
    assert service_success(svc) == runs + 2


def requests_ok(gw: Proc, name: str = "add_sub") -> float:
    return metric(gw.http, "meshserve_gateway_requests_total", model=name, outcome="OK") or 0.0


@pytest.mark.parametrize("form", ["grpc", "http-binary", "http-json"])
def test_a_hit_at_the_front_door_honours_outputs_form_and_id(form: str, stack: tuple[Proc, Proc]) -> None:
    """A repeat answered by the front door (gateway/cache.py:FrontDoor): the requested outputs
    only, the client's binary/JSON choice, its own id (or none), counted as a hit and as an
    answered request; another output selection is another entry."""
    svc, gw = stack
    proto = "grpc" if form == "grpc" else "http"
    binary = form != "http-json"
    url = getattr(gw, proto)
    a, b = fresh({"grpc": 21, "http-binary": 22, "http-json": 23}[form])
    infer(proto, url, a, b, request_id="x1", outputs=["OUTPUT0", "OUTPUT1"], binary=binary)  # the miss
    runs = service_success(svc)
    hits, misses = gateway_cache(gw)
    ok = requests_ok(gw)
    for rid in ("x2", "a-longer-id-" + "7" * 40, ""):
        # gRPC: x2 hits in the stage (indexed at the door), the others at the door before the
        # call's Task; one of them with a deadline and compressed
        extra: dict[str, Any] = {"client_timeout": 30, "compression_algorithm": "gzip"} \
            if proto == "grpc" and rid and rid != "x2" else {}
        out = infer(proto, url, a, b, request_id=rid, outputs=["OUTPUT0", "OUTPUT1"], binary=binary, **extra)
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(out.as_numpy("OUTPUT1"), a - b)
        response = out.get_response()
        assert (response.get("id", "") if proto == "http" else response.id) == rid
        if proto == "http":
            assert all(("data" in o) != binary for o in response["outputs"])
    assert service_success(svc) == runs  # three hits: the service saw none
    assert gateway_cache(gw) == (hits + 3, misses)
    assert requests_ok(gw) == ok + 3
    # one output: another entry (a miss), then a hit with that output only
    infer(proto, url, a, b, request_id="y1", outputs=["OUTPUT1"], binary=binary)
    assert service_success(svc) == runs + 1
    only = infer(proto, url, a, b, request_id="y2", outputs=["OUTPUT1"], binary=binary)
    assert service_success(svc) == runs + 1
    assert only.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)
    assert gateway_cache(gw) == (hits + 4, misses + 1)


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_hit_counts_against_the_tenants_quota(proto: str, store: str, stack: tuple[Proc, Proc], tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    """A tenant's hits take its quota like any request: past its burst, a repeat is 429 /
    RESOURCE_EXHAUSTED (not a hit, not counted as one). With the in-process quota store a gRPC
    hit is answered before the call's Task (FrontDoor.at_once: admission never waits there);
    with Redis's (admission waits on the network) it falls back to the call's Task: the same
    answers, ids, counts and refusals either way."""
    svc, _ = stack
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml(rate=0.001, burst=3))  # acme: three requests, then none for a long time
    quota = []
    if store == "redis":
        quota = ["--quota-store", f"redis://127.0.0.1:{request.getfixturevalue('redis_server')[1]}"]
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--tenants", str(tenants), *quota])
    try:
        _wait_http_ready(gw.http)
        url = getattr(gw, proto)
        a, b = fresh(24 if proto == "http" else 25)
        acme = {"x-api-key": "acme-key"}
        ops = {"x-api-key": "ops-key"}
        runs = service_success(svc)
        for rid in ("1", "2", "3"):  # a miss, then two hits
            out = infer(proto, url, a, b, request_id=rid, headers=acme)
            assert (out.get_response()["id"] if proto == "http" else out.get_response().id) == rid
        assert service_success(svc) == runs + 1
        with httpclient.InferenceServerClient(gw.http) as c:
            stats = c.get_inference_statistics("add_sub", headers=ops)["model_stats"][0]["inference_stats"]
        assert int(stats["cache_hit"]["count"]) == 2
        with pytest.raises(InferenceServerException) as err:
            infer(proto, url, a, b, headers=acme)  # a hit in the cache, but over the quota
        assert str(err.value.status()) == ("429" if proto == "http" else "StatusCode.RESOURCE_EXHAUSTED")
        with httpclient.InferenceServerClient(gw.http) as c:
            stats = c.get_inference_statistics("add_sub", headers=ops)["model_stats"][0]["inference_stats"]
        assert int(stats["cache_hit"]["count"]) == 2
        assert metric(gw.http, "meshserve_gateway_requests_total", model="add_sub",
                      outcome="RESOURCE_EXHAUSTED") == 1
        # ops has quota; acme's entry is acme's alone (the cache by tenant: docs/security.md,
        # "Session 23: the response cache by tenant"): ops's first is a miss, its second a hit
        infer(proto, url, a, b, headers=ops)
        assert service_success(svc) == runs + 2
        infer(proto, url, a, b, headers=ops)
        assert service_success(svc) == runs + 2
    finally:
        gw.stop()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_changed_byte_or_parameter_is_a_miss(proto: str, stack: tuple[Proc, Proc]) -> None:
    svc, gw = stack
    url = getattr(gw, proto)
    a, b = fresh(3 if proto == "http" else 4)
    infer(proto, url, a, b)
    runs = service_success(svc)
    hits, misses = gateway_cache(gw)
    changed = a.copy()
    changed.view(np.uint8)[0, 5] ^= 1  # one bit of one byte
    out = infer(proto, url, changed, b)
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), changed + b)
    assert service_success(svc) == runs + 1
    infer(proto, url, a, b, parameters={"custom": 7})  # a parameter a model could read
    assert service_success(svc) == runs + 2
    assert gateway_cache(gw) == (hits, misses + 2)
    infer(proto, url, a, b)  # the original is still a hit
    assert service_success(svc) == runs + 2
    assert gateway_cache(gw) == (hits + 1, misses + 2)


def test_a_reload_invalidates(stack: tuple[Proc, Proc]) -> None:
    svc, gw = stack
    a, b = fresh(5)
    infer("grpc", gw.grpc, a, b)
    runs = service_success(svc)
    infer("grpc", gw.grpc, a, b)
    assert service_success(svc) == runs  # a hit
    with httpclient.InferenceServerClient(gw.http) as c:
        c.load_model("add_sub")  # a reload through the gateway's model control
    runs = service_success(svc)  # (a reload may restart the service's counts)
    hits, misses = gateway_cache(gw)
    out = infer("http", gw.http, a, b)
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
    assert service_success(svc) == runs + 1
    assert gateway_cache(gw) == (hits, misses + 1)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_tenant_without_the_model_gets_no_hit(proto: str, repo: Path, stack: tuple[Proc, Proc],
                                                tmp_path: Path) -> None:
    svc, _ = stack
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml(models='["scale"]'))  # acme may not call add_sub; ops may
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--tenants", str(tenants)])
    try:
        _wait_http_ready(gw.http)
        url = getattr(gw, proto)
        a, b = fresh(6)
        ops = {"x-api-key": "ops-key"}
        infer(proto, url, a, b, headers=ops)
        infer(proto, url, a, b, headers=ops)
        with httpclient.InferenceServerClient(gw.http) as c:
            stats = c.get_inference_statistics("add_sub", headers=ops)["model_stats"][0]["inference_stats"]
        assert int(stats["cache_hit"]["count"]) == 1
        with pytest.raises(InferenceServerException) as err:
            infer(proto, url, a, b, headers={"x-api-key": "acme-key"})
        assert str(err.value.status()) == ("403" if proto == "http" else "StatusCode.PERMISSION_DENIED")
        with httpclient.InferenceServerClient(gw.http) as c:
            stats = c.get_inference_statistics("add_sub", headers=ops)["model_stats"][0]["inference_stats"]
        assert int(stats["cache_hit"]["count"]) == 1
    finally:
        gw.stop()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_one_tenants_answers_are_never_another_tenants_hit(proto: str, stack: tuple[Proc, Proc],
                                                          tmp_path: Path) -> None:
    """With tenants a key is its tenant's (gateway/cache.py:tenant_scope): another tenant's identical
    request is a miss, so no tenant learns from a hit's speed what another sent. Before, ops's
    request after acme's two was answered from acme's entry (at the front door for gRPC)."""
    svc, _ = stack
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--tenants", str(tenants)])
    try:
        _wait_http_ready(gw.http)
        url = getattr(gw, proto)
        a, b = fresh(30 if proto == "http" else 31)
        runs = service_success(svc)
        for key, runs_after in [("acme-key", 1), ("acme-key", 1), ("acme-key", 1),  # a miss, two hits
                                ("ops-key", 2), ("ops-key", 2), ("acme-key", 2)]:  # ops's own miss, then its hit
            out = infer(proto, url, a, b, headers={"x-api-key": key}).as_numpy("OUTPUT0")
            assert np.allclose(out, a + b)
            assert service_success(svc) == runs + runs_after, key
        with httpclient.InferenceServerClient(gw.http) as c:
            stats = c.get_inference_statistics("add_sub", headers={"x-api-key": "ops-key"})["model_stats"][0]
        assert int(stats["inference_stats"]["cache_hit"]["count"]) == 4
        assert int(stats["inference_stats"]["cache_miss"]["count"]) == 2
    finally:
        gw.stop()


def test_one_tenants_flood_of_answers_leaves_another_tenants_in_the_cache(stack: tuple[Proc, Proc],
                                                                         tmp_path: Path) -> None:
    """A tenant holds at most its share of the cache's bytes (the tenants file's share, 0.5 here):
    ops's 400 distinct requests (~4 times the cache) evict only its own answers, and acme's repeat
    is still a hit. Before, one LRU for all: acme's answer was evicted by the flood."""
    svc, _ = stack
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc,
                "--cache-config", "local,size=65536", "--tenants", str(tenants)])
    try:
        _wait_http_ready(gw.http)
        acme, ops = {"x-api-key": "acme-key"}, {"x-api-key": "ops-key"}
        a, b = fresh(40)
        infer("grpc", gw.grpc, a, b, headers=acme)
        runs = service_success(svc)
        rng = np.random.default_rng(41)
        with grpcclient.InferenceServerClient(gw.grpc) as c:
            for _ in range(400):
                x, y = rng.random((1, 16), dtype=np.float32), rng.random((1, 16), dtype=np.float32)
                c.infer("add_sub", inputs(grpcclient, x, y), headers=ops)
        assert service_success(svc) == runs + 400
        assert np.allclose(infer("grpc", gw.grpc, a, b, headers=acme).as_numpy("OUTPUT0"), a + b)
        assert service_success(svc) == runs + 400  # acme's repeat: a hit
    finally:
        gw.stop()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_single_flight_runs_the_model_once(proto: str) -> None:
    svc = start(["--grpc-port", "0", "--delay-ms", "300"], module="tests.integration.cache_slow_service")
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE])
    try:
        _wait_http_ready(gw.http)
        mod = MODULES[proto]
        url = getattr(gw, proto)
        value = np.arange(4, dtype=np.float32).reshape(1, 4)
        barrier = threading.Barrier(32)
        answers: list[Any] = []
        errors: list[BaseException] = []

        def one(i: int) -> None:
            inp = mod.InferInput("IN", [1, 4], "FP32")
            inp.set_data_from_numpy(value)
            with mod.InferenceServerClient(url) as c:
                barrier.wait()
                try:
                    answers.append(c.infer("sleep_a", [inp], request_id=f"r{i}"))
                except BaseException as exc:  # (reported below)
                    errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(answers) == 32
        for r in answers:
            np.testing.assert_array_equal(r.as_numpy("OUT"), value)
        ids = {(r.get_response()["id"] if proto == "http" else r.get_response().id) for r in answers}
        assert ids == {f"r{i}" for i in range(32)}  # each its own id
        with httpclient.InferenceServerClient(gw.http) as c:
            stats = c.get_inference_statistics("sleep_a")["model_stats"][0]
        assert int(stats["execution_count"]) == 1  # the service ran the model once
        assert int(stats["inference_stats"]["cache_miss"]["count"]) == 1
        assert int(stats["inference_stats"]["cache_hit"]["count"]) == 31
    finally:
        gw.stop()
        svc.stop()


def test_json_inputs_and_raw_inputs_share_an_entry(stack: tuple[Proc, Proc]) -> None:
    """HTTP JSON `data` and gRPC `raw_input_contents` of the same values are one entry."""
    svc, gw = stack
    a, b = fresh(7)
    infer("http", gw.http, a, b, binary=False)
    runs = service_success(svc)
    hits, _ = gateway_cache(gw)
    out = infer("grpc", gw.grpc, a, b)
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
    assert service_success(svc) == runs
    assert gateway_cache(gw)[0] == hits + 1


# ---- the Redis cache: shared by gateways ---------------------------------------------------------

@pytest.fixture
def redis_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with support_redis.redis_server() as server:
        yield server


def test_two_gateways_share_hits_through_redis(stack: tuple[Proc, Proc],
                                               redis_server: tuple[subprocess.Popen[bytes], int]) -> None:
    svc, _ = stack
    server, port = redis_server
    flags = ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}"]
    gateways = [start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *flags])
                for _ in range(2)]
    try:
        for g in gateways:
            _wait_http_ready(g.http)
        one, two = gateways
        a, b = fresh(8)
        infer("grpc", one.grpc, a, b)  # a miss at one, kept in Redis
        runs = service_success(svc)
        out = infer("http", two.http, a, b, request_id="at-two")
        np.testing.assert_array_equal(out.as_numpy("OUTPUT1"), a - b)
        assert out.get_response()["id"] == "at-two"
        assert service_success(svc) == runs  # a hit at the other gateway
        assert gateway_cache(two)[0] == 1
        with httpclient.InferenceServerClient(one.http) as c:
            c.load_model("add_sub")  # a reload through one gateway: a new generation for both
        runs = service_success(svc)
        infer("grpc", two.grpc, a, b)
        assert service_success(svc) == runs + 1
        infer("grpc", one.grpc, a, b)  # the new generation's answer, kept by two
        assert service_success(svc) == runs + 1

        # Redis killed mid-run: hits become misses, no request fails
        failures: list[BaseException] = []
        stop = threading.Event()

        def loop(g: Proc, proto: str) -> None:
            while not stop.is_set():
                try:
                    np.testing.assert_array_equal(infer(proto, getattr(g, proto), a, b).as_numpy("OUTPUT0"), a + b)
                except BaseException as exc:  # (asserted below)
                    failures.append(exc)

        threads = [threading.Thread(target=loop, args=(g, p)) for g in gateways for p in ("http", "grpc")]
        for t in threads:
            t.start()
        try:
            eventually(lambda: gateway_cache(one)[0] >= 5 and gateway_cache(two)[0] >= 5, what="hits from Redis")
            runs = service_success(svc)
            server.kill()
            server.wait(10)
            eventually(lambda: service_success(svc) >= runs + 20, what="misses run the model after the kill")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not failures, failures[:3]
    finally:
        for g in gateways:
            g.stop()


def test_an_ensemble_is_cached_as_a_whole(stack: tuple[Proc, Proc], tmp_path: Path) -> None:
    """An ensemble whose config enables the cache (run by the gateway): a repeat runs no step;
    a reload of a step model through the gateway drops the ensemble's answers too."""
    svc, _ = stack
    config = models.ensemble_config("doubled", {"X": 16}, {"S": 16}, [
        models.step("add_sub", {"INPUT0": "X", "INPUT1": "X"}, {"OUTPUT0": "S"})])
    (tmp_path / "doubled" / "1").mkdir(parents=True)
    (tmp_path / "doubled" / "config.pbtxt").write_text(config + "response_cache { enable: true }\n")
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--repository", str(tmp_path)])
    try:
        _wait_http_ready(gw.http)
        x = fresh(9)[0]

        def doubled() -> np.ndarray:
            inp = grpcclient.InferInput("X", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            with grpcclient.InferenceServerClient(gw.grpc) as c:
                return c.infer("doubled", [inp]).as_numpy("S")

        np.testing.assert_array_equal(doubled(), x + x)
        runs = service_success(svc)
        np.testing.assert_array_equal(doubled(), x + x)
        assert service_success(svc) == runs  # no step ran
        assert gateway_cache(gw, "doubled") == (1, 1)
        with httpclient.InferenceServerClient(gw.http) as c:
            c.load_model("add_sub")
        runs = service_success(svc)
        np.testing.assert_array_equal(doubled(), x + x)
        assert service_success(svc) == runs + 1
        assert gateway_cache(gw, "doubled") == (1, 2)
    finally:
        gw.stop()


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_an_ensemble_step_is_cached_per_step(proto: str, stack: tuple[Proc, Proc], tmp_path: Path) -> None:
    """An ensemble whose own config does not enable the cache, with a step whose model's does
    (add_sub) and one whose model's does not (identity_fp32): a repeat answers the add_sub step
    from the cache (its service sees no request, the gateway's add_sub statistics count the hit)
    and runs the other step."""
    svc, _ = stack
    config = models.ensemble_config("summed", {"X": 16}, {"Y": 16}, [
        models.step("add_sub", {"INPUT0": "X", "INPUT1": "X"}, {"OUTPUT0": "S"}),
        models.step("identity_fp32", {"INPUT0": "S"}, {"OUTPUT0": "Y"})])
    (tmp_path / "summed" / "1").mkdir(parents=True)
    (tmp_path / "summed" / "config.pbtxt").write_text(config)
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--repository", str(tmp_path)])
    try:
        _wait_http_ready(gw.http)
        x = fresh(11 if proto == "http" else 12)[0]
        mod = MODULES[proto]

        def summed(request_id: str) -> Any:
            inp = mod.InferInput("X", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            with mod.InferenceServerClient(getattr(gw, proto)) as c:
                return c.infer("summed", [inp], request_id=request_id)

        first = summed("one")
        np.testing.assert_array_equal(first.as_numpy("Y"), x + x)
        runs, identities = service_success(svc), service_success(svc, "identity_fp32")
        assert gateway_cache(gw) == (0, 1)
        second = summed("two")
        np.testing.assert_array_equal(second.as_numpy("Y"), x + x)
        response = second.get_response()
        assert (response["id"] if proto == "http" else response.id) == "two"
        assert service_success(svc) == runs  # the cached step's service saw no request
        assert service_success(svc, "identity_fp32") == identities + 1  # the other step ran
        assert gateway_cache(gw) == (1, 1)
        assert metric(gw.http, "nv_cache_num_hits_per_model", model="add_sub", version="1") == 1
        with httpclient.InferenceServerClient(gw.http) as c:  # the ensemble itself: two requests, no cache
            ens = c.get_inference_statistics("summed")["model_stats"][0]["inference_stats"]
        assert int(ens["success"]["count"]) == 2 and int(ens["cache_hit"].get("count", 0)) == 0
        # a direct client request for the step model with the same inputs shares the entry
        out = infer(proto, getattr(gw, proto), x, x, outputs=["OUTPUT0"])
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), x + x)
        assert service_success(svc) == runs
        assert gateway_cache(gw) == (2, 1)
    finally:
        gw.stop()


def test_a_hit_has_a_cache_span(stack: tuple[Proc, Proc]) -> None:
    """With tracing (OTLP to a real receiver), a hit's trace has a `gateway.cache` span marked
    `meshserve.cache_hit` and no upstream call."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from tests.integration.test_tracing import Receiver, _otel_env, _traceparent

    svc, _ = stack
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE],
               env=_otel_env(f"http://127.0.0.1:{port}"))
    try:
        _wait_http_ready(gw.http)
        a, b = fresh(10)
        traces = []
        for _ in range(2):
            tp, trace_id, _ = _traceparent()
            infer("grpc", gw.grpc, a, b, headers={"traceparent": tp})
            traces.append(trace_id)
        spans = receiver.wait(lambda ss: {"gateway.request", "gateway.cache"} <= {s.name for s in ss
                                                                                   if s.trace_id == traces[1]}
                              and "gateway.upstream" in {s.name for s in ss if s.trace_id == traces[0]})
        hit = {s.name: s for s in spans if s.trace_id == traces[1]}
        assert hit["gateway.cache"].attributes["meshserve.cache_hit"] is True
        assert hit["gateway.cache"].parent == hit["gateway.request"].span_id
        assert "gateway.upstream" not in hit
        assert "gateway.upstream" in {s.name for s in spans if s.trace_id == traces[0]}
    finally:
        gw.stop()
        server.stop(0)


def test_workers_share_the_local_cache_and_its_counts(stack: tuple[Proc, Proc]) -> None:
    """`--workers 2` with a local cache: one file both workers map (gateway/shared_cache.py).
    A request repeated on fresh connections (the kernel spreads them over both workers) runs
    the model once; the statistics and nv_cache_* read the same totals whichever worker answers
    (no worker label on nv_cache_*); a reload through one worker is a miss on every worker."""
    from tests.integration.test_gateway_workers import served, until_both_served
    from tests.support.metrics import scrape

    svc, _ = stack
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--workers", "2"])
    try:
        _wait_http_ready(gw.http)
        a, b = fresh(13)
        runs = service_success(svc)
        sent = [0]

        def send(i: int) -> None:
            proto = ("http", "grpc")[i % 2]
            out = infer(proto, getattr(gw, proto), a, b, request_id=f"r{i}")
            np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
            sent[0] += 1

        until_both_served(gw, send)
        assert service_success(svc) == runs + 1  # one miss, every other request a hit on either worker
        n = sent[0]
        # the totals, whichever worker answers (each call below is a new connection)
        assert {gateway_cache(gw) for _ in range(8)} == {(n - 1, 1)}
        for _ in range(4):
            samples = scrape(gw.http)
            cache = {labels: v for (name, labels), v in samples.items() if name == "nv_cache_num_hits_per_model"}
            assert cache == {frozenset({("model", "add_sub"), ("version", "1")}): n - 1}
        assert sum(served(gw).values()) >= n
        with httpclient.InferenceServerClient(gw.http) as c:
            c.load_model("add_sub")  # through one worker
        runs = service_success(svc)
        for i in range(8):
            send(100 + i)
        assert service_success(svc) == runs + 1  # a miss once, on whichever worker came first
        assert {gateway_cache(gw) for _ in range(4)} == {(n - 1 + 7, 2)}
    finally:
        gw.stop()


def test_workers_with_tenants_keep_each_tenants_answers_apart(stack: tuple[Proc, Proc], tmp_path: Path,
                                                             redis_server: tuple[Any, int]) -> None:
    """`--workers 2` with tenants: the workers' store holds 16-byte keys, so a key by tenant is a
    digest of the tenant and the request there (gateway/cache.py:CacheStage._scoped): distinct
    requests get their own answers, a repeat is a hit, and another tenant's identical request
    is a miss."""
    svc, _ = stack
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(tenants_yaml())
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc, *CACHE,
                "--workers", "2", "--tenants", str(tenants), "--quota-store", f"redis://127.0.0.1:{redis_server[1]}"])
    try:
        _wait_http_ready(gw.http)
        pairs = [fresh(50 + i) for i in range(12)]
        runs = service_success(svc)
        for key, ran in [("acme-key", 12), ("acme-key", 12), ("ops-key", 24)]:
            for i, (a, b) in enumerate(pairs):
                proto = ("http", "grpc")[i % 2]
                out = infer(proto, getattr(gw, proto), a, b, headers={"x-api-key": key})
                np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + b)
            assert service_success(svc) == runs + ran, key
    finally:
        gw.stop()


@pytest.mark.parametrize(("workers", "size", "said"), [("2", "1000", "at least 1048576 bytes"),
                                                       ("17", "1048576", "at most 16 workers")])
def test_a_shared_cache_too_small_or_too_shared_is_refused_at_start(workers: str, size: str, said: str) -> None:
    from tests.integration.test_gateway_workers import run_gateway

    done = run_gateway("--workers", workers, "--upstream", "127.0.0.1:1", "--cache-config", f"local,size={size}")
    assert done.returncode != 0 and said in done.stderr, done.stderr
    assert "MESHSERVE_READY" not in done.stdout
