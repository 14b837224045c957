"""Tenants and quotas through the real tritonclient: keys, allowed models, 429 + Retry-After,
admin-only model control, reload without restart, and one rate shared by two gateways via Redis."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gateway.auth import hash_key
from tests.adversarial.support import add_sub_inputs
from tests.conftest import Proc, _wait_http_ready, start
from tests.support import eventually, eventually_async
from tests.support.redis import redis_server

MODULES = {"http": httpclient, "grpc": grpcclient}
STATUS = {
    "http": {"401": "401", "403": "403", "429": "429"},
    "grpc": {"401": "StatusCode.UNAUTHENTICATED", "403": "StatusCode.PERMISSION_DENIED",
             "429": "StatusCode.RESOURCE_EXHAUSTED"},
}


def tenants_yaml(rate: float = 1000, burst: float = 1000, models: str = '["add_sub", "scale"]') -> str:
    return f"""
tenants:
  - name: acme
    keys_sha256: ["{hash_key('acme-key')}"]
    rate: {rate}
    burst: {burst}
    models: {models}
  - name: ops
    keys_sha256: ["{hash_key('ops-key')}"]
    rate: 1000
    burst: 1000
    admin: true
"""


def add_sub(proto: str, url: str, headers: dict[str, str] | None = None) -> np.ndarray:
    m = MODULES[proto]
    with m.InferenceServerClient(url) as c:
        return c.infer("add_sub", add_sub_inputs(m), headers=headers).as_numpy("OUTPUT0")


def small_mlp(proto: str, url: str, headers: dict[str, str]) -> None:
    m = MODULES[proto]
    with m.InferenceServerClient(url) as c:
        cfg = c.get_model_config("small_mlp", headers={"x-api-key": "ops-key"})  # reading a config needs a key
        cfg = cfg if proto == "http" else {"input": [{"name": i.name, "dims": list(i.dims)}
                                                     for i in cfg.config.input]}
        inputs = []
        for i in cfg["input"]:
            shape = [1, *[int(d) for d in i["dims"]]]
            inp = m.InferInput(i["name"], shape, "FP32")
            inp.set_data_from_numpy(np.zeros(shape, np.float32))
            inputs.append(inp)
        c.infer("small_mlp", inputs, headers=headers)


def expect(proto: str, status: str, fn, *args) -> str:
    with pytest.raises(InferenceServerException) as err:
        fn(*args)
    assert str(err.value.status()) == STATUS[proto][status], err.value
    return err.value.message() or ""


@pytest.fixture(scope="module")
def service(model_repo: Path) -> Iterator[Proc]:
    p = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0"])
    yield p
    p.stop()


def gateway(service: Proc, tenants: Path, *extra: str) -> Proc:
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
               "--tenants", str(tenants), *extra])
    _wait_http_ready(g.http)
    return g


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_keys_models_and_quota(proto: str, service: Proc, tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml(rate=0.2, burst=2))
    g = gateway(service, path)
    url = getattr(g, proto)
    try:
        assert "API key" in expect(proto, "401", add_sub, proto, url, None)
        assert "unknown" in expect(proto, "401", add_sub, proto, url, {"x-api-key": "wrong"})
        assert add_sub(proto, url, {"authorization": "Bearer acme-key"}).tolist() == [[2.0] * 16]
        msg = expect(proto, "403", small_mlp, proto, url, {"x-api-key": "acme-key"})
        assert "acme" in msg and "small_mlp" in msg
        assert add_sub(proto, url, {"x-api-key": "acme-key"}).shape == (1, 16)  # burst of 2 used up
        assert "rate limit" in expect(proto, "429", add_sub, proto, url, {"x-api-key": "acme-key"})
        small_mlp(proto, url, {"x-api-key": "ops-key"})  # other tenants have their own bucket
    finally:
        g.stop()


def test_http_429_has_retry_after_and_reload(service: Proc, tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml(rate=0.25, burst=1))
    g = gateway(service, path)
    body = (b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":' + str([1.0] * 16).encode()
            + b'},{"name":"INPUT1","shape":[1,16],"datatype":"FP32","data":' + str([1.0] * 16).encode() + b"}]}")

    def post(path_: str, key: str, data: bytes = body) -> tuple[int, dict[str, str]]:
        req = urllib.request.Request(f"http://{g.http}{path_}", data=data, method="POST",
                                     headers={"x-api-key": key})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers)

    try:
        assert post("/v2/models/add_sub/infer", "acme-key")[0] == 200
        status, headers = post("/v2/models/add_sub/infer", "acme-key")
        assert status == 429 and 1 <= int(headers["Retry-After"]) <= 4, headers
        with urllib.request.urlopen(f"http://{g.http}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'meshserve_gateway_quota_rejections_total{tenant="acme",reason="rate"} 1' in text, text[-2000:]
        # model control needs an admin key (HTTP and gRPC)
        assert post("/v2/repository/models/scale/load", "acme-key", b"{}")[0] == 403
        # the admin passes the gateway; the service then answers per its --model-control-mode
        assert post("/v2/repository/models/scale/load", "ops-key", b"{}")[0] not in (401, 403)
        with grpcclient.InferenceServerClient(g.grpc) as c:
            with pytest.raises(InferenceServerException) as err:
                c.unload_model("scale", headers={"x-api-key": "acme-key"})
            assert str(err.value.status()) == "StatusCode.PERMISSION_DENIED"
            assert "admin" in (err.value.message() or "")
            with pytest.raises(InferenceServerException) as err:
                c.load_model("scale", headers={"authorization": "Bearer wrong"})
            assert str(err.value.status()) == "StatusCode.UNAUTHENTICATED"
        # edit the file: acme gets a bigger bucket without a restart
        path.write_text(tenants_yaml(rate=1000, burst=1000))
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        eventually(lambda: post("/v2/models/add_sub/infer", "acme-key")[0] == 200, timeout=10, interval=0.3,
                   what="tenants.yaml reloaded")
        assert all(post("/v2/models/add_sub/infer", "acme-key")[0] == 200 for _ in range(5))
    finally:
        g.stop()


# ---- two gateways, one Redis -------------------------------------------------------------------

@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as (_, port):
        yield f"redis://127.0.0.1:{port}/0"


def test_two_gateways_share_one_rate_through_redis(service: Proc, tmp_path: Path, redis_url: str) -> None:
    rate, burst, seconds = 20.0, 10.0, 10.0
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml(rate=rate, burst=burst))
    gateways = [gateway(service, path, "--quota-store", redis_url) for _ in range(2)]
    accepted = [0]
    refused = [0]
    other = []
    lock = threading.Lock()
    # 3x the rate in total, spread over both gateways and both protocols
    senders = [(proto, getattr(g, proto)) for g in gateways for proto in ("http", "grpc")]
    interval = len(senders) / (3 * rate)
    t0 = time.monotonic() + 0.5
    end = t0 + seconds

    def send(proto: str, url: str, offset: float) -> None:
        m = MODULES[proto]
        inputs = add_sub_inputs(m)
        with m.InferenceServerClient(url) as c:
            k = 0
            while True:
                at = t0 + offset + k * interval
                if at >= end:
                    return
                time.sleep(max(0.0, at - time.monotonic()))  # the point: the senders' pacing
                k += 1
                try:
                    c.infer("add_sub", inputs, headers={"x-api-key": "acme-key"})
                    with lock:
                        accepted[0] += 1
                except InferenceServerException as e:
                    with lock:
                        if str(e.status()) in ("429", "StatusCode.RESOURCE_EXHAUSTED"):
                            refused[0] += 1
                        else:
                            other.append(e)

    try:
        threads = [threading.Thread(target=send, args=(p, u, i * interval / len(senders)))
                   for i, (p, u) in enumerate(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not other, other[:3]
        expected = rate * seconds + burst
        offered = accepted[0] + refused[0]
        print(f"redis quota: offered {offered}, accepted {accepted[0]}, expected {expected}")
        assert offered >= 2.5 * rate * seconds, (accepted, refused)
        assert abs(accepted[0] - expected) <= 0.1 * rate * seconds, (accepted, refused, expected)
    finally:
        for g in gateways:
            g.stop()


async def test_redis_store_concurrency_and_rate(redis_url: str) -> None:
    from gateway.quotas.bucket import Limits
    from gateway.quotas.redis import RedisQuotaStore

    a, b = RedisQuotaStore(redis_url), RedisQuotaStore(redis_url)  # two gateways
    try:
        limits = Limits(rate=1000, burst=1000, max_concurrency=2)
        d1, t1 = await a.acquire("t", limits, lease_s=30)
        d2, _ = await b.acquire("t", limits, lease_s=30)
        d3, _ = await a.acquire("t", limits, lease_s=30)
        assert d1.allowed and d2.allowed and not d3.allowed and d3.reason == "concurrency"
        await a.release("t", t1)
        d4, _ = await b.acquire("t", limits, lease_s=30)
        assert d4.allowed
        # an expired lease (a gateway died mid-request) frees its slot
        await a.acquire("u", Limits(rate=1000, burst=1000, max_concurrency=1), lease_s=0.2)
        d5, _ = await b.acquire("u", Limits(rate=1000, burst=1000, max_concurrency=1), lease_s=0.2)
        assert not d5.allowed
        async def lease_expired() -> bool:  # a refusal takes no slot: the first allowed try holds it
            return (await b.acquire("u", Limits(rate=1000, burst=1000, max_concurrency=1), lease_s=0.2))[0].allowed

        await eventually_async(lease_expired, 10, "the 0.2 s lease to run out", interval=0.02)
        slow = Limits(rate=2, burst=1)
        assert (await a.acquire("v", slow))[0].allowed
        refused, _ = await b.acquire("v", slow)
        assert not refused.allowed and refused.reason == "rate" and 0 < refused.retry_after_s <= 0.5
    finally:
        await a.close()
        await b.close()
