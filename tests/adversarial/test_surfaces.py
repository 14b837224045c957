"""Surfaces issue 29 does not name, probed as an attacker would (item 9), through the mesh:
floods of the calls that are not inference (statistics, metadata, config, the repository index,
trace and log settings, /metrics) and of generate_stream, from another tenant's valid key while
the good client runs. None of them goes through the infer path's quota, so what holds them is
the process's own cost per call: each must leave the good client's p99 within the suite's
bound, with no failure and no RSS growth, and answer every call with its own success or a
client error (never a 5xx)."""
from __future__ import annotations

import ast
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import (
    KEY,
    LIMIT_FLAGS,
    LONG,
    OTHER_KEY,
    GoodClient,
    Mesh,
    Observation,
    tenant,
    under_attack,
)
from tests.adversarial.support import raw_http
from tests.conftest import _wait_http_ready, start
from tests.support import models

M = {"x-api-key": OTHER_KEY}
FLOOD_S = 6.0 if LONG else 3.0
THREADS = 4


def _grpc(call: Callable[[grpcclient.InferenceServerClient], Any]) -> Callable[[Mesh], Callable[[], str]]:
    def bind(mesh: Mesh) -> Callable[[], str]:
        client = grpcclient.InferenceServerClient(mesh.gateway.grpc)

        def once() -> str:
            try:
                call(client)
                return "OK"
            except InferenceServerException as exc:
                return str(exc.status())
        return once
    return bind


def _http(method: str, path: str, body: bytes = b"") -> Callable[[Mesh], Callable[[], str]]:
    def bind(mesh: Mesh) -> Callable[[], str]:
        def once() -> str:
            status, _ = raw_http(mesh.gateway.http, method, path, dict(M), body)
            return str(status)
        return once
    return bind


GENERATE = json.dumps({"INPUT0": [1.0] * 16, "INPUT1": [2.0] * 16}).encode()

FLOODS: dict[str, Callable[[Mesh], Callable[[], str]]] = {
    "statistics (all models, gRPC)": _grpc(lambda c: c.get_inference_statistics(headers=M)),
    "model statistics (HTTP)": _http("GET", "/v2/models/add_sub/stats"),
    "model metadata + config (gRPC)": _grpc(lambda c: (c.get_model_metadata("add_sub", headers=M),
                                                       c.get_model_config("add_sub", headers=M))),
    "repository index (gRPC)": _grpc(lambda c: c.get_model_repository_index(headers=M)),
    "trace settings read (HTTP)": _http("GET", "/v2/models/add_sub/trace/setting"),
    "log settings read (gRPC)": _grpc(lambda c: c.get_log_settings(headers=M)),
    "metrics (HTTP)": _http("GET", "/metrics"),
    "generate_stream (HTTP)": _http("POST", "/v2/models/add_sub/generate_stream", GENERATE),
    "generate with a wrong body (HTTP)": _http("POST", "/v2/models/add_sub/generate", b'{"INPUT0": "x"}'),
    "unknown model's metadata (HTTP)": _http("GET", "/v2/models/no_such_model"),
}


