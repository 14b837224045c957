"""`meshserve tritonserver`: Triton's own command line runs the mesh, checked with tritonclient
against the running processes: explicit mode with --load-model (in Triton's upper case), the
server's --id, client shared memory off by default (Triton's words), none mode (Triton's default:
every model, the API refused), poll mode (a model copied in is served), --exit-on-error (Triton's
default true) and --log-file, and a refused flag stopping before anything starts."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT
from tests.models import python_models as pm
from tests.support import eventually
from tests.support.models import example_models
from tests.support.net import free_port
from tests.support.up import Up, meshserve_up

LOOPBACK = ("--http-address=127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address=127.0.0.1",
            "--http-port=0", "--grpc-port=0", "--metrics-port=0")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """add_sub and scale (onnx) of the example repository, their files generated."""
    return example_models(tmp_path_factory.mktemp("tritonserver") / "repo", "add_sub", "scale")


def _copy(repo: Path, tmp_path: Path, *names: str) -> Path:
    out = tmp_path / "repo"
    out.mkdir()
    for name in names:
        shutil.copytree(repo / name, out / name)
    return out


@pytest.fixture
def tritonserver(repo: Path) -> Iterator[object]:
    def start(*flags: str, repository: Path = repo) -> object:
        return meshserve_up(f"--model-repository={repository}", *LOOPBACK, *flags, command="tritonserver",
                            timeout=120)
    yield start


def _add_sub(client: grpcclient.InferenceServerClient) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"), grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones_like(a))
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)


def _clients(up: Up) -> tuple[httpclient.InferenceServerClient, grpcclient.InferenceServerClient]:
    return (httpclient.InferenceServerClient(f"127.0.0.1:{up.ports['http']}"),
            grpcclient.InferenceServerClient(f"127.0.0.1:{up.ports['grpc']}"))


def test_explicit_mode_loads_only_the_named_models_and_keeps_the_api(tritonserver) -> None:  # type: ignore[no-untyped-def]
    with tritonserver("--model-control-mode=EXPLICIT", "--load-model", "add_sub", "--id=edge-triton",
                      "--grpc-infer-thread-count=8", "--strict-model-config=false") as up:
        http, grpc = _clients(up)
        assert http.is_model_ready("add_sub") and not http.is_model_ready("scale")
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["scale"]["state"] == "UNAVAILABLE" and index["scale"]["reason"] == \
            "not loaded (explicit model control)"
        assert http.get_server_metadata()["name"] == "edge-triton"
        assert grpc.get_server_metadata().name == "edge-triton"
        _add_sub(grpc)
        grpc.load_model("scale")  # explicit mode: the API is on
        assert grpc.is_model_ready("scale")
        http.unload_model("add_sub")
        eventually(lambda: not http.is_model_ready("add_sub"), 10, what="add_sub unloaded")
        # client shared memory: off, as Triton's default (--allow-client-shm=false), in its words
        for client in (http, grpc):
            with pytest.raises(InferenceServerException, match="Client shared memory is disabled. Start the server "
                                                               "with '--allow-client-shm=true' to enable."):
                client.register_system_shared_memory("r", "/meshserve-none", 64)
        # the ignored flags were named, each with why; the mapped ones were not
        out = up.log(400)
        assert "--grpc-infer-thread-count has no effect here: Triton's own gRPC completion-queue threads" in out
        assert "--strict-model-config has no effect here" in out
        assert "--model-control-mode has no effect" not in out
        http.close()
        grpc.close()


def test_none_mode_is_the_default_every_model_loaded_and_the_api_refused(tritonserver) -> None:  # type: ignore[no-untyped-def]
    with tritonserver("--allow-client-shm=true", "--log-verbose=1") as up:
        http, grpc = _clients(up)
        assert http.is_model_ready("add_sub") and http.is_model_ready("scale")
        assert http.get_server_metadata()["name"] == "triton"  # Triton's default --id
        _add_sub(grpc)
        for client in (http, grpc):
            with pytest.raises(InferenceServerException,
                               match="explicit model load / unload is not allowed if polling is enabled"):
                client.unload_model("scale")
        assert http.is_model_ready("scale")
        # --allow-client-shm=true: registration is the gateway's (a missing region: not Triton's "disabled")
        with pytest.raises(InferenceServerException) as err:
            http.register_system_shared_memory("r", "/meshserve-no-such-region", 64)
        assert "disabled" not in err.value.message()
        assert " DEBUG " in up.log(400)  # --log-verbose=1: the processes log at DEBUG
        http.close()
        grpc.close()


def test_poll_mode_serves_a_model_copied_in(tritonserver, repo: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    own = _copy(repo, tmp_path, "add_sub")
    with tritonserver("--model-control-mode", "poll", "--repository-poll-secs=1", repository=own) as up:
        http, grpc = _clients(up)
        assert not http.is_model_ready("scale")
        staging = tmp_path / "staging"
        shutil.copytree(repo / "scale", staging)
        staging.rename(own / "scale")  # moved in whole, as an operator would
        eventually(lambda: http.is_model_ready("scale"), 30, interval=0.2, what="scale loaded by the poll")
        meta = grpc.get_model_metadata("scale", as_json=True)
        assert meta["name"] == "scale"
        with pytest.raises(InferenceServerException, match="not allowed if polling is enabled"):
            grpc.load_model("add_sub")
        http.close()
        grpc.close()


def test_exit_on_error_is_the_default_and_false_serves_the_rest(tritonserver, repo: Path,  # type: ignore[no-untyped-def]
                                                                tmp_path: Path) -> None:
    own = _copy(repo, tmp_path, "add_sub")
    pm.write(own, "bad_init", pm.FAULTY_INIT, pm.config("bad_init", [("IN", "TYPE_FP32", "1")],
                                                        [("OUT", "TYPE_FP32", "1")]))
    log = tmp_path / "server.log"
    run = subprocess.run([sys.executable, "-m", "meshserve", "tritonserver", f"--model-repository={own}", *LOOPBACK,
                          f"--log-file={log}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = log.read_text()
    assert run.returncode == 1, (run.returncode, text)
    assert run.stdout == "" and run.stderr == ""  # --log-file: every process's output went to the file
    assert "initialize() of instance 'bad_init_0' failed: RuntimeError: the weights are missing" in text
    assert "failed to load all models (--exit-on-error): 'bad_init'" in text
    assert "python service exited with code 1 before it was ready" in text
    with tritonserver("--exit-on-error=false", repository=own) as up:
        http, _ = _clients(up)
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["add_sub"]["state"] == "READY"
        assert index["bad_init"]["state"] == "UNAVAILABLE" and "the weights are missing" in index["bad_init"]["reason"]
        http.close()


@pytest.mark.parametrize(("flags", "says"), [
    (["--model-namespacing=true"], "--model-namespacing: not supported by meshserve: one namespace of model names"),
    (["--http-restricted-api=model-repository:admin-key=secret"], "--http-restricted-api: not supported by meshserve"),
    (["--model-repository=/elsewhere"], "one repository per mesh, got 2"),
    (["--load-model=add_sub"], "Error: Use of '--load-model' requires setting '--model-control-mode=explicit' as well."),
    (["--exit-on-error=maybe"], 'Bad option: "--exit-on-error".\ninvalid value for bool option: maybe'),
    (["--no-such-flag=1"], "unrecognized option '--no-such-flag=1'"),
])
def test_a_refused_command_line_stops_before_anything_starts(repo: Path, flags: list[str], says: str) -> None:
    run = subprocess.run([sys.executable, "-m", "meshserve", "tritonserver", f"--model-repository={repo}", *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert says in run.stderr, run.stderr
    assert "meshserve up: starting" not in run.stdout + run.stderr


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_http_and_metrics_off(tritonserver) -> None:  # type: ignore[no-untyped-def]
    """--allow-http=false: gRPC only, no HTTP port; --allow-metrics=false: no metrics port, and
    /metrics on the HTTP port is 404 (Triton's flags, honoured)."""
    http_port, metrics_port = free_port(), free_port()
    ports = (f"--http-port={http_port}", f"--metrics-port={metrics_port}")
    with tritonserver("--allow-http=false", "--allow-metrics=false", *ports) as up:
        assert "http" not in up.ports and "HTTP/REST" not in up.banner and "Metrics" not in up.banner
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{up.ports['grpc']}")
        _add_sub(grpc)
        grpc.close()
        assert _refused(http_port) and _refused(metrics_port)
    with tritonserver("--allow-metrics=false") as up:
        with urllib.request.urlopen(f"http://127.0.0.1:{up.ports['http']}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{up.ports['http']}/metrics", timeout=10)
        assert err.value.code == 404 and b"--allow-metrics=false" in err.value.read()
        assert "metrics" not in up.ports
