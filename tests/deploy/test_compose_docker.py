"""deploy/compose.yaml for real: the images built, the stack run by a Docker engine.

Run by scripts/compose-e2e.sh (which installs the engine, builds the base image, the wheelhouse
and the images, and sets MESHSERVE_COMPOSE_E2E=1); skipped otherwise, so it is not part of the
regular suite. The module brings the stack up once (`docker-compose up -d` with the files in
COMPOSE_FILE, as a user would) and its tests run in file order, the last two stopping it and
taking it down:

* every container becomes healthy (example-models exits 0), two gateway replicas;
* tritonclient over HTTP and gRPC, through Envoy's published ports, reaches each backend kind;
* one tenant's quota is shared by the two gateways through Redis;
* Prometheus has scraped nv_inference_* from every service;
* a trace with spans from the gateway and a service reaches the trace store (Jaeger's API);
* `docker-compose stop` drains: requests in flight when it starts all succeed, and every
  container exits 0 (none is killed at the end of its grace period);
* `docker-compose down -v` leaves no container, network or volume of the project.

Traffic goes to the project's containers only: Envoy's, Prometheus's and Jaeger's ports as
published on 127.0.0.1, and the gateways' and Envoy's own addresses on the project network.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.deploy.support import (
    ROOT,
    build_repository,
    free_port,
    http_status,
    infer_kind,
)
from tests.support.waiting import eventually

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(os.environ.get("MESHSERVE_COMPOSE_E2E") != "1",
                       reason="needs a Docker engine and the images: run scripts/compose-e2e.sh"),
]

KINDS = ("onnx", "torchscript", "sequence", "python")
UP_TIMEOUT_S = 600.0
QUOTA_BURST = 6
SLOW_WIDTH = 256
IN_FLIGHT = 4            # requests in flight when `stop` starts
SLOW_REQUEST_S = 2.0     # each of them takes about this long on its own


# ---- the stack ---------------------------------------------------------------------------

@dataclass
class Stack:
    env: dict[str, str]
    project: str
    ports: dict[str, int]
    key: str                              # the quota tenant's API key
    log_dir: Path
    stopped: bool = False
    notes: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        # COMPOSE: the compose command, "docker-compose" (v1) or "docker compose" (v2)
        res = subprocess.run([*self.env.get("COMPOSE", "docker-compose").split(), *args], cwd=ROOT, env=self.env,
                             capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            pytest.fail(f"docker-compose {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def containers(self) -> list[dict[str, Any]]:
        """`docker inspect` of every container of the project, running or not."""
        ids = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}").split()
        return json.loads(docker("inspect", *ids)) if ids else []

    def of(self, service: str) -> list[dict[str, Any]]:
        return sorted((c for c in self.containers()
                       if c["Config"]["Labels"].get("com.docker.compose.service") == service),
                      key=lambda c: c["Name"])

    def url(self, name: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.ports[name]}{path}"

    def save_logs(self) -> None:
        logs = self.compose("logs", "--no-color", "--timestamps", check=False, timeout=120)
        (self.log_dir / "compose.log").write_text(logs.stdout + logs.stderr)


def docker(*args: str, timeout: float = 60) -> str:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"docker {' '.join(args)}: {res.stderr}"
    return res.stdout


def address(container: dict[str, Any]) -> str:
    """The container's address on its (first) network."""
    nets = container["NetworkSettings"]["Networks"]
    for net in nets.values():
        if net.get("IPAddress"):
            return str(net["IPAddress"])
    # host networking (an offline override that needs it): the container shares loopback
    return "127.0.0.1"


def state(c: dict[str, Any]) -> str:
    s = c["State"]
    if s.get("Health"):
        return str(s["Health"]["Status"])
    return f"{s['Status']} ({s['ExitCode']})"