def _flooding(mesh: Mesh, bind: Callable[[Mesh], Callable[[], str]]) -> Callable[[], Observation]:
    """An attack: THREADS threads calling ``bind(mesh)`` for FLOOD_S; observes the status counts."""
    def attack() -> Observation:
        codes: dict[str, int] = {}
        lock = threading.Lock()
        stop = time.monotonic() + FLOOD_S

        def flood() -> None:
            once = bind(mesh)
            while time.monotonic() < stop:
                code = once()
                with lock:
                    codes[code] = codes.get(code, 0) + 1

        threads = [threading.Thread(target=flood) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(FLOOD_S + 30)
        return Observation(f"{codes}", True)
    return attack


@pytest.mark.parametrize("surface", list(FLOODS))
def test_a_flood_of_one_surface_leaves_the_good_client_alone(mesh: Mesh, surface: str) -> None:
    verdict = under_attack(mesh, mesh.gateway, surface, _flooding(mesh, FLOODS[surface])).judge(expect_refusal=False)
    print(verdict.summary())
    codes = ast.literal_eval(verdict.observed)
    assert not [c for c in codes if c.startswith("5") or c in ("StatusCode.INTERNAL", "StatusCode.UNKNOWN")], codes
    verdict.check()


def test_statistics_name_only_the_caller_s_models(mesh: Mesh) -> None:
    """Statistics of every model, read by a tenant, list only the models it may use; another
    model's statistics are 403 (the access table), over both protocols."""
    with httpclient.InferenceServerClient(mesh.gateway.http) as c:
        names = {s["name"] for s in c.get_inference_statistics(headers=M)["model_stats"]}
    assert names <= {"add_sub", "identity_fp32"}, names
    status, body = raw_http(mesh.gateway.http, "GET", "/v2/models/small_mlp/stats", dict(M))
    assert status in (403, 404), (status, body)


# ---- a gateway with everything on: ensembles, an A/B route with a shadow, metrics federation ----

SUM3 = models.ensemble_config("sum3", {"X": 16}, {"T": 16, "C": -1}, [
    models.step("add_sub", {"INPUT0": "X", "INPUT1": "X"}, {"OUTPUT0": "S"}),
    models.step("identity_fp32", {"INPUT0": "S"}, {"OUTPUT0": "C"}),
    models.step("add_sub", {"INPUT0": "S", "INPUT1": "X"}, {"OUTPUT0": "T"})])
ROUTES = """
routes:
  - name: mirrored
    targets: [{model: add_sub}]
    shadow: {model: add_sub, share: 1.0}
"""
TENANTS = "\ntenants:\n" + tenant("acme", KEY, ["add_sub"]) + tenant("mallory", OTHER_KEY, ["sum3", "mirrored"])


@pytest.fixture(scope="module")
def _full_holder() -> Iterator[list[Mesh]]:
    held: list[Mesh] = []
    yield held
    for m in held:
        m.good.stop()
        m.gateway.stop()


@pytest.fixture
def full(mesh: Mesh, _full_holder: list[Mesh], tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    """A second gateway in front of the mesh's services with ensembles, routes, tenants and
    --federate-metrics, and a good client of its own (kept for the module while the mesh's
    services are the same and it is healthy)."""
    if _full_holder and _full_holder[0].services == mesh.services and _full_holder[0].healthy():
        return _full_holder[0]
    for m in _full_holder:
        m.good.stop()
        m.gateway.stop()
    _full_holder.clear()
    tmp = tmp_path_factory.mktemp("full")
    (tmp / "ens" / "sum3" / "1").mkdir(parents=True)
    (tmp / "ens" / "sum3" / "config.pbtxt").write_text(SUM3)
    (tmp / "routes.yaml").write_text(ROUTES)
    (tmp / "tenants.yaml").write_text(TENANTS)
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tmp / "tenants.yaml"),
               "--routes", str(tmp / "routes.yaml"), "--repository", str(tmp / "ens"), "--federate-metrics",
               *[a for s in mesh.services for a in ("--upstream", s.grpc)], *LIMIT_FLAGS])
    try:
        _wait_http_ready(g.http)
        good = GoodClient(g)
        assert good.wait_past(time.monotonic(), 30), "the good client did not start"
    except Exception:
        g.stop()
        raise
    _full_holder.append(Mesh(g, mesh.services, good, tmp))
    return _full_holder[0]


def _infer(model: str, name: str) -> Callable[[Mesh], Callable[[], str]]:
    def bind(mesh: Mesh) -> Callable[[], str]:
        client = grpcclient.InferenceServerClient(mesh.gateway.grpc)
        inputs = []
        for n in ((name,) if name else ("INPUT0", "INPUT1")):
            inp = grpcclient.InferInput(n, [1, 16], "FP32")
            inp.set_data_from_numpy(np.ones((1, 16), np.float32))
            inputs.append(inp)

        def once() -> str:
            try:
                client.infer(model, inputs, headers=M)
                return "OK"
            except InferenceServerException as exc:
                return str(exc.status())
        return once
    return bind


FULL_FLOODS: dict[str, Callable[[Mesh], Callable[[], str]]] = {
    "an ensemble (3 steps)": _infer("sum3", "X"),
    "an A/B route with a shadow of every request": _infer("mirrored", ""),
    "federated /metrics": _http("GET", "/metrics"),
}


@pytest.mark.parametrize("surface", list(FULL_FLOODS))
def test_a_flood_through_ensembles_shadows_and_federation(full: Mesh, surface: str) -> None:
    """The ensemble's steps and the shadow copies are the gateway's own calls to the services:
    another tenant's flood of them must leave the good client alone too (bounds: its share of
    --max-inflight, --ensemble-max-inflight-steps, 64 shadow copies in flight, one federated
    scrape at a time, at most one per 0.25 s)."""
    verdict = under_attack(full, full.gateway, surface, _flooding(full, FULL_FLOODS[surface])).judge(
        expect_refusal=False)
    print(verdict.summary())
    codes = ast.literal_eval(verdict.observed)
    assert not [c for c in codes if c.startswith("5") or c in ("StatusCode.INTERNAL", "StatusCode.UNKNOWN")], codes
    assert set(codes) <= {"OK", "200", "StatusCode.RESOURCE_EXHAUSTED"}, codes
    verdict.check()


def test_tenants_reach_only_their_own_names(full: Mesh) -> None:
    """mallory may call the ensemble and the route, not the models behind them; acme may call
    add_sub, not mallory's ensemble or route: 403 either way, and statistics list each one's own."""
    with grpcclient.InferenceServerClient(full.gateway.grpc) as c:
        assert _infer("add_sub", "")(full)() == "StatusCode.PERMISSION_DENIED"
        assert _infer("sum3", "X")(full)() == "OK" and _infer("mirrored", "")(full)() == "OK"
        for model in ("sum3", "mirrored"):
            with pytest.raises(InferenceServerException) as err:
                c.get_model_metadata(model, headers={"x-api-key": KEY})
            assert str(err.value.status()) == "StatusCode.PERMISSION_DENIED"
        names = {s.name for s in c.get_inference_statistics(headers=M).model_stats}
        assert "add_sub" not in names and "identity_fp32" not in names, names
