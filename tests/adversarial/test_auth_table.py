"""The access table, walked: every HTTP route and gRPC method of a real gateway with tenants (in
front of a real ONNX service) × {no key, wrong key, tenant allowed, other tenant, admin}, with
the exact status of each cell, through tritonclient (raw requests where it cannot say it).

The table itself (meshserve.server.access) must cover every gRPC method of the service
descriptors and every route the HTTP front end dispatches: a fuzz over route-shaped paths
without a key finds nothing but the open routes answering, so a route added without a rule
fails closed here."""
from __future__ import annotations

import http.client
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from gateway.auth import hash_key
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import grpc_service_pb2_grpc as pb_grpc
from meshserve._proto import health_pb2, health_pb2_grpc
from meshserve.protocol import hop
from meshserve.server import access
from meshserve.server.access import Op, Rule
from meshserve.server.grpc_frontend import register
from meshserve.server.h2 import H2GrpcServer
from meshserve.server.health import HealthState
from meshserve.server.http_frontend import HttpFrontend
from tests.adversarial.support import add_sub_inputs, raw_http
from tests.conftest import Proc, _wait_http_ready, service_and_gateway, start

ALLOWED, OTHER = "add_sub", "scale"  # the model every call names; the other tenant's model
CONTROLLED = "fixed_add"  # loaded and unloaded by the repository-control cells
SHM_KEY = f"/mstest-auth-{os.getpid()}"  # a shared-memory object the register cells register (and unregister)
WHO: dict[str, dict[str, str]] = {
    "no key": {},
    "wrong key": {"x-api-key": "not-a-key"},
    "tenant": {"authorization": "Bearer acme-key"},  # may use add_sub
    "other tenant": {"x-api-key": "other-key"},  # may use scale only
    "admin": {"x-api-key": "ops-key"},
}
TENANTS = f"""
tenants:
  - name: acme
    keys_sha256: ["{hash_key('acme-key')}"]
    rate: 100000
    burst: 100000
    models: ["{ALLOWED}"]
  - name: other
    keys_sha256: ["{hash_key('other-key')}"]
    rate: 100000
    burst: 100000
    models: ["{OTHER}"]
  - name: ops
    keys_sha256: ["{hash_key('ops-key')}"]
    rate: 100000
    burst: 100000
    admin: true
"""
GRPC_CODES = {"OK": 200, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "UNIMPLEMENTED": 501,
              "INVALID_ARGUMENT": 400, "NOT_FOUND": 404}


def expected(rule: Rule, who: str, success: int = 200) -> int:
    """The status the table promises ``who`` for an op with ``rule`` naming model add_sub."""
    if rule is Rule.OPEN:
        return 200
    if who in ("no key", "wrong key"):
        return 401
    if rule is Rule.ADMIN:
        return success if who == "admin" else 403
    if rule in (Rule.MODEL, Rule.INFER) and who == "other tenant":
        return 403
    return success


@dataclass
class Mesh:
    service: Proc
    gateway: Proc
    repo: Path


@pytest.fixture(scope="module")
def mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("auth")
    repo = root / "repo"
    for name in (ALLOWED, OTHER, CONTROLLED, "small_mlp"):
        shutil.copytree(model_repo / name, repo / name)
    tenants = root / "tenants.yaml"
    tenants.write_text(TENANTS)
    region = shm.create_shared_memory_region("auth", SHM_KEY, 64, create_only=True)
    try:
        with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit",
                                          "--load-model", "*"],
                                 ["--tenants", str(tenants), "--discovery-interval", "0.5",
                                  "--lazy-model", "small_mlp"]) as (service, gateway):  # (a placement to show)
            yield Mesh(service, gateway, repo)
    finally:
        shm.destroy_shared_memory_region(region)


# ---- calls ---------------------------------------------------------------------------------------

Call = Callable[[Any, dict[str, str]], Any]  # (client, headers) -> result


@dataclass(frozen=True)
class HttpCase:
    method: str
    route: str  # the template in access.HTTP_ROUTES
    op: Op
    call: Callable[[str, dict[str, str]], tuple[int, Any]]  # (host:port, headers) -> (status, result)
    success: int = 200  # the status of an allowed call