def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def poll(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    """``check()``'s first truthy result that is not a string (a string says what is missing);
    an OSError (not up yet, connection refused) counts as "not yet"."""
    def ready() -> Any:
        try:
            got = check()
        except OSError as exc:
            raise AssertionError(repr(exc)) from exc
        assert got and not isinstance(got, str), got
        return got
    return eventually(ready, timeout, what, interval=interval)


def slow_model(repo: Path) -> None:
    """`slow`: OUTPUT = tanh(... tanh(INPUT @ W) ... @ W), ITERATIONS times (an ONNX Loop), so a
    request takes as long as the client asks."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    fp32 = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array((rng.standard_normal((SLOW_WIDTH, SLOW_WIDTH)) / SLOW_WIDTH)
                                      .astype(np.float32), "W")
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("MatMul", ["x_in", "W"], ["y"]),
         helper.make_node("Tanh", ["y"], ["x_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_in", fp32, [1, SLOW_WIDTH])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_out", fp32, [1, SLOW_WIDTH])])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["scalar"], value=numpy_helper.from_array(np.array([], dtype=np.int64))),
         helper.make_node("Reshape", ["ITERATIONS", "scalar"], ["trips"]),
         helper.make_node("Constant", [], ["go"], value=numpy_helper.from_array(np.array(True))),
         helper.make_node("Loop", ["trips", "go", "INPUT"], ["OUTPUT"], body=body)], "slow",
        [helper.make_tensor_value_info("INPUT", fp32, [1, SLOW_WIDTH]),
         helper.make_tensor_value_info("ITERATIONS", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("OUTPUT", fp32, [1, SLOW_WIDTH])], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "slow" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "slow" / "1" / "model.onnx"))
    (repo / "slow" / "config.pbtxt").write_text(f"""name: "slow"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [
  {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1, {SLOW_WIDTH} ] }},
  {{ name: "ITERATIONS" data_type: TYPE_INT64 dims: [ 1 ] }}
]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1, {SLOW_WIDTH} ] }} ]
""")


def readable(path: Path) -> None:
    """The services run as uid 10001: the bind-mounted files must be readable by others."""
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("compose-e2e")
    repo = build_repository(work / "models", kinds=KINDS)
    slow_model(repo)
    key = secrets.token_hex(16)
    config = work / "config"
    config.mkdir()
    (config / "tenants.yaml").write_text(yaml.safe_dump({
        "anonymous": True,
        "tenants": [{"name": "e2e", "keys_sha256": [hashlib.sha256(key.encode()).hexdigest()],
                     "rate": 0.001, "burst": QUOTA_BURST}],
    }))
    (config / "routes.yaml").write_text("routes: []\n")
    readable(work)
    ports = {name: free_port() for name in ("http", "grpc", "prometheus", "jaeger", "grafana")}
    env = {
        **os.environ,
        "MODEL_REPOSITORY": str(repo),
        "MESHSERVE_CONFIG": str(config),
        "MESHSERVE_UID": str(os.getuid()),
        "MESHSERVE_GID": str(os.getgid()),
        "MESHSERVE_HTTP_PORT": str(ports["http"]),
        "MESHSERVE_GRPC_PORT": str(ports["grpc"]),
        "PROMETHEUS_PORT": str(ports["prometheus"]),
        "JAEGER_UI_PORT": str(ports["jaeger"]),
        "GRAFANA_PORT": str(ports["grafana"]),
    }
    env.setdefault("COMPOSE_FILE", "deploy/compose.yaml")
    env.setdefault("COMPOSE_PROJECT_NAME", "meshserve-e2e")
    log_dir = Path(os.environ.get("COMPOSE_E2E_LOGS", str(work / "logs")))
    log_dir.mkdir(parents=True, exist_ok=True)
    st = Stack(env, env["COMPOSE_PROJECT_NAME"], ports, key, log_dir)
    st.compose("down", "-v", "--remove-orphans", check=False)  # leftovers of an interrupted run
    started = time.monotonic()
    try:
        st.compose("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
        st.notes.append(f"up -d returned after {time.monotonic() - started:.0f} s")
        yield st
    finally:
        if not st.stopped:
            st.save_logs()
        st.compose("down", "-v", "--remove-orphans", check=False)


# ---- 1. up and healthy ---------------------------------------------------------------------

def test_every_container_becomes_healthy(stack: Stack) -> None:
    started = time.monotonic()

    def all_healthy() -> bool | str:
        cs = stack.containers()
        states = {c["Name"].lstrip("/"): state(c) for c in cs}
        bad = {n: s for n, s in states.items() if s == "unhealthy" or
               (s.startswith("exited") and not s.endswith("(0)"))}
        if bad:
            pytest.fail(f"containers failed: {bad}\nall: {states}")
        waiting = {n: s for n, s in states.items() if s != "healthy" and not s.startswith("exited")}
        return not waiting or str(waiting)

    poll("every container healthy", all_healthy, UP_TIMEOUT_S, interval=2)
    stack.notes.append(f"healthy {time.monotonic() - started:.0f} s after up -d returned")
    assert len(stack.of("gateway")) == 2, "deploy.replicas: 2 gateways"
    (job,) = stack.of("example-models")
    assert job["State"]["Status"] == "exited" and job["State"]["ExitCode"] == 0
    running = {c["Config"]["Labels"]["com.docker.compose.service"] for c in stack.containers()
               if c["State"]["Running"]}
    assert {"envoy", "gateway", *KINDS, "redis", "otel-collector", "jaeger", "prometheus"} <= running


# ---- 2. tritonclient through Envoy ------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_tritonclient_through_envoy_reaches_kind(stack: Stack, kind: str) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http = httpclient.InferenceServerClient(f"127.0.0.1:{stack.ports['http']}")
    assert http.is_server_ready()
    infer_kind(httpclient, http, kind)
    http.close()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{stack.ports['grpc']}")
    assert grpc.is_server_ready()
    infer_kind(grpcclient, grpc, kind)
    grpc.close()


# ---- 3. quotas shared through Redis -----------------------------------------------------------

def test_quota_is_shared_by_the_gateways_through_redis(stack: Stack) -> None:
    """burst = 6, refill ~0: six requests in all are admitted, alternating over the two
    gateway containers; then both refuse. Per-gateway buckets would admit six each."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    gateways = [address(c) for c in stack.of("gateway")]
    assert len(set(gateways)) == 2, gateways
    headers = {"authorization": f"Bearer {stack.key}"}
    clients = [httpclient.InferenceServerClient(f"{ip}:8000") for ip in gateways]
    for i in range(QUOTA_BURST):
        infer_kind(httpclient, clients[i % 2], "onnx", headers=headers)
    for gw, client in zip(gateways, clients, strict=True):
        with pytest.raises(InferenceServerException) as err:
            infer_kind(httpclient, client, "onnx", headers=headers)
        assert err.value.status() == "429" and "e2e" in str(err.value), f"gateway {gw}: {err.value}"
        client.close()
    grpc = grpcclient.InferenceServerClient(f"{gateways[0]}:8001")
    with pytest.raises(InferenceServerException) as err:
        infer_kind(grpcclient, grpc, "onnx", headers=headers)
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED", err.value
    grpc.close()
    # anonymous callers are not metered (tenants.yaml: anonymous: true)
    anon = httpclient.InferenceServerClient(f"{gateways[1]}:8000")
    infer_kind(httpclient, anon, "onnx")
    anon.close()


