"""NVIDIA's own QA tests of the Python backend (triton-inference-server/server
qa/L0_backend_python), run unchanged as subprocesses against `meshserve up` serving the models each
subtest's test.sh copies from qa/python_models, on the ports the tests hard-code (8000-8002).

What each run covers, and what is left out and why (each a difference docs/python-backend.md or
docs/observability.md names, or a GPU the machine lacks):

- ``python_test.py`` (the main suite: datatypes, strings of fixed width, BF16, optional inputs,
  init args, async infer, torch): all but ``test_growth_error`` (a 1 GiB request: meshserve refuses
  it at --max-request-bytes, 413, before any shared-memory pool could grow) and
  ``test_async_infer`` (it matches ``nv_inference_request_success{model=...,version="1"}`` as text:
  the gateway's federated /metrics labels each sample with its ``replica``);
- ``decoupled``: all but ``test_decoupled_bls`` (its model moves tensors to CUDA);
- ``lifecycle``: all but ``test_infer_pymodel_error`` (the federated /metrics text, as above);
- ``model_readiness``: the user-defined ``is_ready()`` suite whole, and the initial readiness check;
  not test.sh's kill of the stub then ``test_model_not_ready`` (meshserve restarts a dead worker,
  Triton leaves the model not ready);
- ``response_sender``, ``parameters``, ``argument_validation``, ``async_execute``, ``custom_metrics``,
  ``request_rescheduling``, ``logging``, ``python_based_backends``: whole (``logging``: test.sh's
  line counts, checked here);
- ``model_control``: under its own command line (`meshserve tritonserver`), all but
  ``test_invalid_character_model_names`` (one of its names has a '\\', which meshserve's name rule
  refuses for every backend in its own words);
- ``bls``: its parameters, init-error and finalize-error parts (the rest needs NVIDIA's data
  volume of models and CUDA); ``ensemble``: its CPU case (its GPU case: CUDA); ``io``:
  its CPU case, ``test_requested_output_default`` (the others move tensors to CUDA).

With MESHSERVE_NVIDIA_PYTHON_BACKEND (a python_backend snapshot's folder holding ``examples/``),
NVIDIA's python_backend examples run too, as qa/L0_backend_python/examples/test.sh runs them.

TEST_JETSON=1 for the test processes: it turns off the probes of Triton's stub shared-memory
regions under /dev/shm (meshserve's workers use anonymous memfd regions) and the CUDA-only tests,
as on NVIDIA's Jetson runs.

The QA folder is not in this tree: point MESHSERVE_NVIDIA_QA at the ``qa`` folder of a server
snapshot holding ``L0_backend_python``, ``python_models`` and ``common`` (docs/nvidia-examples.md);
without it the tests are skipped. Nothing here needs the network.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from tests.support.up import meshserve_up

ENV = "MESHSERVE_NVIDIA_QA"
QA = Path(os.environ[ENV]) if os.environ.get(ENV) else None
PORTS = ("--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002")  # (the tests' own)
# `meshserve tritonserver` (test.sh's own SERVER_ARGS) on loopback: Triton's ports, its default address narrowed
LOOPBACK = ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1")

pytestmark = pytest.mark.skipif(QA is None or not (QA / "L0_backend_python").is_dir(),
                                reason=f"{ENV} is not set to a qa folder with L0_backend_python (NVIDIA's server "
                                "repository; docs/nvidia-examples.md says how to get it)")


def _model(repo: Path, name: str, src: str | None = None, *, files: Sequence[str] = ("model.py",),
           rename: dict[str, str] | None = None, append: str = "", main: str = "model.py") -> None:
    """As test.sh does: qa/python_models/SRC's files into REPO/NAME/1 (``main`` as model.py), its
    config.pbtxt with ``name`` set to NAME, the ``rename`` replacements and ``append`` added."""
    assert QA is not None
    source = QA / "python_models" / (src or name)
    (repo / name / "1").mkdir(parents=True)
    for f in files:
        shutil.copy(source / f, repo / name / "1" / ("model.py" if f == main else f))
    lines = [f'name: "{name}"' if line.startswith("name:") else line
             for line in (source / "config.pbtxt").read_text().splitlines()]
    text = "\n".join(lines) + "\n"
    for old, new in (rename or {}).items():
        text = text.replace(old, new)
    (repo / name / "config.pbtxt").write_text(text + append)


def _run(folder: Path, test_file: str, deselect: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
    """NVIDIA's ``test_file`` with pytest, from its own folder (as test.sh runs it), every test but
    ``deselect``; it must pass."""
    assert QA is not None
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", test_file]
    for name in deselect:
        args += ["--deselect", f"{test_file}::{name}"]
    run_env = {**os.environ, "TEST_JETSON": "1", "PYTHONPATH": str(QA / "common"), **(env or {})}
    done = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=600, env=run_env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]  # (something ran: not every test skipped)


def _qa(tmp_path: Path, name: str) -> Path:
    """A copy of qa/L0_backend_python (its tests, not models or logs) under ``tmp_path``, and the
    subtest folder ``name`` in it: the tests write beside themselves (reports, the server's log)."""
    assert QA is not None
    copy = tmp_path / "L0_backend_python"
    if not copy.exists():
        shutil.copytree(QA / "L0_backend_python", copy, ignore=shutil.ignore_patterns("models", "*.log"))
    return copy / name


def test_python_test(tmp_path: Path) -> None:
    # init_args checks its model_repository against $TRITON_DIR/qa/L0_backend_python/models/init_args
    repo = tmp_path / "qa" / "L0_backend_python" / "models"
    _model(repo, "identity_fp32")
    _model(repo, "identity_bf16")
    for name, kind, extra in (("identity_uint8", "TYPE_UINT8", "dynamic_batching { preferred_batch_size: [8], "
                               "max_queue_delay_microseconds: 12000000 }\n"),
                              ("identity_uint32", "TYPE_UINT32", ""), ("identity_bool", "TYPE_BOOL", "")):
        _model(repo, name, "identity_fp32", rename={"TYPE_FP32": kind}, append=extra)
    text = (repo / "identity_uint8" / "config.pbtxt").read_text()
    (repo / "identity_uint8" / "config.pbtxt").write_text(
        "\n".join("max_batch_size: 8" if line.startswith("max_batch_size:") else line for line in text.splitlines()))
    _model(repo, "identity_uint8_nobatch", "identity_fp32", rename={"TYPE_FP32": "TYPE_UINT8"})
    text = (repo / "identity_uint8_nobatch" / "config.pbtxt").read_text()
    (repo / "identity_uint8_nobatch" / "config.pbtxt").write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith("max_batch_size:")) + "\n")
    _model(repo, "default_model_name", "identity_fp32", append='default_model_filename: "mymodel.py"\n')
    (repo / "default_model_name" / "1" / "model.py").rename(repo / "default_model_name" / "1" / "mymodel.py")
    for name in ("pytorch_fp32_fp32", "delayed_model", "init_args", "optional", "non_contiguous", "string",
                 "string_fixed", "dlpack_identity"):
        _model(repo, name)
    with meshserve_up("--repository", str(repo), *PORTS, timeout=240, env={"TRITON_DIR": str(tmp_path)}):
        _run(_qa(tmp_path, ""), "python_test.py", ["PythonTest::test_growth_error", "PythonTest::test_async_infer"])


