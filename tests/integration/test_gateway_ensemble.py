"""Ensembles run by the gateway over real services, through the real tritonclient."""
from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, service_and_gateway, start
from tests.support import models

# S = X + X (add_sub) ; then independently: C = identity(S) and T = S + X (add_sub)
SUM3 = models.ensemble_config("sum3", {"X": 16}, {"T": 16, "C": -1}, [
    models.step("add_sub", {"INPUT0": "X", "INPUT1": "X"}, {"OUTPUT0": "S"}),
    models.step("identity_fp32", {"INPUT0": "S"}, {"OUTPUT0": "C"}),
    models.step("add_sub", {"INPUT0": "S", "INPUT1": "X"}, {"OUTPUT0": "T"}, version=1)])
BROKEN = models.ensemble_config("broken", {"X": 16}, {"Y": 16}, [
    models.step("add_sub", {"INPUT0": "X", "INPUT1": "X"}, {"OUTPUT0": "S"}),
    models.step("no_such_model", {"INPUT0": "S"}, {"OUTPUT0": "Y"})])
MODULES = {"http": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    ens = tmp_path_factory.mktemp("ensembles")
    for name, text in (("sum3", SUM3), ("broken", BROKEN)):
        (ens / name / "1").mkdir(parents=True)
        (ens / name / "config.pbtxt").write_text(text)
    with service_and_gateway("onnx", ["--repository", str(model_repo)], ["--repository", str(ens)]) as (_, g):
        yield g


def run(proto: str, url: str, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    m = MODULES[proto]
    inp = m.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with m.InferenceServerClient(url) as c:
        res = c.infer(model, [inp])
        return {n: res.as_numpy(n) for n in ("T", "C")}


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_ensemble_runs_through_the_gateway(proto: str, gateway: Proc) -> None:
    url = getattr(gateway, proto)
    m = MODULES[proto]
    with m.InferenceServerClient(url) as c:
        assert c.is_model_ready("sum3")
        md = c.get_model_metadata("sum3")
        names = [i["name"] for i in md["inputs"]] if proto == "http" else [i.name for i in md.inputs]
        assert names == ["X"]
        cfg = c.get_model_config("sum3")
        assert (cfg["platform"] if proto == "http" else cfg.config.platform) == "ensemble"
        assert not c.is_model_ready("broken")
        index = c.get_model_repository_index()
        index = index if proto == "http" else [{"name": m.name, "state": m.state} for m in index.models]
        states = {m["name"]: m["state"] for m in index}
        assert states["sum3"] == "READY" and states["broken"] == "UNAVAILABLE" and states["add_sub"] == "READY"
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    out = run(proto, url, "sum3", x)
    np.testing.assert_allclose(out["T"], 3 * x, rtol=1e-6)
    np.testing.assert_allclose(out["C"], 2 * x, rtol=1e-6)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_ensemble_errors_name_the_step(proto: str, gateway: Proc) -> None:
    url = getattr(gateway, proto)
    with pytest.raises(InferenceServerException) as err:
        run(proto, url, "broken", np.ones((1, 16), np.float32))
    assert str(err.value.status()) in ("503", "StatusCode.UNAVAILABLE")
    assert "step 1 (model 'no_such_model')" in (err.value.message() or "")
    # a step the service refuses: batch 9 > add_sub's max_batch_size 8
    with pytest.raises(InferenceServerException) as err:
        run(proto, url, "sum3", np.ones((9, 16), np.float32))
    assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "ensemble 'sum3' step 0 (model 'add_sub')" in (err.value.message() or ""), err.value.message()


PARALLEL = models.ensemble_config("parallel", {"X": 4}, {"A": 4, "B": 4}, [
    models.step("sleep_a", {"IN": "X"}, {"OUT": "A"}), models.step("sleep_b", {"IN": "X"}, {"OUT": "B"})])


@pytest.mark.serial  # a latency bound: run alone (scripts/test.sh)
def test_two_independent_100ms_steps_finish_in_about_100ms(tmp_path: Path) -> None:
    import time

    (tmp_path / "parallel" / "1").mkdir(parents=True)
    (tmp_path / "parallel" / "config.pbtxt").write_text(PARALLEL)
    slow = start(["--delay-ms", "100"], timeout=30, module="tests.integration.slow_service")
    try:
        g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", slow.grpc,
                   "--repository", str(tmp_path), "--coalesce-inflight", "0"])
        try:
            _wait_http_ready(g.http)
            x = np.arange(8, dtype=np.float32).reshape(2, 4)
            with grpcclient.InferenceServerClient(g.grpc) as c:
                inp = grpcclient.InferInput("X", [2, 4], "FP32")
                inp.set_data_from_numpy(x)
                times = []
                for _ in range(6):
                    t0 = time.monotonic()
                    res = c.infer("parallel", [inp])
                    times.append(time.monotonic() - t0)
                np.testing.assert_array_equal(res.as_numpy("A"), x)
                np.testing.assert_array_equal(res.as_numpy("B"), x)
            best = sorted(times)[len(times) // 2]
            assert 0.1 <= best < 0.16, times  # serial would be >= 0.2
        finally:
            g.stop()
    finally:
        slow.stop()


def _stats(c: object, proto: str, model: str = "") -> dict[tuple[str, str], dict]:
    """{(name, version): stats as JSON} of one model's or (model "") every model's statistics."""
    raw = c.get_inference_statistics(model)  # type: ignore[attr-defined]
    if proto == "grpc":
        from google.protobuf.json_format import MessageToDict
        raw = MessageToDict(raw, preserving_proto_field_name=True)
    return {(s["name"], s["version"]): s for s in raw.get("model_stats", [])}


def _count(s: dict, *path: str) -> int:
    for key in path:
        s = s.get(key, {})
    return int(s or 0)  # type: ignore[call-overload]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_ensemble_statistics_count_its_requests_and_its_steps_count_theirs(proto: str, gateway: Proc) -> None:
    url = getattr(gateway, proto)
    m = MODULES[proto]
    with m.InferenceServerClient(url) as c:
        before = _stats(c, proto)
        for _ in range(3):
            run(proto, url, "sum3", np.ones((2, 16), np.float32))
        with pytest.raises(InferenceServerException):  # a failing step fails the ensemble request
            run(proto, url, "sum3", np.ones((9, 16), np.float32))
        after = _stats(c, proto)
        mine = _stats(c, proto, "sum3")
        assert list(mine) == [("sum3", "1")]
        with pytest.raises(InferenceServerException) as err:
            c.get_inference_statistics("sum3", "2")
        assert str(err.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), err.value
        with pytest.raises(InferenceServerException) as err:
            c.get_inference_statistics("broken")
        assert "not available" in (err.value.message() or ""), err.value
    assert ("broken", "1") not in after and ("broken", "") not in after  # not loaded: not listed
    e0, e1 = before.get(("sum3", "1"), {}), after[("sum3", "1")]
    assert mine[("sum3", "1")]["inference_stats"]["success"] == e1["inference_stats"]["success"]

    def grew(s0: dict, s1: dict, *path: str) -> int:
        return _count(s1, *path) - _count(s0, *path)

    # the ensemble: one success per request, one failure, batch rows counted, one queue entry and
    # one execution per successful request, compute time from its steps
    assert grew(e0, e1, "inference_stats", "success", "count") == 3
    assert grew(e0, e1, "inference_stats", "fail", "count") == 1
    assert grew(e0, e1, "inference_stats", "queue", "count") == 3
    assert grew(e0, e1, "inference_stats", "compute_infer", "count") == 3
    assert grew(e0, e1, "inference_stats", "compute_infer", "ns") > 0
    assert grew(e0, e1, "inference_count") == 6 and grew(e0, e1, "execution_count") == 3
    assert grew(e0, e1, "inference_stats", "success", "ns") > 0
    assert 2 in {int(b["batch_size"]) for b in e1["batch_stats"]}
    # the composing models count their own requests, in their service: add_sub runs twice per request
    # (the failing request stops at its first step, rejected there), identity_fp32 once
    a0, a1 = before[("add_sub", "1")], after[("add_sub", "1")]
    i0, i1 = before[("identity_fp32", "1")], after[("identity_fp32", "1")]
    assert grew(a0, a1, "inference_stats", "success", "count") == 6
    assert grew(i0, i1, "inference_stats", "success", "count") == 3


def test_ensemble_metrics_on_the_gateway(gateway: Proc) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    run("grpc", gateway.grpc, "sum3", np.ones((1, 16), np.float32))
    with urllib.request.urlopen(f"http://{gateway.http}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {(s.name, s.labels.get("model"), s.labels.get("reason")): s.value
             for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert found[("nv_inference_request_success_total", "sum3", None)] >= 1
    assert ("nv_inference_request_failure_total", "sum3", "OTHER") in found
    assert found[("nv_inference_first_response_histogram_ms_count", "sum3", None)] >= 1
    assert "\nnv_inference_request_success{" in text and "# TYPE nv_inference_request_success counter" in text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_on_an_ensemble(protocol: str, gateway: Proc, tmp_path: Path) -> None:
    """perf_analyzer reads all-model statistics around each window for an ensemble and needs the
    ensemble's and its composing models' entries to grow."""
    import csv
    import os
    import subprocess

    from tests.integration.test_perf_analyzer import TOOL

    if not TOOL.exists() and not os.environ.get("CI"):  # as test_perf_analyzer.py: CI has it
        pytest.skip(f"perf_analyzer wrapper not found at {TOOL}")
    report = tmp_path / "pa.csv"
    cmd = [str(TOOL), "-m", "sum3", "-u", getattr(gateway, protocol), "-i", protocol, "--concurrency-range", "2",
           "--measurement-interval", "200", "--stability-percentage", "999", "--max-trials", "8",
           "-f", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(report.open()))
    assert rows and float(rows[0]["Inferences/Second"]) > 5, rows
    assert "Composing models" in proc.stdout, proc.stdout[-3000:]
