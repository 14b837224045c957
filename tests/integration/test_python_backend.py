"""Triton python-backend models (model.py) in `meshserve service python`, through the gateway
with the real tritonclient: add_sub, BLS calling an ONNX model, faulty models, auto-complete,
an ensemble mixing python and onnx steps, and perf_analyzer."""
from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import os
import queue
import signal
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start, start_all
from tests.models import python_models
from tests.support import models
from tests.support.metrics import sample, scrape
from tests.support.net import free_port
from tests.support.waiting import eventually

MODULES = {"http": httpclient, "grpc": grpcclient}
PERF_ANALYZER = Path(__file__).resolve().parents[3] / "shared" / "tools" / "perf_analyzer"
W = python_models.WIDTH


@dataclass
class Mesh:
    python: Proc
    onnx: Proc
    gateway: Proc
    repo: Path
    gate: Path  # what the model 'gated' answers to is_ready() (python_models.GATED)
    cache: Path  # the python service's MESHSERVE_CACHE (in_env's environment is unpacked there)



@pytest.fixture(scope="module")
def mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A python service (BLS through the gateway), the ONNX service and a gateway running the
    mixed ensemble."""
    repo = python_models.build(tmp_path_factory.mktemp("python_models"))
    python_models.write(repo, "auto_complete_bad", python_models.AUTO_COMPLETE_BAD, None)
    python_models.write(repo, "faulty_init", python_models.FAULTY_INIT, python_models.config(
        "faulty_init", [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")],
        extra="instance_group [ { count: 2 kind: KIND_CPU } ]\n"))
    python_models.write(repo, "stub;name", python_models.FAULTY_INIT, python_models.config(
        "stub;name", [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")]))  # (a name Triton's stub refuses)
    gate = tmp_path_factory.mktemp("gate") / "word"
    gate.write_text("true")
    python_models.write(repo, "gated", python_models.GATED, python_models.config(
        "gated", [("X", "TYPE_FP32", "1")], [("PID", "TYPE_INT64", "1")],
        extra=f'parameters {{ key: "GATE" value: {{ string_value: "{gate}" }} }}\n'))
    python_models.write(repo, "late_answer", python_models.LATE_ANSWER, python_models.config(
        "late_answer", [("X", "TYPE_FP32", "2")], [("Y", "TYPE_FP32", "2")],
        extra='parameters { key: "execute_timeout_seconds" value: { string_value: "2" } }\n'))
    iterative = "sequence_batching { iterative_sequence: true max_sequence_idle_microseconds: 60000000 }\n"
    python_models.write(repo, "iterate", python_models.ITERATE, python_models.config(
        "iterate", [("IN", "TYPE_INT32", "1")], [("OUT", "TYPE_INT32", "1"), ("PID", "TYPE_INT64", "1"),
                                                 ("FLAGS", "TYPE_INT32", "1"), ("CORRID", "TYPE_UINT64", "1")],
        extra="model_transaction_policy { decoupled: true }\n" + iterative
              + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"))
    once = [("Y", "TYPE_FP32", "1"), ("PASSES", "TYPE_INT32", "1")]
    python_models.write(repo, "reschedule_once", python_models.RESCHEDULE_ONCE, python_models.config(
        "reschedule_once", [("X", "TYPE_FP32", "1")], once, extra=iterative))
    python_models.write(repo, "reschedule_plain", python_models.RESCHEDULE_ONCE, python_models.config(
        "reschedule_plain", [("X", "TYPE_FP32", "1")], once))
    backends = tmp_path_factory.mktemp("backends")
    (backends / "scaler").mkdir()
    (backends / "scaler" / "model.py").write_text(python_models.SCALER_BACKEND)
    for name, factor in (("scale3", 3), ("scale5", 5)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.json").write_text(f'{{"factor": {factor}}}')
        (repo / name / "config.pbtxt").write_text('backend: "scaler"\n')
    # a model with an execution environment of its own (EXECUTION_ENV_PATH): a venv packed as
    # conda-pack packs one, unpacked into the service's cache (a folder of this test's)
    in_env = python_models.write(repo, "in_env", python_models.WHERE_AM_I, python_models.config(
        "in_env", [("X", "TYPE_FP32", "1")], [("WHERE", "TYPE_STRING", "1")],
        extra='parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tgz" } }\n'))
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", "--system-site-packages", str(venv)],
                   check=True, timeout=60)
    with tarfile.open(in_env / "env.tgz", "w:gz") as tar:
        tar.add(venv, arcname=".")
    cache = tmp_path_factory.mktemp("cache")
    ens = tmp_path_factory.mktemp("python_ensembles")
    for name, text in (("mixed_pipeline", python_models.MIXED_ENSEMBLE),
                       ("mixed_all_kinds", python_models.MIXED_ALL_KINDS)):
        (ens / name / "1").mkdir(parents=True)
        (ens / name / "config.pbtxt").write_text(text)
    ts_repo = tmp_path_factory.mktemp("torchscript_models")
    with warnings.catch_warnings():  # (torch.jit.trace's deprecation notice)
        warnings.simplefilter("ignore", DeprecationWarning)
        models.write(ts_repo, "ts_add_sub", models.pair_config(
            "ts_add_sub", "pytorch_libtorch", W, ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1")),
            {1: models.torch_add_sub(W)}, "model.pt")
    gateway_grpc = free_port()
    procs: list[Proc] = []
    try:
        os.environ["MESHSERVE_CACHE"] = str(cache)  # (the services inherit it at launch: in_env's unpacked env)
        try:
            procs += start_all(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                                "--bls-target", f"127.0.0.1:{gateway_grpc}", "--backend-directory", str(backends)],
                               ["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0"],
                               ["service", "torchscript", "--repository", str(ts_repo), "--grpc-port", "0"], timeout=120)
        finally:
            os.environ.pop("MESHSERVE_CACHE", None)
        procs.append(start(["gateway", "--grpc-port", str(gateway_grpc), "--http-port", "0", "--repository", str(ens),
                            "--upstream", procs[0].grpc, "--upstream", procs[1].grpc, "--upstream", procs[2].grpc]))
        _wait_http_ready(procs[3].http)
        yield Mesh(procs[0], procs[1], procs[3], repo, gate, cache)
    finally:
        for p in reversed(procs):
            p.stop()


def pair(m, x: np.ndarray, y: np.ndarray, extra: list | None = None) -> list:
    ins = [m.InferInput("INPUT0", list(x.shape), "FP32"), m.InferInput("INPUT1", list(y.shape), "FP32")]
    ins[0].set_data_from_numpy(x)
    ins[1].set_data_from_numpy(y)
    return ins + (extra or [])


def add_sub(proto: str, url: str, rows: int = 1) -> None:
    m = MODULES[proto]
    x = np.random.default_rng().random((rows, W), dtype=np.float32)
    y = np.random.default_rng().random((rows, W), dtype=np.float32)
    with m.InferenceServerClient(url) as c:
        res = c.infer("py_add_sub", pair(m, x, y))
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), x + y, rtol=1e-6)
    np.testing.assert_allclose(res.as_numpy("OUTPUT1"), x - y, rtol=1e-6)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_add_sub_through_the_gateway(proto: str, mesh: Mesh) -> None:
    url = getattr(mesh.gateway, proto)
    add_sub(proto, url, rows=1)
    add_sub(proto, url, rows=3)
    with MODULES[proto].InferenceServerClient(url) as c:
        md = c.get_model_metadata("py_add_sub")
        platform = md["platform"] if proto == "http" else md.platform
        assert platform == "python"


@pytest.mark.parametrize("model", ["bls_sync", "bls_async"])
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_bls_calls_an_onnx_model_through_the_mesh(proto: str, model: str, mesh: Mesh) -> None:
    m = MODULES[proto]
    x = np.arange(W, dtype=np.float32)
    y = np.full(W, 0.5, dtype=np.float32)

    def call(target: str):
        name = m.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([target.encode()], dtype=np.object_))
        with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
            return c.infer(model, pair(m, x, y, [name]))

    res = call("add_sub")  # the ONNX add_sub, [N,16] batched: BLS sends [16]-shaped tensors as they came
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), x + y)
    np.testing.assert_allclose(res.as_numpy("OUTPUT1"), x - y)
    with pytest.raises(InferenceServerException) as err:
        call("no_such_model")
    assert "no_such_model" in (err.value.message() or "")
    message = err.value.message() or ""  # Triton's texts for both (measured on Triton 2.51)
    assert message.startswith(f"Failed to process the request(s) for model '{model}_0', message: "), message
    assert "TritonModelException: Model no_such_model - Error when running inference: " in message


def test_bls_decoupled_iterates_the_responses(mesh: Mesh) -> None:
    """exec(decoupled=True) over ModelStreamInfer: square_int32 answers IN=3 with three responses."""
    inp = grpcclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([3], dtype=np.int32))
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        res = c.infer("bls_decoupled", [inp])
    assert res.as_numpy("SUM")[0] == 9 and res.as_numpy("COUNT")[0] == 3


FAULTS = {
    "faulty_raise": ("INTERNAL", "Failed to process the request(s) for model 'faulty_raise_0', message: "
                     "ZeroDivisionError: division by zero\n\nAt:\n", "model.py(9): divide"),
    "faulty_error": ("INVALID_ARGUMENT", "INPUT0 is not welcome here", ""),
    "faulty_kill": ("UNAVAILABLE", "Stub process 'faulty_kill_0' is not healthy (killed by signal SIGKILL", ""),
    "faulty_hang": ("UNAVAILABLE", "execute() did not return within 1 s; the worker was killed", ""),
}


@pytest.mark.parametrize("model", sorted(FAULTS))
def test_a_faulty_model_gets_a_clear_error_while_add_sub_keeps_serving(model: str, mesh: Mesh) -> None:
    code, text, where = FAULTS[model]
    stop = threading.Event()
    served: list[int] = []
    failures: list[BaseException] = []

    def keep_serving() -> None:
        while not stop.is_set():
            try:
                add_sub("grpc", mesh.gateway.grpc)
                served.append(1)
            except BaseException as exc:
                failures.append(exc)
                return

    worker = threading.Thread(target=keep_serving)
    worker.start()
    try:
        inp = grpcclient.InferInput("INPUT0", [W], "FP32")
        inp.set_data_from_numpy(np.ones(W, dtype=np.float32))

        def faulty_call() -> InferenceServerException:
            with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c, \
                    pytest.raises(InferenceServerException) as err:
                c.infer(model, [inp], client_timeout=30)
            return err.value

        exc = faulty_call()
        assert exc.status() == f"StatusCode.{code}", exc
        assert text in (exc.message() or ""), exc.message()
        assert where in (exc.message() or "")
        if model in ("faulty_kill", "faulty_hang"):
            # the instance restarts (with backoff) and runs the next request again: the same error,
            # not "restarting"
            def again() -> bool:
                e = faulty_call()
                assert "restarting" not in (e.message() or ""), e.message()
                return text in (e.message() or "")
            eventually(again, timeout=30, what=f"{model} restarted and failed the same way again")
        eventually(lambda: len(served) >= 3, what="add_sub served while the faulty model failed")
    finally:
        stop.set()
        worker.join()
    assert failures == []


def test_a_model_that_fails_to_initialize_or_complete_is_unavailable_with_its_reason(mesh: Mesh) -> None:
    with httpclient.InferenceServerClient(mesh.python.http) as c:
        index = {m["name"]: m for m in c.get_model_repository_index()}
    bad = index["auto_complete_bad"]
    assert bad["state"] == "UNAVAILABLE"
    assert "input 'X' in auto-complete-config function for model 'auto_complete_bad' is missing 'dims' property" \
        in bad["reason"], bad
    init = index["faulty_init"]
    assert init["state"] == "UNAVAILABLE"
    assert "initialize() of instance 'faulty_init_0_0' failed: RuntimeError: the weights are missing" in init["reason"]
    assert "\n  1/model.py(6): initialize" in init["reason"], init  # (the model directory's path: not sent)
    assert index["py_add_sub"]["state"] == "READY"
    # a name with a character the python backend refuses in a stub's name (";|&$`<>()[]{}\\\"'*?~#!"):
    # its words, before any of the model's code runs; the reason names no path of this host
    stub = index["stub;name"]
    assert stub["state"] == "UNAVAILABLE" and "Invalid stub name: contains invalid characters" in stub["reason"], stub
    assert str(mesh.repo) not in stub["reason"], stub
    assert all(str(mesh.repo) not in m.get("reason", "") for m in index.values()), index


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_auto_complete_config_configures_a_model_without_config_pbtxt(proto: str, mesh: Mesh) -> None:
    m = MODULES[proto]
    with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
        got = c.get_model_config("auto_complete")
        cfg = got if proto == "http" else json_format.MessageToDict(got.config, preserving_proto_field_name=True)
        assert int(cfg["max_batch_size"]) == 4
        assert [i["name"] for i in cfg["input"]] == ["X"] and [o["name"] for o in cfg["output"]] == ["Y"]
        assert "dynamic_batching" in cfg
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        inp = m.InferInput("X", [2, 4], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_allclose(c.infer("auto_complete", [inp]).as_numpy("Y"), x * 3)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_ensemble_mixes_python_and_onnx_steps(proto: str, mesh: Mesh) -> None:
    """preprocess (python) -> add_sub (onnx) -> postprocess (python), and the same with a
    TorchScript step before postprocess: every step goes to the service of its kind."""
    m = MODULES[proto]
    raw = np.arange(2 * W, dtype=np.float32).reshape(2, W)
    inp = m.InferInput("RAW", [2, W], "FP32")
    inp.set_data_from_numpy(raw)
    with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
        total = c.infer("mixed_pipeline", [inp]).as_numpy("TOTAL")
        total_all_kinds = c.infer("mixed_all_kinds", [inp]).as_numpy("TOTAL")
    a, b = raw * 2, raw + 1
    s, d = a + b, a - b
    np.testing.assert_allclose(total, (s + d).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(total_all_kinds, ((s + d) + (s - d)).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("target", ["service", "gateway"])
def test_dynamic_batcher_hands_execute_a_list_of_requests(target: str, mesh: Mesh) -> None:
    """Four concurrent requests within the batch window reach one execute() as four
    InferenceRequests, each with its own parameters (not concatenated), sent to the service
    directly or through the gateway. They go out together on one HTTP/2 connection, so they
    reach the gateway in one read: its coalescer would merge them into one request for a batched
    ONNX model, and must not for a python model."""
    url = mesh.python.grpc if target == "service" else mesh.gateway.grpc

    async def run() -> list[tuple[np.ndarray, np.ndarray]]:
        async with grpcaio.InferenceServerClient(url) as c:
            async def one(i: int) -> tuple[np.ndarray, np.ndarray]:
                inp = grpcaio.InferInput("INPUT0", [1, 4], "FP32")
                inp.set_data_from_numpy(np.full((1, 4), i, dtype=np.float32))
                res = await c.infer("batch_probe", [inp], parameters={"tag": f"r{i}"})
                return res.as_numpy("COUNT"), res.as_numpy("PARAMS")
            return list(await asyncio.gather(*(one(i) for i in range(4))))

    results = asyncio.run(run())
    for i, (count, params) in enumerate(results):
        assert count.shape == (1, 4) and int(count[0, 0]) == 4, count
        assert params[0, 0] == f'{{"tag":"r{i}"}}'.encode()  # compact JSON, as Triton gives it


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_sequence_batching_keeps_each_sequence_on_one_instance_in_order(proto: str, mesh: Mesh) -> None:
    """Two interleaved sequences through the gateway: each request sees its sequence's running
    sum (the model keeps it in the instance by correlation id) and START/END flags."""
    m = MODULES[proto]
    base = 7000 + (proto == "grpc") * 100

    def step(c, seq: int, value: int, start: bool = False, end: bool = False) -> tuple[int, bytes]:
        inp = m.InferInput("IN", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
        res = c.infer("accumulate", [inp], sequence_id=seq, sequence_start=start, sequence_end=end)
        return int(res.as_numpy("SUM")[0, 0]), res.as_numpy("WHERE")[0, 0]

    with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
        a, b = base + 1, base + 2
        sums_a, where_a = zip(*[step(c, a, 1, start=True), step(c, a, 2), step(c, a, 3, end=True)], strict=True)
        assert sums_a == (1, 3, 6) and len(set(where_a)) == 1
        first = step(c, b, 10, start=True)
        second = step(c, base + 3, 5, start=True)  # a second sequence meanwhile
        assert (first[0], second[0]) == (10, 5)
        assert step(c, b, 20, end=True)[0] == 30 and step(c, base + 3, 1, end=True)[0] == 6
        with pytest.raises(InferenceServerException) as err:
            step(c, base + 4, 1)  # no START for a sequence that is not active
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), err.value
        assert f"sequence {base + 4} to model 'accumulate' must specify the START flag" in (err.value.message() or "")
        inp = m.InferInput("IN", [1, 1], "INT32")
        inp.set_data_from_numpy(np.array([[1]], dtype=np.int32))
        with pytest.raises(InferenceServerException) as err:
            c.infer("accumulate", [inp])
        assert "must specify a non-zero or non-empty correlation ID" in (err.value.message() or "")


def test_a_request_past_its_deadline_is_cancelled_in_the_model(mesh: Mesh) -> None:
    """wait_for_cancel runs until request.is_cancelled(): a gRPC client's 1 s deadline (it travels
    to the service) passing while execute() runs cancels the request in the model."""
    before = "".join(mesh.python.output).count("wait_for_cancel: cancelled")
    inp = grpcclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with grpcclient.InferenceServerClient(mesh.python.grpc) as c, pytest.raises(InferenceServerException) as err:
        c.infer("wait_for_cancel", [inp], client_timeout=1)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    eventually(lambda: "".join(mesh.python.output).count("wait_for_cancel: cancelled") > before, timeout=15,
               what="the model saw request.is_cancelled()")


def test_custom_metrics_of_every_instance_on_the_services_metrics(mesh: Mesh) -> None:
    """counted (2 instances) counts its requests and sets a gauge: /metrics shows one counter
    summed over the instances and the gauge's last value, as Triton's one process would."""
    before = scrape(mesh.python.http).get(("counted_requests", frozenset({("model", "counted")})), 0.0)
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]

    def one(v: float) -> None:
        inp = grpcclient.InferInput("X", [1], "FP32")
        inp.set_data_from_numpy(np.array([v], dtype=np.float32))
        with grpcclient.InferenceServerClient(mesh.python.grpc) as c:
            c.infer("counted", [inp])

    threads = [threading.Thread(target=one, args=(v,)) for v in values[:-1]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    one(values[-1])  # the last one set: the gauge shows it
    samples = scrape(mesh.python.http)
    assert sample(samples, "counted_requests", model="counted") == before + len(values)
    assert sample(samples, "counted_last_input", model="counted") == values[-1]


def test_model_warmup_runs_before_the_model_serves(mesh: Mesh) -> None:
    """warmed counts what its instance executed: its three warmup requests ran at load."""
    inp = httpclient.InferInput("X", [1, 1], "FP32")
    inp.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    with httpclient.InferenceServerClient(mesh.python.http) as c:
        seen = int(c.infer("warmed", [inp]).as_numpy("SEEN")[0, 0])
    assert seen == 3 + 1


def test_instances_are_processes_and_a_killed_one_comes_back(mesh: Mesh) -> None:
    """py_add_sub has two instances: two worker processes. Killing one from outside fails at most
    its in-flight requests; it restarts; add_sub serves throughout."""
    def workers() -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(mesh.python.proc.pid), "-f", "services.python.worker"],
                             capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]

    before = workers()
    assert len(before) >= 2 + 1  # py_add_sub's two, and the other models' one each
    victim = max(before)
    os.kill(victim, signal.SIGKILL)
    eventually(lambda: victim not in workers() and len(workers()) == len(before), timeout=30,
               what="the killed worker replaced")
    for _ in range(4):
        add_sub("http", mesh.gateway.http)


def _gated_ready(mesh: Mesh) -> tuple[bool, bool]:
    """'gated' model readiness through the gateway, over HTTP and over gRPC."""
    with httpclient.InferenceServerClient(mesh.gateway.http) as h, \
            grpcclient.InferenceServerClient(mesh.gateway.grpc) as g:
        return h.is_model_ready("gated"), g.is_model_ready("gated")


def _gated_pid(mesh: Mesh, proto: str = "http") -> int:
    m = MODULES[proto]
    inp = m.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
        return int(c.infer("gated", [inp]).as_numpy("PID")[0])


def test_the_models_is_ready_decides_model_readiness_and_inference_goes_on(mesh: Mesh) -> None:
    """TritonPythonModel.is_ready() (the python backend's user-defined readiness): asked at each
    readiness check, over both protocols, through the gateway; False, an exception, or a result
    that is not a bool make the model not ready; a returned coroutine is awaited. Inference is
    not gated by it (as in Triton: readiness is what orchestrators route by)."""
    cases = [("true", (True, True)), ("false", (False, False)), ("raise", (False, False)),
             ("none", (False, False)), ("async", (True, True))]
    try:
        for word, expected in cases:
            mesh.gate.write_text(word)
            assert _gated_ready(mesh) == expected, word
            assert _gated_pid(mesh, "http") == _gated_pid(mesh, "grpc") > 0, word
    finally:
        mesh.gate.write_text("true")
    # still a healthy mesh after the failing checks
    assert _gated_ready(mesh) == (True, True)


def test_a_slow_is_ready_times_out_once_and_a_later_check_shares_it(mesh: Mesh) -> None:
    """An is_ready() slower than the 5 s bound: that check says not ready when the bound passes,
    inference goes on meanwhile, and a check that comes while it still runs waits for it (one
    call in the model, not two) and takes its answer."""
    calls = mesh.gate.with_name(mesh.gate.name + ".calls")
    calls.unlink(missing_ok=True)
    mesh.gate.write_text("sleep 7")
    try:
        with httpclient.InferenceServerClient(mesh.gateway.http, network_timeout=30) as h:
            t0 = time.monotonic()
            assert h.is_model_ready("gated") is False
            assert time.monotonic() - t0 >= 4.9  # it waited for the bound, not less
        assert _gated_pid(mesh) > 0  # served while is_ready() still runs
        with grpcclient.InferenceServerClient(mesh.gateway.grpc) as g:
            assert g.is_model_ready("gated") is True  # the same check's answer, once it came
        assert calls.read_text().splitlines() == ["check"]
    finally:
        mesh.gate.write_text("true")


def test_a_killed_worker_is_not_ready_until_it_is_back(mesh: Mesh) -> None:
    """A model whose worker died is not ready (Triton: "Stub process '<instance>' is not
    healthy."), and ready again once the service restarted it."""
    mesh.gate.write_text("true")
    victim = _gated_pid(mesh)
    os.kill(victim, signal.SIGKILL)
    eventually(lambda: _gated_ready(mesh) == (False, False), timeout=30, interval=0.01,
               what="'gated' not ready while its worker is down")
    eventually(lambda: _gated_ready(mesh) == (True, True), timeout=30, what="'gated' ready again")
    assert _gated_pid(mesh) != victim


def _late(proto: str, mesh: Mesh, x: list[float]) -> np.ndarray:
    m = MODULES[proto]
    inp = m.InferInput("X", [2], "FP32")
    inp.set_data_from_numpy(np.array(x, dtype=np.float32))
    with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
        return c.infer("late_answer", [inp]).as_numpy("Y")


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_model_that_is_not_decoupled_answers_after_execute_returned(proto: str, mesh: Mesh) -> None:
    """execute() returns None for a request and a thread answers it later through its response
    sender (Triton 2.51, NVIDIA's response_sender QA models): the client gets that answer. The
    instance serves the next requests meanwhile, and each late answer reads its own request's
    inputs (the region they came in is not written over by the requests that ran since)."""
    assert _late(proto, mesh, [0, 3]).tolist() == [0, 6]
    values = [[1, float(v)] for v in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda x: _late(proto, mesh, x).tolist(), values))
    assert got == [[2, 2 * v] for _, v in values]


def test_a_request_execute_left_open_and_never_answered_ends_with_an_error(mesh: Mesh) -> None:
    """Triton leaves such a request open until its client gives up; here it ends at the model's
    execute timeout (2 s for late_answer) with the instance's error, and the instance, never
    killed for it, serves on."""
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        inp = grpcclient.InferInput("X", [2], "FP32")
        inp.set_data_from_numpy(np.array([2, 0], dtype=np.float32))
        with pytest.raises(InferenceServerException) as err:
            c.infer("late_answer", [inp], client_timeout=30)
    assert err.value.status() == "StatusCode.INTERNAL", err.value
    assert "execute() returned without a response for the request and its response sender sent none within 2 s" \
        in (err.value.message() or "")
    assert _late("grpc", mesh, [1, 5]).tolist() == [2, 10]


def test_an_iterative_sequence_reschedules_a_request_on_its_instance_until_it_is_done(mesh: Mesh) -> None:
    """sequence_batching { iterative_sequence: true }: the model releases a request with
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE and it runs again in a later batch, on the same
    instance (its state is there), with an id of the service's (no sequence_id sent) and START on
    its first pass only (Triton's IterativeSequencer). Four streams at once over two instances,
    through the gateway: each gets its three responses, then the final."""
    def one_stream(_: int) -> list[tuple[int, int, int, int]]:
        got: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
            c.start_stream(callback=lambda result, error: got.put(error or result))
            inp = grpcclient.InferInput("IN", [1], "INT32")
            inp.set_data_from_numpy(np.array([3], dtype=np.int32))
            c.async_stream_infer("iterate", [inp], enable_empty_final_response=True)
            rows = []
            while True:
                item = got.get(timeout=30)
                assert not isinstance(item, InferenceServerException), item
                if item.get_response().parameters["triton_final_response"].bool_param and \
                        not item.get_response().outputs:
                    break
                rows.append(tuple(int(item.as_numpy(n)[0]) for n in ("OUT", "PID", "FLAGS", "CORRID")))
                if item.get_response().parameters["triton_final_response"].bool_param:
                    break
            c.stop_stream()
        return rows

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = list(pool.map(one_stream, range(4)))
    for rows in streams:
        assert [r[0] for r in rows] == [2, 1, 0], rows
        assert len({r[1] for r in rows}) == 1, rows  # one instance
        assert [r[2] for r in rows] == [1, 0, 0], rows  # START on the first pass
        assert len({r[3] for r in rows}) == 1 and rows[0][3] != 0, rows
    assert len({rows[0][3] for rows in streams}) == 4  # a sequence each


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_rescheduled_request_that_is_not_decoupled_gets_its_later_answer(proto: str, mesh: Mesh) -> None:
    """Not decoupled: None in the request's place, then its answer on the next pass. Each request
    ends its sequence (the model's single sequence slot is free at once for the next one; the
    idle bound is 60 s)."""
    m = MODULES[proto]
    url = getattr(mesh.gateway, proto)
    # (a 20 s bound on each call: a sequence left open would hold the slot for 60 s)
    with (grpcclient.InferenceServerClient(url) if proto == "grpc" else
          httpclient.InferenceServerClient(url, network_timeout=20)) as c:
        for x in range(5):
            inp = m.InferInput("X", [1], "FP32")
            inp.set_data_from_numpy(np.array([x], dtype=np.float32))
            kwargs = {"client_timeout": 20} if proto == "grpc" else {}
            result = c.infer("reschedule_once", [inp], **kwargs)
            assert result.as_numpy("Y").tolist() == [2 * x] and result.as_numpy("PASSES").tolist() == [2]


def test_rescheduling_in_a_model_that_is_not_iterative_is_refused_in_tritons_words(mesh: Mesh) -> None:
    inp = httpclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([1], dtype=np.float32))
    with httpclient.InferenceServerClient(mesh.gateway.http) as c, pytest.raises(InferenceServerException) as err:
        c.infer("reschedule_plain", [inp])
    assert "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is not configured " \
           "to handle such a flag." in str(err.value)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_python_based_backend_serves_the_models_that_name_it(proto: str, mesh: Mesh) -> None:
    """Triton's python-based backends: ``backend: "scaler"`` with --backend-directory holding
    scaler/model.py; each model's folder has its model.json only (read from get_model_dir(), the
    model's version folder), its inputs from the backend's auto_complete_config."""
    m = MODULES[proto]
    with m.InferenceServerClient(getattr(mesh.gateway, proto)) as c:
        for name, factor in (("scale3", 3), ("scale5", 5)):
            inp = m.InferInput("X", [1], "FP32")
            inp.set_data_from_numpy(np.array([2.0], dtype=np.float32))
            assert c.infer(name, [inp]).as_numpy("Y").tolist() == [2.0 * factor]
        config = c.get_model_config("scale3")
    config = config if proto == "http" else json_format.MessageToDict(config.config, preserving_proto_field_name=True)
    assert config["backend"] == "scaler" and [i["name"] for i in config["input"]] == ["X"]


