"""An ensemble whose steps are lazy (issue 32, docs/model-mesh.md "Ensembles"): 20 generated
models behind two onnx replicas, a lazy gateway whose --repository holds the same models and the
ensembles over them, the real tritonclient. Each ensemble's step models are cold (loaded nowhere)
until its first request; the steps are placed and loaded as a direct request's model is. Real
processes over loopback; the tests run in order on one mesh."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from load.bench import mesh_models
from tests.conftest import Proc, _wait_http_ready, start
from tests.integration.test_model_mesh import TENANTS as mesh_tenants
from tests.integration.test_model_mesh import _metrics, _ready_on, _value
from tests.support import eventually, models

MODELS = 20
ROWS = 4096  # 256 KiB of weight each: every model fits (placement, not eviction, is under test here)
BROKEN = "mesh_broken"
MODULES = {"http": httpclient, "grpc": grpcclient}


def _chain(name: str, first: int | str, second: int | str) -> str:
    """Y = second(first(X)): two mesh models in a row (a model given by index or by name)."""
    a, b = (mesh_models.name_of(s) if isinstance(s, int) else s for s in (first, second))
    return models.ensemble_config(name, {"X": 16}, {"Y": 16}, [
        models.step(a, {"INPUT0": "X"}, {"OUTPUT0": "S"}),
        models.step(b, {"INPUT0": "S"}, {"OUTPUT0": "Y"})])


ENSEMBLES = {"ens_http": _chain("ens_http", 3, 7), "ens_grpc": _chain("ens_grpc", 5, 11),
             "ens_broken": _chain("ens_broken", 4, BROKEN), "ens_tenant": _chain("ens_tenant", 13, 14)}
TENANTS = mesh_tenants.replace("models: [mesh_001]", "models: [ens_tenant]")  # tenant t, key-t
AS_T = {"authorization": "Bearer key-t"}


@dataclass
class Mesh:
    a: Proc
    b: Proc
    g: Proc
    gt: Proc  # with tenants
    repo: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    repo = tmp_path_factory.mktemp("services")  # the services' models
    front = tmp_path_factory.mktemp("gateway")  # the gateway's: the same models and the ensembles
    for folder in (repo, front):
        for i in range(MODELS):
            mesh_models.write(folder, i, ROWS)
        mesh_models.write_broken(folder, BROKEN)
    for name, text in ENSEMBLES.items():
        (front / name / "1").mkdir(parents=True)
        (front / name / "config.pbtxt").write_text(text)
    service = ["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
               "--model-control-mode", "explicit"]
    procs: list[Proc] = []
    try:
        for _ in range(2):
            procs.append(start(service))
        a, b = procs
        lazy = ["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", a.grpc, "--upstream", b.grpc,
                "--model-control-mode", "lazy", "--repository", str(front), "--placement-interval", "0.5",
                "--discovery-interval", "1"]
        tenants = front.parent / "ensemble-tenants.yaml"
        tenants.write_text(TENANTS)
        for args in (lazy, [*lazy, "--tenants", str(tenants)]):
            procs.append(start(args))
            _wait_http_ready(procs[-1].http)
        yield Mesh(a, b, procs[2], procs[3], repo)
    finally:
        for p in reversed(procs):
            p.stop()


def _x() -> np.ndarray:
    return np.arange(16, dtype=np.float32).reshape(1, 16)


def _run(proto: str, url: str, name: str, headers: dict[str, str] | None = None) -> np.ndarray:
    m = MODULES[proto]
    inp = m.InferInput("X", [1, 16], "FP32")
    inp.set_data_from_numpy(_x())
    if proto == "http":
        with httpclient.InferenceServerClient(url, network_timeout=60) as hc:
            return hc.infer(name, [inp], headers=headers).as_numpy("Y")
    with grpcclient.InferenceServerClient(url) as gc:
        return gc.infer(name, [inp], headers=headers, client_timeout=60).as_numpy("Y")


def _placed(g: Proc) -> dict[str, list[str]]:
    with urllib.request.urlopen(f"http://{g.http}/v2/placement", timeout=10) as r:
        return {m["name"]: m["replicas"] for m in json.load(r)["models"]}


def _loaded(mesh: Mesh) -> set[str]:
    return _ready_on(mesh.a) | _ready_on(mesh.b)


def test_a_lazy_ensemble_is_described_without_loading_its_steps(mesh: Mesh) -> None:
    steps = {mesh_models.name_of(i) for i in (3, 7)}
    eventually(lambda: "ens_http" in _ready_names(mesh.g), what="the ensemble ready on its steps' repository configs")
    with httpclient.InferenceServerClient(mesh.g.http) as c:
        md = c.get_model_metadata("ens_http")
        config = c.get_model_config("ens_http")
        assert c.is_model_ready("ens_http")
    assert md["platform"] == "ensemble"
    assert [(t["name"], t["datatype"], t["shape"]) for t in md["inputs"]] == [("X", "FP32", [-1, 16])]
    assert [(t["name"], t["datatype"], t["shape"]) for t in md["outputs"]] == [("Y", "FP32", [-1, 16])]
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == sorted(steps)
    with grpcclient.InferenceServerClient(mesh.g.grpc) as c:
        assert c.get_model_metadata("ens_http").platform == "ensemble"
    assert not steps & _loaded(mesh)  # describing it loaded nothing
    assert not any(_placed(mesh.g).get(s) for s in steps)


def _ready_names(g: Proc) -> set[str]:
    with grpcclient.InferenceServerClient(g.grpc) as c:
        index = c.get_model_repository_index(as_json=True)
    return {m["name"] for m in index.get("models", []) if m.get("state") == "READY"}


@pytest.mark.parametrize(("proto", "name", "first", "second"),
                         [("http", "ens_http", 3, 7), ("grpc", "ens_grpc", 5, 11)])
def test_an_ensemble_of_two_cold_steps_answers_and_loads_them(mesh: Mesh, proto: str, name: str, first: int,
                                                              second: int) -> None:
    steps = [mesh_models.name_of(first), mesh_models.name_of(second)]
    assert not set(steps) & _loaded(mesh)  # both cold
    url = mesh.g.http if proto == "http" else mesh.g.grpc
    y = _run(proto, url, name)
    np.testing.assert_array_equal(y, _x() + np.float32(first + second))
    placed = _placed(mesh.g)
    for step in steps:
        assert placed[step], (step, placed)  # served by a replica: GET /v2/placement shows it
        assert step in _loaded(mesh)
    text = _metrics(mesh.g.http)
    for step in steps:  # one cold start each, in the histogram a direct request's goes to
        assert _value(text, "meshserve_gateway_model_cold_start_seconds_count", model=step) == 1
        assert _value(text, "meshserve_gateway_placement_loads_total", model=step, outcome="OK") == 1
    np.testing.assert_array_equal(_run(proto, url, name), y)  # warm now: the same answer, no load more
    assert _value(_metrics(mesh.g.http), "meshserve_gateway_placement_loads_total", model=steps[0]) == 1


def test_a_broken_step_answers_every_waiting_ensemble_request_with_the_reason(mesh: Mesh) -> None:
    def ask(_: int) -> str:
        try:
            _run("grpc", mesh.g.grpc, "ens_broken")
        except InferenceServerException as exc:
            return f"{exc.status()} {exc.message()}"
        return "OK"

    with ThreadPoolExecutor(4) as pool:  # four ensemble requests wait for the one load together
        outcomes = list(pool.map(ask, range(4)))
    for outcome in outcomes:
        assert outcome.startswith("StatusCode.INVALID_ARGUMENT"), outcome
        assert "ensemble 'ens_broken' step 1" in outcome, outcome
        assert f"failed to load '{BROKEN}'" in outcome and "ONNX" in outcome, outcome
        assert str(mesh.repo) not in outcome
    assert BROKEN not in _loaded(mesh)  # nothing half-loaded
    # the broken step's config does not read (its file is not ONNX): the plan waits for its load,
    # whose failure ends the request before any step ran
    assert mesh_models.name_of(4) not in _loaded(mesh)
    assert _value(_metrics(mesh.g.http), "meshserve_gateway_placement_loads_total", model=BROKEN) == 1
    with httpclient.InferenceServerClient(mesh.g.http) as c:  # over HTTP: the same reason, a client error
        with pytest.raises(InferenceServerException) as err:
            inp = httpclient.InferInput("X", [1, 16], "FP32")
            inp.set_data_from_numpy(_x())
            c.infer("ens_broken", [inp])
    assert err.value.status() == "400", err.value.status()
    assert f"failed to load '{BROKEN}'" in (err.value.message() or "")


def test_a_tenant_allowed_the_ensemble_loads_its_steps_but_no_other_model(mesh: Mesh) -> None:
    """The ensemble is the unit of permission (docs/security.md): a tenant allowed it runs (and so
    loads) the steps its config names, not being allowed their models; a direct request for a
    model it is not allowed is refused before any load."""
    steps = [mesh_models.name_of(13), mesh_models.name_of(14)]
    assert not set(steps) & _loaded(mesh)
    with pytest.raises(InferenceServerException) as caught:  # a step model directly: not the tenant's
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(_x())
        with grpcclient.InferenceServerClient(mesh.gt.grpc) as c:
            c.infer(steps[0], [inp], headers=AS_T)
    assert "PERMISSION_DENIED" in str(caught.value.status()), caught.value.status()
    assert not set(steps) & _loaded(mesh)
    with pytest.raises(InferenceServerException) as caught:  # another ensemble: not the tenant's
        _run("grpc", mesh.gt.grpc, "ens_http", AS_T)
    assert "PERMISSION_DENIED" in str(caught.value.status()), caught.value.status()
    np.testing.assert_array_equal(_run("grpc", mesh.gt.grpc, "ens_tenant", AS_T), _x() + np.float32(13 + 14))
    assert set(steps) <= _loaded(mesh)
