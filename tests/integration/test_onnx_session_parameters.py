"""Triton's onnxruntime backend parameters in a model's config.pbtxt keep working in the ONNX
service (README: threads, execution mode, arena, memory pattern, graph level, and any `session.*`
key as an onnxruntime session config entry, e.g. bounded spinning), driven by the real
tritonclient over both protocols; the answers are the model's."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from services.onnx import runtime
from services.onnx.runtime import session_options
from tests.conftest import Proc, start
from tests.support import models

PARAMETERS = {
    "intra_op_thread_count": "2", "inter_op_thread_count": "1", "execution_mode": "0",
    "enable_mem_arena": "1", "enable_mem_pattern": "1",
    "session.intra_op.allow_spinning": "1", "session.intra_op.spin_duration_us": "10",
}
CONFIG = """name: "tuned"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
optimization { graph { level: 1 } }
dynamic_batching { max_queue_delay_microseconds: 500 }
""" + "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in PARAMETERS.items())


def expected(x: np.ndarray) -> np.ndarray:
    """models.small_mlp(7) in numpy."""
    rng = np.random.default_rng(7)
    w1 = (rng.standard_normal((64, 256)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((256, 64)) * 0.1).astype(np.float32)
    return np.maximum(x @ w1, 0) @ w2


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("tuned")
    models.write(repo, "tuned", CONFIG, {1: models.small_mlp(7)})
    svc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    yield svc
    svc.stop()


def test_parameters_reach_onnxruntime() -> None:
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc

    so = session_options(text_format.Parse(CONFIG, mc.ModelConfig()))
    assert so.intra_op_num_threads == 2 and so.inter_op_num_threads == 1
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "1"  # the model's, not the default
    assert so.get_session_config_entry("session.intra_op.spin_duration_us") == "10"
    assert so.get_session_config_entry("session.inter_op.allow_spinning") == "0"  # meshserve's default kept
    plain = session_options(mc.ModelConfig(name="plain"))
    assert plain.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_intra_op_threads_default_to_half_the_cpus_and_the_config_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `intra_op_thread_count`: half the CPUs the process may run on, at least 1, set explicitly
    (onnxruntime's own default, 0, pins its pool threads to cores); a config's value, 0 included
    (onnxruntime's default, as Triton passes it), is used as written."""
    from meshserve._proto import model_config_pb2 as mc

    for cpus, want in ((1, 1), (2, 1), (3, 1), (4, 2), (16, 8)):
        monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert runtime.default_intra_threads() == want
        assert session_options(mc.ModelConfig(name="plain")).intra_op_num_threads == want
    for value in ("0", "1", "3"):
        config = mc.ModelConfig(name="set")
        config.parameters["intra_op_thread_count"].string_value = value
        assert session_options(config).intra_op_num_threads == int(value)


def _affinities(pid: int) -> dict[int, str]:
    """tid -> Cpus_allowed_list of every thread of ``pid``."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        status = (t / "status").read_text()
        out[int(t.name)] = status.split("Cpus_allowed_list:", 1)[1].split()[0]
    return out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 CPUs to narrow the service to one")
def test_a_service_started_on_one_cpu_keeps_its_onnxruntime_threads_there(tmp_path: Path) -> None:
    """A service started on one CPU (as `taskset -c N` or the bench's --pin start it) with a model
    whose config sets no thread count: none of its threads runs elsewhere. (onnxruntime's default
    made a pool thread per physical core of the machine and pinned the first to core 1 whatever
    the process's CPU set.) Its answers are the model's."""
    models.write(tmp_path, "plain", CONFIG.split("optimization")[0].replace('"tuned"', '"plain"'),
                 {1: models.small_mlp(7)})
    mine = os.sched_getaffinity(0)
    one = min(mine)
    os.sched_setaffinity(0, {one})  # (the service inherits it)
    try:
        svc = start(["service", "onnx", "--repository", str(tmp_path), "--grpc-port", "0", "--http-port", "0"])
    finally:
        os.sched_setaffinity(0, mine)
    try:
        x = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
        with httpclient.InferenceServerClient(svc.http) as c:
            inp = httpclient.InferInput("INPUT0", [2, 64], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = c.infer("plain", [inp]).as_numpy("OUTPUT0")
        np.testing.assert_allclose(out, expected(x), rtol=1e-4, atol=1e-5)
        got = _affinities(svc.proc.pid)
        assert set(got.values()) == {str(one)}, got
    finally:
        svc.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_model_with_backend_parameters_serves_its_answers(service: Proc, protocol: str) -> None:
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    if protocol == "grpc":
        with grpcclient.InferenceServerClient(service.grpc) as c:
            inp = grpcclient.InferInput("INPUT0", [3, 64], "FP32")
            inp.set_data_from_numpy(x)
            out = c.infer("tuned", [inp]).as_numpy("OUTPUT0")
            config = c.get_model_config("tuned", as_json=True)["config"]
    else:
        with httpclient.InferenceServerClient(service.http) as c:
            inp = httpclient.InferInput("INPUT0", [3, 64], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = c.infer("tuned", [inp]).as_numpy("OUTPUT0")
            config = c.get_model_config("tuned")
    assert out is not None and out.shape == (3, 64)
    np.testing.assert_allclose(out, expected(x), rtol=1e-4, atol=1e-5)
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert params == PARAMETERS  # the config as written, as Triton reports it