def test_a_model_runs_in_its_execution_environment(mesh: Mesh) -> None:
    """EXECUTION_ENV_PATH ($$TRITON_MODEL_DIRECTORY/env.tgz, a packed environment): the model's
    worker runs that environment's python, unpacked once into the service's cache."""
    inp = grpcclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.zeros(1, dtype=np.float32))
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        where = Path(c.infer("in_env", [inp]).as_numpy("WHERE")[0].decode())
    unpacked = [p for p in (mesh.cache / "python-envs").iterdir() if (p / ".complete").exists()]
    assert len(unpacked) == 1 and where == unpacked[0], (where, unpacked)
    assert where != Path(sys.prefix)


@pytest.mark.skipif(not PERF_ANALYZER.exists(), reason=f"perf_analyzer wrapper not found at {PERF_ANALYZER}")
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_against_python_add_sub(protocol: str, mesh: Mesh, tmp_path: Path) -> None:
    url = getattr(mesh.gateway, protocol)
    report = tmp_path / "pa.csv"
    cmd = [str(PERF_ANALYZER), "-m", "py_add_sub", "-u", url, "-i", protocol, "--concurrency-range", "1:4:3",
           "--measurement-interval", "200", "--stability-percentage", "999", "--max-trials", "8", "-f", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(report.open()))
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 4]
    for r in rows:
        assert float(r["Inferences/Second"]) > 10
        assert 0 < int(r["p99 latency"]) < 1_000_000
