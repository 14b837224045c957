"""Loads of the same model that overlap are one load (issue 32: two gateways racing the same cold
model; services/base/core.py:ServiceCore._load_once), through a real service and the real
tritonclient: while a large model's load holds the service's load queue, two load requests for
another model arrive together; both succeed and the model is loaded once (its load counter on
/metrics). A load asked for after that one ended is a reload, as in Triton; two overlapping loads of
a broken model both get its reason (the waiter the first load's), a client error."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from load.bench import mesh_models
from tests.conftest import Proc, start
from tests.support import eventually, sized_models
from tests.support.metrics import sample, scrape

BLOCKER_N = 5800  # 134.6 MB of weights: its load takes long enough for the others to queue behind it


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("single_flight")
    sized_models.onnx_matmul(repo, "blocker", BLOCKER_N, 1.0)
    mesh_models.write(repo, 1, 1024)
    mesh_models.write_broken(repo, "broken")
    svc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                 "--model-control-mode", "explicit"])
    yield svc
    svc.stop()


def _together(svc: Proc, names: list[str]) -> list[str]:
    """Load ``names`` at once from one client each, while the blocker's load holds the queue: each
    call's outcome ("OK" or the error's status and message)."""
    state: dict[str, str] = {}
    outcomes = ["?"] * len(names)

    def load(i: int, name: str) -> None:
        with grpcclient.InferenceServerClient(svc.grpc) as c:
            try:
                c.load_model(name, client_timeout=120)
                outcomes[i] = "OK"
            except InferenceServerException as exc:
                outcomes[i] = f"{exc.status()} {exc.message()}"

    def block() -> None:
        with grpcclient.InferenceServerClient(svc.grpc) as c:
            c.load_model("blocker", client_timeout=120)
            state["blocker"] = "loaded"

    with grpcclient.InferenceServerClient(svc.grpc) as c:
        c.unload_model("blocker")
        blocker = threading.Thread(target=block)
        blocker.start()
        eventually(lambda: any(m.get("name") == "blocker" and m.get("state") == "LOADING"
                               for m in c.get_model_repository_index(as_json=True)["models"]),
                   timeout=30, interval=0.005)
        threads = [threading.Thread(target=load, args=(i, n)) for i, n in enumerate(names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        blocker.join()
    assert state == {"blocker": "loaded"}
    return outcomes


def _loads(svc: Proc, name: str) -> float:
    samples = scrape(svc.http)
    return sample(samples, "meshserve_model_loads_total", model=name) if any(
        n == "meshserve_model_loads_total" and ("model", name) in labels for n, labels in samples) else 0


def test_overlapping_loads_of_one_model_load_it_once(service: Proc) -> None:
    name = mesh_models.name_of(1)
    assert _loads(service, name) == 0
    assert _together(service, [name, name]) == ["OK", "OK"]
    assert _loads(service, name) == 1
    with grpcclient.InferenceServerClient(service.grpc) as c:
        assert c.is_model_ready(name)
        c.load_model(name)  # after the first ended: a reload, as Triton does
    assert _loads(service, name) == 2


def test_overlapping_loads_of_a_broken_model_both_get_its_reason(service: Proc) -> None:
    first, second = _together(service, ["broken", "broken"])
    assert first == second, (first, second)
    assert first.startswith("StatusCode.INVALID_ARGUMENT failed to load 'broken'"), first
    assert str(service.argv[service.argv.index("--repository") + 1]) not in first  # no host path
