"""Envoy for real: deploy/envoy.yaml on loopback in front of two gateway processes.

The routes, timeouts, buffer limits, health checks and load-balancing policy are the file's
own; only listener ports and cluster addresses are rewritten to the test's processes (the
compose names `gateway` and `otel-collector` do not resolve here). Requests go through
Envoy with the real tritonclient, over HTTP and gRPC, including a 32 MiB binary tensor and
a gRPC stream.
"""
from __future__ import annotations

import copy
import queue
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.deploy.support import (
    BIG_WIDTH,
    ENVOY_FILE,
    Proc,
    as_list,
    build_repository,
    envoy_binary,
    free_port,
    http_status,
    load_compose,
    meshserve_argv,
    spawn,
    stop_all,
    wait_ready,
)
from tests.support import eventually

GATEWAYS = 2


@dataclass
class Front:
    """Envoy's loopback ports, and the gateways behind it as (http, grpc) ports."""

    http: int
    grpc: int
    metrics: int
    admin: int
    gateways: list[tuple[int, int]]
    envoy: Proc

    def admin_get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=5) as r:
            return r.read().decode()

    def host_stat(self, cluster: str, port: int, stat: str) -> int:
        m = re.search(rf"^{cluster}::127\.0\.0\.1:{port}::{stat}::(\d+)$", self.admin_get("/clusters"), re.M)
        return int(m.group(1)) if m else -1


def _endpoint(port: int, health_port: int | None = None) -> dict[str, Any]:
    ep: dict[str, Any] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}
    if health_port is not None:
        ep["health_check_config"] = {"port_value": health_port}
    return {"endpoint": ep}


def loopback_config(src: dict[str, Any], *, ports: dict[str, int], admin: int,
                    gateways: list[tuple[int, int]], otel: int) -> dict[str, Any]:
    """deploy/envoy.yaml with loopback listeners and the test's gateways as cluster members."""
    cfg = copy.deepcopy(src)
    cfg["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin}
    for listener in cfg["static_resources"]["listeners"]:
        listener["address"]["socket_address"] = {"address": "127.0.0.1",
                                                 "port_value": ports[listener["name"]]}
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}

    def members(name: str) -> list[dict[str, Any]]:
        (group,) = clusters[name]["load_assignment"]["endpoints"]
        return list(group["lb_endpoints"])

    # Check what is being replaced, so that a changed envoy.yaml cannot make this a no-op.
    (gw_http,) = members("gateway_http")
    (gw_grpc,) = members("gateway_grpc")
    assert gw_http["endpoint"]["address"]["socket_address"]["address"] == "gateway"
    assert gw_grpc["endpoint"]["address"]["socket_address"]["address"] == "gateway"
    assert gw_grpc["endpoint"]["health_check_config"]["port_value"] == \
        gw_http["endpoint"]["address"]["socket_address"]["port_value"]
    clusters["gateway_http"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [_endpoint(h) for h, _ in gateways]}]
    clusters["gateway_grpc"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [_endpoint(g, health_port=h) for h, g in gateways]}]
    clusters["otel_collector"]["load_assignment"]["endpoints"] = [{"lb_endpoints": [_endpoint(otel)]}]
    clusters["envoy_admin"]["load_assignment"]["endpoints"] = [{"lb_endpoints": [_endpoint(admin)]}]
    return cfg


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    envoy_exe = envoy_binary()
    work = tmp_path_factory.mktemp("envoy_e2e")
    repo = build_repository(work / "models", big=True)
    procs: list[Proc] = []
    try:
        svc_grpc, svc_http = free_port(), free_port()
        service = spawn("onnx", meshserve_argv(
            ["service", "onnx", "--repository", str(repo), "--host", "127.0.0.1",
             "--grpc-port", str(svc_grpc), "--http-port", str(svc_http)]), work)
        procs.append(service)
        wait_ready([(service, f"http://127.0.0.1:{svc_http}/v2/health/ready")])
        gateways: list[tuple[int, int]] = []
        waits = []
        for i in range(GATEWAYS):
            h, g = free_port(), free_port()
            gw = spawn(f"gateway{i}", meshserve_argv(
                ["gateway", "--host", "127.0.0.1", "--http-port", str(h), "--grpc-port", str(g),
                 "--upstream", f"127.0.0.1:{svc_grpc}"]), work)
            procs.append(gw)
            gateways.append((h, g))
            waits.append((gw, f"http://127.0.0.1:{h}/v2/health/ready"))
        wait_ready(waits)

        ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
        admin, closed = free_port(), free_port()  # nothing listens on `closed`: no collector here
        cfg = loopback_config(yaml.safe_load(ENVOY_FILE.read_text()), ports=ports, admin=admin,
                              gateways=gateways, otel=closed)
        cfg_path = work / "envoy.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        envoy = spawn("envoy", [envoy_exe, "-c", str(cfg_path), "--disable-hot-restart",
                                "--concurrency", "2", "--log-level", "warning"], work)
        procs.append(envoy)
        f = Front(ports["http"], ports["grpc"], ports["metrics"], admin, gateways, envoy)
        # Ready = Envoy's own /ready, then every gateway member passed its health check.
        def all_healthy() -> bool:
            if not envoy.alive():
                pytest.fail(f"envoy exited\n{envoy.describe()}")
            try:
                clusters = f.admin_get("/clusters")
            except OSError:
                return False
            return len(re.findall(r"^gateway_(?:http|grpc)::[^:]+:\d+::health_flags::healthy$",
                                  clusters, re.M)) == 2 * GATEWAYS

        try:
            eventually(all_healthy, 60, interval=0.2)
        except AssertionError:
            pytest.fail("Envoy never saw healthy gateways\n" + "\n".join(p.describe() for p in procs))
        yield f
    finally:
        stop_all(list(reversed(procs)))


