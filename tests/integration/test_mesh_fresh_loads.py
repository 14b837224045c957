"""A model loaded on demand is not evicted before its first request runs (docs/model-mesh.md,
"Loading under the budget", step 2: the grace of a fresh version).

One onnx replica whose budget holds one of the generated models, a lazy gateway in front, and
four clients asking four different cold models at the same moment through the real tritonclient:
the gateway starts four loads at once (--max-concurrent-loads 4), the service runs them one after
another. Without the grace the second load evicts the first model before the gateway's request for
it arrives (it has not run), its request is answered "unknown model", the gateway loads it again,
which evicts another model that has not run yet: loads that evict each other's models until
PLACE_ATTEMPTS runs out (503 "evicted again before its request ran") or by luck (then a model
loaded twice or three times). Measured on 9bbf31a: 4 runs of 4, every one failed. With it the
second load is refused (RESOURCE_EXHAUSTED: the only model it could evict has not served yet), the
gateway tries again a moment later, after the first request ran: each model is loaded once.

Real processes over loopback; the service-only cases check the refusal's words, that the grace
ends (a fresh model that never gets its request is evictable after --eviction-grace), and that an
explicit unload of a fresh model still works.

The grace has to outlast the time from a load's answer to its request's arrival at the service
(and, in the refusal case, to the next load call): on a quiet machine milliseconds, but on a
2-core box running other suites beside this one, more than the default 2 s was seen. So these
cases give the service a grace no machine's slowness reaches (``MESH_GRACE_S``, ``GRACE_S``)
and assert what the grace means, not how fast the box is: each model loaded once, a second load
refused at once (well within the grace: it did not wait it out), a served model evicted
without waiting; the grace's end is its own case (a short grace, waited out on purpose)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from load.bench import mesh_models
from tests.conftest import Proc, _wait_http_ready, start
from tests.support.metrics import sample, scrape

ROWS = 65536  # 4 MiB of weight each (4,194,xxx bytes of file; a first load's estimate 1.2x that)
BUDGET = 8_000_000  # one first load's estimate fits (1.2 x 4.19 MB), two models never do (2 x 4.19 MB)
CLIENTS = 4
MESH_GRACE_S = 30.0  # the mesh's service: longer than any load-to-request time here (the default is 2 s)
GRACE_S = 20.0  # the service's --eviction-grace in the refusal case


@dataclass
class Mesh:
    service: Proc
    gateway: Proc


def _service(repo: Path, *args: str) -> Proc:
    return start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                  "--model-control-mode", "explicit", "--memory-budget", str(BUDGET), *args])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("fresh")
    for i in range(CLIENTS):
        mesh_models.write(repo, i, ROWS)
    return repo


@pytest.fixture()
def mesh(repo: Path) -> Iterator[Mesh]:
    procs: list[Proc] = []
    try:
        procs.append(svc := _service(repo, "--eviction-grace", str(MESH_GRACE_S)))
        procs.append(gw := start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", svc.grpc,
                                  "--model-control-mode", "lazy", "--repository", str(repo),
                                  "--max-concurrent-loads", str(CLIENTS), "--placement-interval", "0.5",
                                  "--discovery-interval", "1"]))
        _wait_http_ready(gw.http)
        yield Mesh(svc, gw)
    finally:
        for p in reversed(procs):
            p.stop()


def _ask(url: str, index: int) -> np.ndarray:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    with grpcclient.InferenceServerClient(url) as c:
        out = c.infer(mesh_models.name_of(index), [inp], client_timeout=60).as_numpy("OUTPUT0")
    assert out is not None
    return out


def test_models_requested_at_once_are_each_loaded_once_and_served(mesh: Mesh) -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    answers: dict[int, object] = {}
    go = threading.Barrier(CLIENTS)

    def client(index: int) -> None:
        go.wait()
        try:
            answers[index] = _ask(mesh.gateway.grpc, index)
        except InferenceServerException as exc:
            answers[index] = f"{exc.status()}: {exc.message()}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(CLIENTS):
        assert isinstance(answers.get(i), np.ndarray), (i, answers.get(i))
        np.testing.assert_array_equal(answers[i], mesh_models.expected(i, x))
    samples = scrape(mesh.service.http)
    loads = {i: sample(samples, "meshserve_model_loads_total", model=mesh_models.name_of(i)) for i in range(CLIENTS)}
    # no thrash: no model was evicted before its request ran and loaded again for it
    assert loads == dict.fromkeys(range(CLIENTS), 1.0), loads
    assert sample(samples, "meshserve_memory_used_bytes") <= BUDGET


def test_a_load_that_could_only_evict_a_fresh_model_is_refused_until_it_serves(repo: Path) -> None:
    svc = _service(repo, "--eviction-grace", str(GRACE_S))
    first, second = mesh_models.name_of(0), mesh_models.name_of(1)
    try:
        with httpclient.InferenceServerClient(svc.http) as c:
            c.load_model(first)
            loaded = time.monotonic()
            with pytest.raises(InferenceServerException) as err:  # the first has not served: nothing may go
                c.load_model(second)
            assert time.monotonic() - loaded < GRACE_S / 2, "refused at once, not after waiting the grace out"
            message = err.value.message()
            assert err.value.status() == "429", message
            assert f"failed to load '{second}'" in message and "memory budget" in message, message
            assert "not served a request yet" in message and "/" not in message, message
            assert c.is_model_ready(first) and not c.is_model_ready(second)
        with grpcclient.InferenceServerClient(svc.grpc) as g:
            with pytest.raises(InferenceServerException) as gerr:
                g.load_model(second)
            assert gerr.value.status() == "StatusCode.RESOURCE_EXHAUSTED", gerr.value.message()
        # the first model serves its request: it is no longer fresh, the load evicts it
        _ask(svc.grpc, 0)
        with httpclient.InferenceServerClient(svc.http) as c:
            c.load_model(second)
            assert [c.is_model_ready(first), c.is_model_ready(second)] == [False, True]
            c.unload_model(second)  # an explicit unload of a fresh model goes at once
            assert not c.is_model_ready(second)
        samples = scrape(svc.http)
        assert sample(samples, "meshserve_model_evictions_total", model=first) == 1
        assert sample(samples, "meshserve_model_loads_total", model=second) == 1
        assert sample(samples, "meshserve_memory_used_bytes") == 0
    finally:
        svc.stop()


@pytest.mark.parametrize("grace,wait", [("0.5", 0.6), ("0", 0.0)], ids=["grace-over", "no-grace"])
def test_the_grace_ends_for_a_model_whose_request_never_comes(repo: Path, grace: str, wait: float) -> None:
    """Once the grace is over (or with --eviction-grace 0: the order before it) an unserved
    version is evicted as any idle one."""
    svc = _service(repo, "--eviction-grace", grace)
    try:
        with httpclient.InferenceServerClient(svc.http) as c:
            c.load_model(mesh_models.name_of(0))
            time.sleep(wait)  # the point: the grace passes without a request for it
            c.load_model(mesh_models.name_of(1))  # evicts it, unserved
            assert [c.is_model_ready(mesh_models.name_of(i)) for i in range(2)] == [False, True]
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        np.testing.assert_array_equal(_ask(svc.grpc, 1), mesh_models.expected(1, x))
    finally:
        svc.stop()


def test_a_grace_out_of_bounds_is_refused_at_start(repo: Path) -> None:
    """(the values themselves: tests/unit/services/test_memory.py)"""
    run = subprocess.run([sys.executable, "-m", "meshserve", "service", "onnx", "--repository", str(repo),
                          "--eviction-grace", "61"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--eviction-grace must be between 0 and 60" in run.stderr, run.stderr[-300:]