def via_client(fn: Callable[[httpclient.InferenceServerClient, dict[str, str]], Any]
               ) -> Callable[[str, dict[str, str]], tuple[int, Any]]:
    def run(url: str, headers: dict[str, str]) -> tuple[int, Any]:
        with httpclient.InferenceServerClient(url) as c:
            try:
                return 200, fn(c, headers)
            except InferenceServerException as exc:
                return int(exc.status()), exc.message()
    return run


def via_raw(method: str, path: str, body: bytes = b"") -> Callable[[str, dict[str, str]], tuple[int, Any]]:
    def run(url: str, headers: dict[str, str]) -> tuple[int, Any]:
        status, data = raw_http(url, method, path, headers, body)
        return status, data
    return run


GENERATE_BODY = json.dumps({"INPUT0": [1.0] * 16, "INPUT1": [2.0] * 16}).encode()  # add_sub, by generate
HTTP_CASES: list[HttpCase] = [
    HttpCase("GET", "/v2/health/live", Op.HEALTH, via_raw("GET", "/v2/health/live")),
    HttpCase("GET", "/v2/health/ready", Op.HEALTH, via_raw("GET", "/v2/health/ready")),
    HttpCase("GET", "/metrics", Op.METRICS, via_raw("GET", "/metrics")),
    HttpCase("GET", "/v2", Op.SERVER_METADATA, via_client(lambda c, h: c.get_server_metadata(headers=h))),
    HttpCase("GET", "/v2/models/{m}[/versions/{v}]", Op.MODEL_METADATA,
             via_client(lambda c, h: c.get_model_metadata(ALLOWED, headers=h))),
    HttpCase("GET", "/v2/models/{m}[/versions/{v}]", Op.MODEL_METADATA,
             via_client(lambda c, h: c.get_model_metadata(ALLOWED, "1", headers=h))),
    HttpCase("GET", "/v2/models/{m}[/versions/{v}]/ready", Op.MODEL_READY,
             via_raw("GET", f"/v2/models/{ALLOWED}/ready")),  # tritonclient's is_model_ready hides the status
    HttpCase("GET", "/v2/models/{m}[/versions/{v}]/ready", Op.MODEL_READY,
             via_raw("GET", f"/v2/models/{ALLOWED}/versions/1/ready")),
    HttpCase("GET", "/v2/models/{m}[/versions/{v}]/config", Op.MODEL_CONFIG,
             via_client(lambda c, h: c.get_model_config(ALLOWED, headers=h))),
    HttpCase("GET", "/v2/models/{m}[/versions/{v}]/stats", Op.MODEL_STATISTICS,
             via_client(lambda c, h: c.get_inference_statistics(ALLOWED, "1", headers=h))),
    HttpCase("GET", "/v2/models/stats", Op.ALL_STATISTICS, via_client(lambda c, h: c.get_inference_statistics(headers=h))),
    HttpCase("POST", "/v2/models/{m}[/versions/{v}]/infer", Op.INFER,
             via_client(lambda c, h: c.infer(ALLOWED, add_sub_inputs(httpclient), headers=h))),
    HttpCase("POST", "/v2/models/{m}[/versions/{v}]/generate", Op.GENERATE,
             via_raw("POST", f"/v2/models/{ALLOWED}/generate", GENERATE_BODY)),
    HttpCase("POST", "/v2/models/{m}[/versions/{v}]/generate_stream", Op.GENERATE,
             via_raw("POST", f"/v2/models/{ALLOWED}/versions/1/generate_stream", GENERATE_BODY)),
    HttpCase("GET", "/v2/trace/setting", Op.TRACE_GET, via_client(lambda c, h: c.get_trace_settings(headers=h))),
    HttpCase("POST", "/v2/trace/setting", Op.TRACE_UPDATE,
             via_client(lambda c, h: c.update_trace_settings(settings={"trace_rate": "1000"}, headers=h))),
    HttpCase("GET", "/v2/models/{m}/trace/setting", Op.MODEL_TRACE_GET,
             via_client(lambda c, h: c.get_trace_settings(ALLOWED, headers=h))),
    HttpCase("POST", "/v2/models/{m}/trace/setting", Op.MODEL_TRACE_UPDATE,
             via_client(lambda c, h: c.update_trace_settings(ALLOWED, {"trace_rate": "1000"}, headers=h))),
    HttpCase("GET", "/v2/logging", Op.LOG_GET, via_client(lambda c, h: c.get_log_settings(headers=h))),
    HttpCase("POST", "/v2/logging", Op.LOG_UPDATE,
             via_client(lambda c, h: c.update_log_settings({"log_info": True}, headers=h))),
    HttpCase("POST", "/v2/repository[/{r}]/index", Op.REPOSITORY_INDEX,
             via_client(lambda c, h: c.get_model_repository_index(headers=h))),
    HttpCase("POST", "/v2/repository[/{r}]/index", Op.REPOSITORY_INDEX, via_raw("POST", "/v2/repository/myrepo/index")),
    HttpCase("POST", "/v2/repository[/{r}]/models/{m}/load", Op.REPOSITORY_LOAD,
             via_client(lambda c, h: c.load_model(CONTROLLED, headers=h))),
    HttpCase("POST", "/v2/repository[/{r}]/models/{m}/unload", Op.REPOSITORY_UNLOAD,
             via_client(lambda c, h: c.unload_model(CONTROLLED, headers=h))),
    HttpCase("GET", "/v2/systemsharedmemory[/region/{n}]/status", Op.SHM_STATUS,
             via_client(lambda c, h: c.get_system_shared_memory_status(headers=h))),
    HttpCase("POST", "/v2/systemsharedmemory/region/{n}/register", Op.SHM_REGISTER,
             via_client(lambda c, h: (c.register_system_shared_memory("r", SHM_KEY, 64, headers=h),
                                      c.unregister_system_shared_memory("r", headers=h)))),
    HttpCase("POST", "/v2/systemsharedmemory[/region/{n}]/unregister", Op.SHM_UNREGISTER,
             via_client(lambda c, h: c.unregister_system_shared_memory(headers=h))),
    HttpCase("GET", "/v2/cudasharedmemory[/region/{n}]/status", Op.SHM_STATUS,
             via_client(lambda c, h: c.get_cuda_shared_memory_status(headers=h))),
    HttpCase("POST", "/v2/cudasharedmemory/region/{n}/register", Op.SHM_REGISTER,  # not a real handle: 400
             via_client(lambda c, h: c.register_cuda_shared_memory("r", "AAAA", 0, 64, headers=h)), success=400),
    HttpCase("POST", "/v2/cudasharedmemory[/region/{n}]/unregister", Op.SHM_UNREGISTER,
             via_client(lambda c, h: c.unregister_cuda_shared_memory("r", headers=h))),
    HttpCase("GET", "/v2/placement", Op.PLACEMENT, via_raw("GET", "/v2/placement")),
]