def test_decoupled(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(QA / "L0_backend_python" / "decoupled" / "models", repo)  # type: ignore[operator]
    _model(repo, "identity_fp32")
    _model(repo, "execute_cancel", append="model_transaction_policy { decoupled: True }\n")
    _model(repo, "response_sender_until_cancelled")
    _model(repo, "dlpack_add_sub")
    _run_with(repo, _qa(tmp_path, "decoupled"), "decoupled_test.py", ["DecoupledTest::test_decoupled_bls"],
              log="decoupled_server.log")


def test_response_sender(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    decoupled = "model_transaction_policy { decoupled: True }\n"
    batching = "dynamic_batching { max_queue_delay_microseconds: 500000 }\n"
    for name, main, extra in (
            ("response_sender", "model.py", ""), ("response_sender_decoupled", "model.py", decoupled),
            ("response_sender_async", "model_async.py", ""),
            ("response_sender_decoupled_async", "model_async.py", decoupled),
            ("response_sender_batching", "model.py", batching),
            ("response_sender_decoupled_batching", "model.py", decoupled + batching),
            ("response_sender_async_batching", "model_async.py", batching),
            ("response_sender_decoupled_async_batching", "model_async.py", decoupled + batching)):
        _model(repo, name, "response_sender", files=("model_common.py", main), main=main, append=extra)
    _run_with(repo, _qa(tmp_path, "response_sender"), "response_sender_test.py")


def test_lifecycle(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for name in ("error_code", "execute_cancel", "decoupled_grpc_error", "execute_return_error"):
        _model(repo, name)
    for name, pause in (("execute_error", 12000000), ("execute_grpc_error", 1200000)):
        _model(repo, name, append=f"dynamic_batching {{ preferred_batch_size: [8], max_queue_delay_microseconds: "
                                  f"{pause} }}\n")
        text = (repo / name / "config.pbtxt").read_text()
        (repo / name / "config.pbtxt").write_text(
            "\n".join("max_batch_size: 8" if line.startswith("max_batch_size:") else line
                      for line in text.splitlines()) + "\n")
    _model(repo, "wrong_model", rename={"TYPE_FP32": "TYPE_UINT32"})
    _run_with(repo, _qa(tmp_path, "lifecycle"), "lifecycle_test.py", ["LifecycleTest::test_infer_pymodel_error"],
              log="lifecycle_server.log")


def test_parameters(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for name in ("response_parameters", "response_parameters_decoupled", "response_parameters_bls"):
        _model(repo, name)
    _run_with(repo, _qa(tmp_path, "parameters"), "response_parameters_test.py")


def test_argument_validation(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(QA / "L0_backend_python" / "argument_validation" / "models", repo)  # type: ignore[operator]
    _run_with(repo, _qa(tmp_path, "argument_validation"), "../test_infer_shm_leak.py",
              env={"MODEL_NAME": "argument_validation"})


def test_request_rescheduling(tmp_path: Path) -> None:
    """Requests a model releases with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE run again (iterative
    sequence batching): through BLS (its model unloads and loads them by model control) and from
    a gRPC client, decoupled and not, and a model that returns a response for one is refused."""
    repo = tmp_path / "models"
    for name in ("bls_request_rescheduling", "request_rescheduling_addsub", "iterative_sequence", "wrong_return_type"):
        _model(repo, name)
    folder = _qa(tmp_path, "request_rescheduling")
    # (test.sh's --model-control-mode=explicit --load-model=*: `up`'s default, every model loaded)
    with meshserve_up("--repository", str(repo), *PORTS, timeout=240):
        _run(folder, "../test_infer_shm_leak.py", env={"MODEL_NAME": "bls_request_rescheduling"})
        _run(folder, "grpc_endpoint_test.py")


def test_logging(tmp_path: Path) -> None:
    """test.sh's three servers, each serving identity_fp32_logging for logging_test.py, then the
    model's lines counted in the server's log (its finalize() ones at the stop included): by
    default, after /v2/logging log_verbose_level 1, and after log_info, log_warning and
    log_error false (set at the gateway: they reach the model's worker)."""
    repo = tmp_path / "models"
    _model(repo, "identity_fp32_logging")
    folder = _qa(tmp_path, "logging")
    lines = ("Specific Msg!", "Info Msg!", "Warning Msg!", "Error Msg!", "Verbose Msg!")
    for settings, (shown, verbose) in (({}, (4, 0)), ({"log_verbose_level": 1}, (4, 3)),
                                       ({"log_info": False, "log_warning": False, "log_error": False}, (1, 0))):
        server_log = folder / "logging_server.log"
        with meshserve_up("--repository", str(repo), *PORTS, timeout=240) as up:
            up.tee(server_log)
            if settings:
                with httpclient.InferenceServerClient("localhost:8000") as c:
                    c.update_log_settings(settings)
            _run(folder, "logging_test.py")
            up.stop()
        text = server_log.read_text()
        assert [text.count(line) for line in lines] == [shown] * 4 + [verbose], (settings, text[-3000:])
        server_log.unlink()


def test_python_based_backends(tmp_path: Path) -> None:
    """A backend written in Python (``backend: "add_sub"``, its model.py in the backend directory,
    each model's folder holding only its model.json): `meshserve tritonserver` with test.sh's own
    command line, the repository as test.sh lays it out, beside a python model and a TorchScript
    one made by NVIDIA's generator; the client loads each (one with a config override naming the
    backend)."""
    assert QA is not None
    backends, repo = tmp_path / "backends", tmp_path / "models"
    (backends / "add_sub").mkdir(parents=True)
    shutil.copy(QA / "python_models" / "python_based_backends" / "add_sub_backend" / "model.py",
                backends / "add_sub" / "model.py")
    for name, operation, versions in (("add", "add", (1, 2)), ("sub", "sub", (1,))):
        for v in versions:
            (repo / name / str(v)).mkdir(parents=True)
            (repo / name / str(v) / "model.json").write_text(f'{{ "operation": "{operation}" }}\n')
        (repo / name / "config.pbtxt").write_text('backend: "add_sub"\n')
    _model(repo, "add_sub")
    shutil.copytree(repo / "add_sub" / "1", repo / "add_sub" / "2")
    subprocess.run([sys.executable, str(QA / "common" / "gen_qa_pytorch_model.py"), "-m", str(repo)], check=True,
                   capture_output=True, timeout=300)
    folder = _qa(tmp_path, "python_based_backends")
    # test.sh's SERVER_ARGS, as they are (explicit mode, nothing loaded at start: the test loads each)
    with meshserve_up(f"--model-repository={repo}", f"--backend-directory={backends}", "--model-control-mode=explicit",
                      "--log-verbose=1", *LOOPBACK, timeout=240, command="tritonserver"):
        _run(folder, "python_based_backends_test.py")


def test_model_control(tmp_path: Path) -> None:
    """test.sh's server with its own command line (`meshserve tritonserver` and its SERVER_ARGS:
    explicit mode, no --load-model, so nothing loaded at start), ExplicitModelTest loading and
    unloading a python model and an ensemble over it; then ModelIDValidationTest, whose load
    requests carry the model's code (`file:/1/model.py` parameters): Triton takes them in explicit
    mode, meshserve only with --allow-model-uploads, so it runs against `meshserve up` with it
    (loopback). Its valid names load; of its invalid ones, all but ``model\\test`` get the stub's
    "Invalid stub name" (meshserve's one name rule refuses '\\' in every model name, for every
    backend, in its own words: test_invalid_character_model_names is left out for that one name)."""
    repo = tmp_path / "models"
    _model(repo, "identity_fp32")
    (repo / "simple_identity_fp32" / "1").mkdir(parents=True)
    shutil.copy(QA / "python_models" / "simple_identity_fp32" / "config.pbtxt",  # type: ignore[operator]
                repo / "simple_identity_fp32" / "config.pbtxt")
    folder = _qa(tmp_path, "model_control")
    backends = tmp_path / "backends"  # (test.sh's ${BACKEND_DIR}: Triton's install has one)
    backends.mkdir()
    server_args = (f"--model-repository={repo}", "--model-control-mode=explicit", f"--backend-directory={backends}",
                   "--log-verbose=1")
    with meshserve_up(*server_args, *LOOPBACK, timeout=240, command="tritonserver"):
        _run(folder, "model_control_test.py", ["ModelIDValidationTest::test_invalid_character_model_names",
                                               "ModelIDValidationTest::test_valid_model_names"])
    with meshserve_up("--repository", str(repo), "--allow-model-uploads", *PORTS, timeout=240):
        _run(folder, "model_control_test.py", ["ExplicitModelTest::test_model_reload",  # (run above)
                                               "ModelIDValidationTest::test_invalid_character_model_names"])


PB_ENV = "MESHSERVE_NVIDIA_PYTHON_BACKEND"
PYTHON_BACKEND = Path(os.environ[PB_ENV]) if os.environ.get(PB_ENV) else None
# qa/L0_backend_python/examples/test.sh: (model, its files in examples/: model.py, config.pbtxt or
# None for an auto-completed one), then (client, what it must print)
EXAMPLE_MODELS = (("add_sub", "add_sub/model.py", "add_sub/config.pbtxt"),
                  ("pytorch", "pytorch/model.py", "pytorch/config.pbtxt"),
                  ("bls_sync", "bls/sync_model.py", "bls/sync_config.pbtxt"),
                  ("repeat_int32", "decoupled/repeat_model.py", "decoupled/repeat_config.pbtxt"),
                  ("square_int32", "decoupled/square_model.py", "decoupled/square_config.pbtxt"),
                  ("bls_async", "bls/async_model.py", "bls/async_config.pbtxt"),
                  ("nobatch_auto_complete", "auto_complete/nobatch_model.py", None),
                  ("batch_auto_complete", "auto_complete/batch_model.py", None),
                  ("bls_decoupled_sync", "bls_decoupled/sync_model.py", "bls_decoupled/sync_config.pbtxt"),
                  ("bls_decoupled_async", "bls_decoupled/async_model.py", "bls_decoupled/async_config.pbtxt"),
                  ("custom_metrics", "custom_metrics/model.py", "custom_metrics/config.pbtxt"))
EXAMPLE_CLIENTS = ("add_sub/client.py", "pytorch/client.py", "bls/sync_client.py", "decoupled/repeat_client.py",
                   "decoupled/square_client.py", "bls/async_client.py", "auto_complete/client.py",
                   "bls_decoupled/sync_client.py", "bls_decoupled/async_client.py", "custom_metrics/client.py")


@pytest.mark.skipif(PYTHON_BACKEND is None, reason=f"{PB_ENV} is not set to a python_backend snapshot with examples/")
def test_python_backend_examples(tmp_path: Path) -> None:
    """NVIDIA's python_backend examples, as qa/L0_backend_python/examples/test.sh runs them: each
    example's models (test.sh's repository grows with each; here all at once), then its client,
    unchanged, which must exit 0 and print PASS. Not run: jax (not installed here) and
    instance_kind (a ResNet-50 it downloads)."""
    assert PYTHON_BACKEND is not None
    examples, repo = PYTHON_BACKEND / "examples", tmp_path / "models"
    for name, model_py, config in EXAMPLE_MODELS:
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(examples / model_py, repo / name / "1" / "model.py")
        if config is not None:
            shutil.copy(examples / config, repo / name / "config.pbtxt")
    with meshserve_up("--repository", str(repo), *PORTS, timeout=240):
        for client in EXAMPLE_CLIENTS:
            done = subprocess.run([sys.executable, str(examples / client)], cwd=PYTHON_BACKEND, capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0 and "PASS" in done.stdout, (client, done.stdout[-3000:], done.stderr[-3000:])


def test_bls_parameters(tmp_path: Path) -> None:
    """qa/L0_backend_python/bls's parameters part: a BLS request's parameters reach the called
    model (the rest of that subtest needs NVIDIA's data volume of models and a GPU)."""
    repo = tmp_path / "params_models"
    _model(repo, "bls_parameters")
    _run_with(repo, _qa(tmp_path, "bls"), "bls_parameters_test.py")


def test_io_requested_output(tmp_path: Path) -> None:
    """qa/L0_backend_python/io's CPU case: a request naming one of add_sub's two outputs gets that
    one only, one naming none gets both (its other cases move tensors to CUDA)."""
    repo = tmp_path / "models"
    _model(repo, "add_sub")
    with meshserve_up("--repository", str(repo), *PORTS, timeout=240):
        _run(_qa(tmp_path, "io"), "io_test.py::IOTest::test_requested_output_default")


@pytest.mark.parametrize("model", ["bls_init_error", "bls_finalize_error"])
def test_bls_outside_execute(model: str, tmp_path: Path) -> None:
    """qa/L0_backend_python/bls's init and finalize parts: BLS from initialize() or finalize() is
    refused with the stub's text, which the server's log shows (test.sh greps it; there the
    server exits at a model that fails to load, here `up` serves on without it)."""
    repo = tmp_path / "models"
    _model(repo, model)
    with meshserve_up("--repository", str(repo), *PORTS, timeout=240) as up:
        up.tee(tmp_path / "server.log")
        up.stop()
    assert "BLS is only supported during the 'execute' function." in (tmp_path / "server.log").read_text()


def test_ensemble(tmp_path: Path) -> None:
    """qa/L0_backend_python/ensemble's CPU case: an ensemble of two python add_sub models (its GPU
    case needs a TorchScript model on CUDA from NVIDIA's data volume)."""
    assert QA is not None
    repo = tmp_path / "models"
    (repo / "ensemble" / "1").mkdir(parents=True)
    shutil.copy(QA / "python_models" / "ensemble" / "config.pbtxt", repo / "ensemble" / "config.pbtxt")
    for name in ("add_sub_1", "add_sub_2"):
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(QA / "python_models" / "add_sub" / "config.pbtxt", repo / name / "config.pbtxt")
        shutil.copy(QA / "python_models" / "add_sub" / "model.py", repo / name / "1" / "model.py")
    _run_with(repo, _qa(tmp_path, "ensemble"), "ensemble_test.py", ["EnsembleTest::test_ensemble_gpu"])


def test_custom_metrics(tmp_path: Path) -> None:
    """The model makes, changes and reads back its metrics inside execute(), checking each against
    the server's /metrics text at localhost:8002 (the gateway's, federated)."""
    repo = tmp_path / "models"
    _model(repo, "custom_metrics")
    _run_with(repo, _qa(tmp_path, "custom_metrics"), "../test_infer_shm_leak.py",
              env={"MODEL_NAME": "custom_metrics"})


def test_async_execute(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for name in ("async_execute_decouple", "async_execute_decouple_bls"):
        _model(repo, name)
    _run_with(repo, _qa(tmp_path, "async_execute"), "concurrency_test.py",
              env={"SERVER_LOG": "concurrency_test.server.log"}, log="concurrency_test.server.log")


def test_model_readiness(tmp_path: Path) -> None:
    """The user-defined ``is_ready()`` models, as test.sh makes them: readiness_model.py with its
    config parameters (true, false, exception, non_boolean, an 8 s delay past the 5 s bound),
    the coroutine one and the decoupled one; then identity_fp32's readiness check."""
    assert QA is not None
    repo = tmp_path / "models"
    _model(repo, "identity_fp32")
    models = QA / "L0_backend_python" / "model_readiness" / "test_models"
    for name, value, delay in (("is_ready_fn_returns_true", "true", "0.1"),
                               ("is_ready_fn_returns_false", "false", "0.1"),
                               ("is_ready_fn_raises_error", "exception", "0.1"),
                               ("is_ready_fn_returns_non_boolean", "non_boolean", "0.1"),
                               ("is_ready_fn_timeout", "true", "8"),
                               ("is_ready_fn_coroutine_returns_true", "coroutine", "0.1")):
        (repo / name / "1").mkdir(parents=True)
        source = "readiness_coroutine_model.py" if value == "coroutine" else "readiness_model.py"
        shutil.copy(models / source, repo / name / "1" / "model.py")
        text = "\n".join(f'name: "{name}"' if line.startswith("name:") else line
                         for line in (repo / "identity_fp32" / "config.pbtxt").read_text().splitlines())
        (repo / name / "config.pbtxt").write_text(
            text + f'\nparameters: {{\n  key: "READINESS_FN_RETURN_VALUE"\n  value: {{ string_value: "{value}" }}\n}}\n'
            f'parameters: {{\n  key: "READINESS_FN_DELAY_SECS"\n  value: {{ string_value: "{delay}" }}\n}}\n')
    shutil.copytree(models / "is_ready_fn_returns_true_decoupled", repo / "is_ready_fn_returns_true_decoupled")
    (repo / "is_ready_fn_returns_true_decoupled" / "1").mkdir()
    (repo / "is_ready_fn_returns_true_decoupled" / "model.py").rename(
        repo / "is_ready_fn_returns_true_decoupled" / "1" / "model.py")
    # (TestModelReadiness::test_model_not_ready follows test.sh's kill of the stub: meshserve restarts
    # a dead worker (with backoff) where Triton leaves the model not ready; the not-ready window is
    # tests/integration/test_python_backend.py::test_a_killed_worker_is_not_ready_until_it_is_back)
    _run_with(repo, _qa(tmp_path, "model_readiness"), "test_model_readiness.py",
              ["TestModelReadiness::test_model_not_ready"])


def _run_with(repo: Path, folder: Path, test_file: str, deselect: Sequence[str] = (),
              env: dict[str, str] | None = None, log: str = "") -> None:
    """`meshserve up` on ``repo`` while ``_run`` runs; ``log``: the file in ``folder`` the test reads
    the server's log from (test.sh's $SERVER_LOG), written as `up` writes it."""
    with meshserve_up("--repository", str(repo), *PORTS, timeout=240) as up:
        if log:
            up.tee(folder / log)
        _run(folder, test_file, deselect, env)