# ---- 4. Prometheus ----------------------------------------------------------------------------

def test_prometheus_scraped_every_service(stack: Stack) -> None:
    query = urllib.parse.quote("count by (kind, instance) (nv_inference_request_success)")

    def kinds() -> set[str] | str:
        data = get_json(stack.url("prometheus", f"/api/v1/query?query={query}"))["data"]["result"]
        got = {r["metric"].get("kind", "") for r in data}
        return got if set(KINDS) <= got else f"kinds so far: {sorted(got)}"

    poll("nv_inference_* of every service in Prometheus", kinds, 90, interval=2)
    targets = get_json(stack.url("prometheus", "/api/v1/targets"))["data"]["activeTargets"]
    up = {(t["labels"]["job"], t["labels"]["instance"]) for t in targets if t["health"] == "up"}
    for job, n in (("services", len(KINDS)), ("gateway", 2), ("envoy", 1)):
        assert len([1 for j, _ in up if j == job]) >= n, f"job {job}: {sorted(up)}"


# ---- 5. traces ----------------------------------------------------------------------------------

def test_trace_with_gateway_and_service_spans_reaches_the_store(stack: Stack) -> None:
    import tritonclient.http as httpclient

    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    http = httpclient.InferenceServerClient(f"127.0.0.1:{stack.ports['http']}")
    infer_kind(httpclient, http, "onnx", headers=headers)
    http.close()

    def services() -> set[str] | str:
        data = get_json(stack.url("jaeger", "/api/traces?service=meshserve-gateway&limit=200"))["data"]
        for t in data:
            if t["traceID"] == trace_id:
                names = {p["serviceName"] for p in t["processes"].values()}
                if {"meshserve-gateway", "meshserve-onnx"} <= names:
                    return names
                return f"trace has {sorted(names)}"
        return "trace not there yet"

    names = poll(f"trace {trace_id} in the store", services, 60, interval=1)
    stack.notes.append(f"trace {trace_id}: spans from {sorted(names)}")


# ---- 6. stop drains -----------------------------------------------------------------------------