@dataclass(frozen=True)
class GrpcCase:
    method: str
    op: Op
    call: Call
    success: int = 200


def _stream_infer(channel: grpc.Channel, headers: dict[str, str]) -> tuple[int, str]:
    """ModelStreamInfer: errors travel in band, their code in an infer_response parameter."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    req = pb.ModelInferRequest(model_name=ALLOWED, id="s1")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        req.raw_input_contents.append(np.ones(16, np.float32).tobytes())
    (resp,) = list(stub.ModelStreamInfer(iter([req]), metadata=tuple(headers.items()), timeout=30))
    if not resp.error_message:
        return 200, ""
    code = resp.infer_response.parameters[hop.ERROR_CODE].string_param
    return GRPC_CODES[code], resp.error_message


GRPC_CASES: list[GrpcCase] = [
    GrpcCase("ServerLive", Op.HEALTH, lambda c, h: c.is_server_live(headers=h)),
    GrpcCase("ServerReady", Op.HEALTH, lambda c, h: c.is_server_ready(headers=h)),
    GrpcCase("ServerMetadata", Op.SERVER_METADATA, lambda c, h: c.get_server_metadata(headers=h)),
    GrpcCase("ModelReady", Op.MODEL_READY, lambda c, h: c.is_model_ready(ALLOWED, headers=h)),
    GrpcCase("ModelMetadata", Op.MODEL_METADATA, lambda c, h: c.get_model_metadata(ALLOWED, "1", headers=h)),
    GrpcCase("ModelConfig", Op.MODEL_CONFIG, lambda c, h: c.get_model_config(ALLOWED, headers=h)),
    GrpcCase("ModelStatistics", Op.MODEL_STATISTICS, lambda c, h: c.get_inference_statistics(ALLOWED, headers=h)),
    GrpcCase("ModelStatistics", Op.ALL_STATISTICS, lambda c, h: c.get_inference_statistics(headers=h)),
    GrpcCase("RepositoryIndex", Op.REPOSITORY_INDEX, lambda c, h: c.get_model_repository_index(headers=h)),
    GrpcCase("RepositoryModelLoad", Op.REPOSITORY_LOAD, lambda c, h: c.load_model(CONTROLLED, headers=h)),
    GrpcCase("RepositoryModelUnload", Op.REPOSITORY_UNLOAD, lambda c, h: c.unload_model(CONTROLLED, headers=h)),
    GrpcCase("ModelInfer", Op.INFER, lambda c, h: c.infer(ALLOWED, add_sub_inputs(grpcclient), headers=h)),
    GrpcCase("ModelStreamInfer", Op.INFER, lambda c, h: None),  # raw: see _stream_infer
    GrpcCase("TraceSetting", Op.TRACE_GET, lambda c, h: c.get_trace_settings(headers=h)),
    GrpcCase("TraceSetting", Op.TRACE_UPDATE,
             lambda c, h: c.update_trace_settings(settings={"trace_rate": "1000"}, headers=h)),
    GrpcCase("TraceSetting", Op.MODEL_TRACE_GET, lambda c, h: c.get_trace_settings(ALLOWED, headers=h)),
    GrpcCase("TraceSetting", Op.MODEL_TRACE_UPDATE,
             lambda c, h: c.update_trace_settings(ALLOWED, {"trace_rate": "1000"}, headers=h)),
    GrpcCase("LogSettings", Op.LOG_GET, lambda c, h: c.get_log_settings(headers=h)),
    GrpcCase("LogSettings", Op.LOG_UPDATE, lambda c, h: c.update_log_settings({"log_info": True}, headers=h)),
    GrpcCase("SystemSharedMemoryStatus", Op.SHM_STATUS, lambda c, h: c.get_system_shared_memory_status(headers=h)),
    GrpcCase("SystemSharedMemoryRegister", Op.SHM_REGISTER,
             lambda c, h: (c.register_system_shared_memory("r", SHM_KEY, 64, headers=h),
                           c.unregister_system_shared_memory("r", headers=h))),
    GrpcCase("SystemSharedMemoryUnregister", Op.SHM_UNREGISTER,
             lambda c, h: c.unregister_system_shared_memory(headers=h)),
    GrpcCase("CudaSharedMemoryStatus", Op.SHM_STATUS, lambda c, h: c.get_cuda_shared_memory_status(headers=h)),
    GrpcCase("CudaSharedMemoryRegister", Op.SHM_REGISTER,  # not a real handle: 400
             lambda c, h: c.register_cuda_shared_memory("r", b"", 0, 64, headers=h), success=400),
    GrpcCase("CudaSharedMemoryUnregister", Op.SHM_UNREGISTER,
             lambda c, h: c.unregister_cuda_shared_memory("r", headers=h)),
]


def _scrape(channel: grpc.Channel, headers: dict[str, str]) -> int:
    """meshserve.Metrics/Scrape (the /metrics text over gRPC): the status as an HTTP code."""
    call = channel.unary_unary(f"/{access.METRICS_SERVICE}/Scrape")
    try:
        body = call(b"", metadata=tuple(headers.items()), timeout=10)
    except grpc.RpcError as exc:
        return GRPC_CODES[exc.code().name]
    assert b"meshserve_gateway_requests_total" in body
    return 200


def _health_check(channel: grpc.Channel, headers: dict[str, str]) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), metadata=tuple(headers.items()), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    return 200


# ---- the table covers everything ------------------------------------------------------------------

def test_table_covers_every_grpc_method_and_http_route() -> None:
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert set(access.GRPC_METHODS) == {m.name for m in service.methods}
    assert access.GRPC_SERVICE == service.full_name
    health = health_pb2.DESCRIPTOR.services_by_name["Health"]
    assert health.full_name == access.HEALTH_SERVICE and set(access.HEALTH_METHODS) == {m.name for m in health.methods}
    assert set(access.METRICS_METHODS) == {"Scrape"}  # walked by _scrape below
    # the walk below has a case for every route the HTTP front end dispatches by (its live,
    # compiled table, built from access.HTTP_ROUTES) and every op
    live = {(r.method, r.template): r.op for r in _live_routes()}
    assert len(live) == len(access.HTTP_ROUTES)
    assert {(c.method, c.route) for c in HTTP_CASES} == set(live)
    assert all(live[(c.method, c.route)] is c.op for c in HTTP_CASES)
    assert {c.method for c in GRPC_CASES} == set(access.GRPC_METHODS)
    assert all(c.op is access.GRPC_METHODS[c.method].op for c in GRPC_CASES
               if isinstance(access.GRPC_METHODS[c.method].op, Op))
    # the tables are what the server dispatches: every path it serves is a row, every row is served
    server = H2GrpcServer()
    register(server, None, HealthState())  # type: ignore[arg-type]  # (building the table calls no core)
    assert set(server.paths()) == {f"/{service}/{name}" for service, table in (
        (access.GRPC_SERVICE, access.GRPC_METHODS), (access.HEALTH_SERVICE, access.HEALTH_METHODS),
        (access.METRICS_SERVICE, access.METRICS_METHODS)) for name in table}
    assert {c.op for c in GRPC_CASES} | {c.op for c in HTTP_CASES} == set(Op)


def _live_routes() -> list[Any]:
    """The routes an HTTP front end dispatches by (meshserve/server/http1/routing.py:Router)."""
    return HttpFrontend(None).router.routes  # type: ignore[arg-type]  # (no core needed to build the table)


# ---- the walk --------------------------------------------------------------------------------------

def _check_listed(result: Any, who: str, kind: str) -> None:
    """Statistics and the index, filtered by content: a tenant sees its models only."""
    if kind == "stats":
        stats = result["model_stats"] if isinstance(result, dict) else result.model_stats
        names = {s["name"] if isinstance(s, dict) else s.name for s in stats}
    else:
        models = result if isinstance(result, list) else result.models
        names = {m["name"] if isinstance(m, dict) else m.name for m in models}
    want = {"tenant": {ALLOWED}, "other tenant": {OTHER}}.get(who)
    if want is not None:
        assert names == want, (who, kind, names)
    else:  # the admin sees every model
        assert {ALLOWED, OTHER, "small_mlp"} <= names, (who, kind, names)


@pytest.mark.parametrize("who", list(WHO))
def test_every_http_route(mesh: Mesh, who: str) -> None:
    headers = WHO[who]
    for case in HTTP_CASES:
        status, result = case.call(mesh.gateway.http, dict(headers))  # tritonclient adds to the dict it gets
        want = expected(case.op.rule, who, case.success)
        assert status == want, (who, case.method, case.route, case.op, status, result)
        if status == 200 and case.op in (Op.ALL_STATISTICS, Op.REPOSITORY_INDEX):
            if isinstance(result, bytes):
                result = json.loads(result)
            _check_listed(result, who, "stats" if case.op is Op.ALL_STATISTICS else "index")
        if status in (401, 403):
            text = result.decode() if isinstance(result, bytes) else str(result)
            assert ("API key" in text) if status == 401 else ("admin" in text or ALLOWED in text), text


@pytest.mark.parametrize("who", list(WHO))
def test_every_grpc_method(mesh: Mesh, who: str) -> None:
    headers = WHO[who]
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c, \
            grpc.insecure_channel(mesh.gateway.grpc) as channel:
        assert _health_check(channel, headers) == 200  # grpc.health.v1: open
        assert _scrape(channel, headers) == expected(access.METRICS_METHODS["Scrape"].rule_of(b"").rule, who)
        for case in GRPC_CASES:
            if case.method == "ModelStreamInfer":
                status, message = _stream_infer(channel, headers)
                result: Any = None
            else:
                try:
                    result, status, message = case.call(c, dict(headers)), 200, ""
                except InferenceServerException as exc:
                    result, message = None, exc.message() or ""
                    status = GRPC_CODES[str(exc.status()).removeprefix("StatusCode.")]
            want = expected(case.op.rule, who, case.success)
            assert status == want, (who, case.method, case.op, status, message)
            if status == 200 and case.op in (Op.ALL_STATISTICS, Op.REPOSITORY_INDEX):
                _check_listed(result, who, "stats" if case.op is Op.ALL_STATISTICS else "index")


def test_routes_outside_the_table_fail_closed(mesh: Mesh) -> None:
    """Route-shaped paths (each table route with one segment replaced, plus extra segments),
    GET and POST, without a key: only the open routes answer 2xx; everything else is a client
    error. A route the front end dispatches without consulting the table would answer here."""
    words = ["v2", "health", "live", "ready", "models", ALLOWED, "versions", "1", "config", "stats", "infer",
             "trace", "setting", "logging", "repository", "index", "load", "unload", "metrics", "x", "",
             "systemsharedmemory", "region", "status", "register", "unregister"]
    templates = {r.replace("[/versions/{v}]", "").replace("[/{r}]", "").replace("[/region/{n}]", "")
                 .replace("{m}", ALLOWED).replace("{n}", "r") for r in {route.template for route in _live_routes()}}
    paths: set[str] = set()
    for t in templates:
        parts = t.strip("/").split("/")
        for i, w in itertools.product(range(len(parts) + 1), words):
            paths.add("/" + "/".join(parts[:i] + [w] + parts[i + 1:]))
            paths.add("/" + "/".join(parts[:i] + [w] + parts[i:]))
    open_paths = {"v2/health/live", "v2/health/ready", "metrics"}  # as the front end strips the path
    host, port = mesh.gateway.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    answered = 0
    try:
        for path, method in itertools.product(sorted(paths), ("GET", "POST")):
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            r = conn.getresponse()
            r.read()
            assert r.status < 500, (method, path, r.status)
            if path.strip("/") in open_paths:
                continue
            assert not 200 <= r.status < 300, (method, path, r.status)
            answered += 1
    finally:
        conn.close()
    assert answered > 1000


def test_metrics_auth_flag(mesh: Mesh) -> None:
    """--metrics-auth: /metrics (model and tenant names, every tenant's counts) for admins only,
    on the HTTP port and on --metrics-port."""
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
               "--upstream", mesh.service.grpc, "--tenants", str(mesh.repo.parent / "tenants.yaml"),
               "--metrics-auth"])
    try:
        _wait_http_ready(g.http)
        want = {"no key": 401, "wrong key": 401, "tenant": 403, "other tenant": 403, "admin": 200}
        for hostport in (g.http, f"127.0.0.1:{g.ports['metrics']}"):
            got = {who: raw_http(hostport, "GET", "/metrics", h)[0] for who, h in WHO.items()}
            assert got == want, (hostport, got)
        with grpc.insecure_channel(g.grpc) as channel:  # the same text over gRPC, the same rule
            assert {who: _scrape(channel, h) for who, h in WHO.items()} == want
    finally:
        g.stop()


def test_anonymous_callers_keep_todays_rules(mesh: Mesh) -> None:
    """A tenants file that allows anonymous callers: every model readable without a key, stats
    unfiltered, but no admin operations."""
    path = mesh.repo.parent / "tenants-anon.yaml"
    path.write_text("anonymous: true\n" + TENANTS)
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", mesh.service.grpc,
               "--tenants", str(path)])
    try:
        _wait_http_ready(g.http)
        with grpcclient.InferenceServerClient(g.grpc) as c:
            assert c.get_model_metadata(OTHER).name == OTHER
            assert {ALLOWED, OTHER} <= {s.name for s in c.get_inference_statistics().model_stats}
            c.infer(ALLOWED, add_sub_inputs(grpcclient))
            with pytest.raises(InferenceServerException) as err:
                c.update_log_settings({"log_info": True})
            assert str(err.value.status()) == "StatusCode.PERMISSION_DENIED" and "anonymous" in err.value.message()
    finally:
        g.stop()