def _add_sub_inputs(module: Any, n: int = 2) -> tuple[list[Any], np.ndarray, np.ndarray]:
    a = np.arange(n * 16, dtype=np.float32).reshape(n, 16)
    b = np.full((n, 16), 2.0, dtype=np.float32)
    inputs = [module.InferInput("INPUT0", [n, 16], "FP32"), module.InferInput("INPUT1", [n, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def test_http_through_envoy(front: Front) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{front.http}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("add_sub")
    inputs, a, b = _add_sub_inputs(httpclient)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    client.close()


def test_grpc_through_envoy_balances_per_request(front: Front) -> None:
    import tritonclient.grpc as grpcclient

    before = [front.host_stat("gateway_grpc", g, "rq_total") for _, g in front.gateways]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{front.grpc}")  # one HTTP/2 connection
    assert client.is_server_ready()
    meta = client.get_model_metadata("add_sub")
    assert meta.name == "add_sub"
    inputs, a, b = _add_sub_inputs(grpcclient)
    for _ in range(20):
        result = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    client.close()
    after = [front.host_stat("gateway_grpc", g, "rq_total") for _, g in front.gateways]
    served = [x - y for x, y in zip(after, before, strict=True)]
    assert sum(served) >= 22, served
    assert all(n > 0 for n in served), f"one client connection, yet one gateway got everything: {served}"


def test_large_binary_tensor_http(front: Front) -> None:
    import tritonclient.http as httpclient

    data = np.random.default_rng(1).standard_normal((8, BIG_WIDTH), dtype=np.float32)  # 32 MiB
    client = httpclient.InferenceServerClient(f"127.0.0.1:{front.http}", connection_timeout=60,
                                              network_timeout=120)
    inp = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data, binary_data=True)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    result = client.infer("big_identity", [inp], outputs=[out])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    client.close()


def test_large_binary_tensor_grpc(front: Front) -> None:
    import tritonclient.grpc as grpcclient

    data = np.random.default_rng(2).standard_normal((8, BIG_WIDTH), dtype=np.float32)  # 32 MiB
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{front.grpc}")
    inp = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    result = client.infer("big_identity", [inp], client_timeout=60)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    client.close()


def test_grpc_stream_through_envoy(front: Front) -> None:
    import tritonclient.grpc as grpcclient

    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{front.grpc}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        expected = {}
        for i in range(5):
            inputs, a, b = _add_sub_inputs(grpcclient, n=1)
            a = a + i
            inputs[0].set_data_from_numpy(a)
            expected[str(i)] = a + b
            client.async_stream_infer("add_sub", inputs, request_id=str(i))
        for _ in range(len(expected)):
            result, error = results.get(timeout=30)
            assert error is None, error
            rid = result.get_response().id
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected.pop(rid))
        assert not expected
    finally:
        client.stop_stream()
        client.close()


def test_metrics_listener_exposes_stats_not_admin(front: Front) -> None:
    base = f"http://127.0.0.1:{front.metrics}"
    with urllib.request.urlopen(f"{base}/stats/prometheus", timeout=5) as r:
        body = r.read().decode()
    assert "envoy_cluster_upstream_rq" in body and 'envoy_cluster_name="gateway_grpc"' in body
    assert http_status(f"{base}/ready") == 200
    for path in ("/clusters", "/config_dump", "/quitquitquit"):
        assert http_status(f"{base}{path}") == 404, path


def test_compose_envoy_healthcheck_command(front: Front) -> None:
    """The compose health check (bash + /dev/tcp to the admin /ready) works against Envoy."""
    test = as_list(load_compose()["services"]["envoy"]["healthcheck"]["test"])
    assert test[0] == "CMD"
    argv = [a.replace("9901", str(front.admin)) for a in test[1:]]
    assert subprocess.run(argv, timeout=10).returncode == 0
    closed = free_port()
    argv = [a.replace("9901", str(closed)) for a in test[1:]]
    assert subprocess.run(argv, timeout=10, stderr=subprocess.DEVNULL).returncode != 0


def test_envoy_log_has_no_errors(front: Front) -> None:
    log = Path(front.envoy.log_path).read_text(errors="replace")
    bad = [ln for ln in log.splitlines() if re.search(r"\]\[(error|critical)\]\[", ln)]
    assert not bad, "\n".join(bad[:20])