def envoy_active(stack: Stack) -> int:
    """Requests active on Envoy's http and grpc listeners (its 9902 stats listener)."""
    (envoy,) = stack.of("envoy")
    with urllib.request.urlopen(f"http://{address(envoy)}:9902/stats/prometheus", timeout=5) as r:
        text = r.read().decode()
    return sum(int(float(m.group(1))) for m in re.finditer(
        r'^envoy_http_downstream_rq_active\{envoy_http_conn_manager_prefix="(?:http|grpc)"\} (\S+)$',
        text, re.M))


def slow_request(module: Any, client: Any, iterations: int) -> np.ndarray:
    x = module.InferInput("INPUT", [1, SLOW_WIDTH], "FP32")
    x.set_data_from_numpy(np.full((1, SLOW_WIDTH), 0.5, dtype=np.float32))
    n = module.InferInput("ITERATIONS", [1], "INT64")
    n.set_data_from_numpy(np.array([iterations], dtype=np.int64))
    out = client.infer("slow", [x, n]).as_numpy("OUTPUT")
    assert out.shape == (1, SLOW_WIDTH) and np.isfinite(out).all()
    return out


def test_stop_drains_requests_in_flight(stack: Stack) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http_url, grpc_url = f"127.0.0.1:{stack.ports['http']}", f"127.0.0.1:{stack.ports['grpc']}"
    # How many loop iterations make a request of about SLOW_REQUEST_S on this machine.
    probe = httpclient.InferenceServerClient(http_url, network_timeout=120)
    iterations, took = 1000, 0.0
    while took < 0.2:
        iterations *= 4
        t0 = time.monotonic()
        slow_request(httpclient, probe, iterations)
        took = time.monotonic() - t0
    iterations = max(1, int(iterations * SLOW_REQUEST_S / took))
    probe.close()

    results: dict[int, Any] = {}
    stop_started = threading.Event()

    def run(i: int) -> None:
        try:
            if i % 2:
                c = grpcclient.InferenceServerClient(grpc_url)
                slow_request(grpcclient, c, iterations)
            else:
                c = httpclient.InferenceServerClient(http_url, network_timeout=120)
                slow_request(httpclient, c, iterations)
            results[i] = "ok, finished after stop started" if stop_started.is_set() else "ok, before stop"
            c.close()
        except Exception as exc:  # recorded: any failure fails the test below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(IN_FLIGHT)]
    for t in threads:
        t.start()
    poll(f"{IN_FLIGHT} requests active in Envoy", lambda: envoy_active(stack) >= IN_FLIGHT or "fewer", 30, 0.05)
    stop_started.set()
    t0 = time.monotonic()
    stack.compose("stop", timeout=300)
    stop_s = time.monotonic() - t0
    stack.stopped = True
    stack.save_logs()
    for t in threads:
        t.join(120)
    stack.notes.append(f"stop: {IN_FLIGHT} requests of ~{SLOW_REQUEST_S:.0f} s ({iterations} iterations) "
                       f"in flight, `docker-compose stop` took {stop_s:.1f} s; {results}")
    failed = {i: r for i, r in results.items() if not isinstance(r, str)}
    assert len(results) == IN_FLIGHT and not failed, f"requests in flight failed during stop: {results}"
    assert all(r == "ok, finished after stop started" for r in results.values()), \
        f"the requests must still have been in flight when stop started: {results}"
    cs = stack.containers()
    not_clean = {c["Name"].lstrip("/"): (c["State"]["Status"], c["State"]["ExitCode"]) for c in cs
                 if c["State"]["Running"] or c["State"]["ExitCode"] != 0 or c["State"].get("OOMKilled")}
    assert not not_clean, f"containers that did not stop cleanly (status, exit code): {not_clean}"


# ---- 7. down -v -----------------------------------------------------------------------------------

def test_down_leaves_nothing(stack: Stack) -> None:
    stack.compose("down", "-v", "--remove-orphans")
    label = f"label=com.docker.compose.project={stack.project}"
    assert docker("ps", "-aq", "--filter", label).split() == []
    assert docker("network", "ls", "-q", "--filter", label).split() == []
    assert docker("volume", "ls", "-q", "--filter", label).split() == []
    for name in ("http", "grpc", "prometheus"):
        assert http_status(stack.url(name, "/")) is None, f"{name} port still answers after down"
    print("\n".join(["", "compose-e2e notes:", *stack.notes]))
