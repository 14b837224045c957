"""Model control across the mesh of a running `meshserve up` (Triton's explicit mode), with
tritonclient over HTTP and gRPC: a model directory copied into the repository after start is
listed UNAVAILABLE, then loaded, served and unloaded; `file:` overrides (and a path escape);
an ensemble loads its composing models and `unload_dependents` unloads them."""
from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import eventually, models
from tests.support.net import free_port as _free_port
from tests.support.up import meshserve_up

PIPE = models.ensemble_config("pipe", {"X": 16}, {"Y": 16},
                              [models.step("add_sub_dep", {"INPUT0": "X", "INPUT1": "X"}, {"OUTPUT0": "Y"})])


@dataclass
class Up:
    repo: Path
    http: str
    grpc: str


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    repo = models.example_models(tmp_path_factory.mktemp("up") / "repo", "add_sub", "scale")
    http_port, grpc_port = _free_port(), _free_port()
    with meshserve_up("--metrics-port", "0", "--repository", str(repo), "--http-port", str(http_port),
                      "--grpc-port", str(grpc_port), "--allow-model-uploads",  # the `file:` override tests upload on purpose
                      timeout=120):
        yield Up(repo, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")


def _copy_model(repo: Path, src: str, dst: str) -> None:
    """A new model directory: a copy of ``src`` under the name ``dst`` (config name included),
    assembled aside and moved in at once, as an operator would."""
    staging = repo.parent / f"staging-{dst}"
    shutil.copytree(repo / src, staging)
    config = staging / "config.pbtxt"
    config.write_text(config.read_text().replace(f'name: "{src}"', f'name: "{dst}"'))
    staging.rename(repo / dst)


def _until(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
    eventually(check, timeout, interval=0.05, what=what)


def _index(c: httpclient.InferenceServerClient | grpcclient.InferenceServerClient) -> dict[str, dict]:
    """name -> entry (the unversioned entry, or the highest version's)."""
    if isinstance(c, grpcclient.InferenceServerClient):
        models = c.get_model_repository_index(as_json=True).get("models", [])
    else:
        models = c.get_model_repository_index()
    return {m["name"]: m for m in sorted(models, key=lambda m: m.get("version", ""))}


def _ready_index(http: str) -> list[dict]:
    """POST /v2/repository/index {"ready": true} (tritonclient cannot send the flag over HTTP)."""
    req = urllib.request.Request(f"http://{http}/v2/repository/index", data=b'{"ready": true}', method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _add_sub(c: object, mod: object, model: str) -> np.ndarray:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    ins = [mod.InferInput("INPUT0", [1, 16], "FP32"), mod.InferInput("INPUT1", [1, 16], "FP32")]  # type: ignore[attr-defined]
    for i in ins:
        i.set_data_from_numpy(a)
    return c.infer(model, ins).as_numpy("OUTPUT0")  # type: ignore[attr-defined]


def test_new_model_at_run_time_http_and_grpc(up: Up) -> None:
    _copy_model(up.repo, "add_sub", "add_sub_new")
    expected = np.arange(16, dtype=np.float32).reshape(1, 16) * 2
    with httpclient.InferenceServerClient(up.http) as c:
        entry = _index(c)["add_sub_new"]
        assert entry["state"] == "UNAVAILABLE" and entry.get("reason"), entry
        assert not c.is_model_ready("add_sub_new")
        assert "add_sub_new" not in {m["name"] for m in _ready_index(up.http)}  # ready_only leaves it out
        c.load_model("add_sub_new")  # blocks until loaded, as Triton's load does
        assert c.is_model_ready("add_sub_new")
        assert {"name": "add_sub_new", "version": "1", "state": "READY"} in _ready_index(up.http)
        np.testing.assert_array_equal(_add_sub(c, httpclient, "add_sub_new"), expected)
        c.unload_model("add_sub_new")
        _until(lambda: not c.is_model_ready("add_sub_new"), "add_sub_new is unloaded (HTTP)")
        assert _index(c)["add_sub_new"] == {"name": "add_sub_new", "state": "UNAVAILABLE", "reason": "unloaded"}
        with pytest.raises(InferenceServerException) as err:
            c.load_model("no_such_model")
        assert err.value.status() == "404"
        assert err.value.message() == "failed to load 'no_such_model', failed to poll from model repository"

    with grpcclient.InferenceServerClient(up.grpc) as g:
        assert _index(g)["add_sub_new"]["state"] == "UNAVAILABLE"
        g.load_model("add_sub_new")
        assert g.is_model_ready("add_sub_new")
        np.testing.assert_array_equal(_add_sub(g, grpcclient, "add_sub_new"), expected)
        g.unload_model("add_sub_new")
        _until(lambda: not g.is_model_ready("add_sub_new"), "add_sub_new is unloaded (gRPC)")
        with pytest.raises(InferenceServerException) as err:
            _add_sub(g, grpcclient, "add_sub_new")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException) as err:
            g.load_model("no_such_model")
        assert err.value.status() == "StatusCode.NOT_FOUND"
        assert "failed to load 'no_such_model', failed to poll from model repository" in err.value.message()


def test_load_with_file_overrides(up: Up) -> None:
    with grpcclient.InferenceServerClient(up.grpc) as g:
        config = g.get_model_config("scale", as_json=True)["config"]
    config["name"] = "scale_files"
    config["version_policy"] = {"latest": {"num_versions": 1}}
    # the files of scale version 2 (x2) as version 1 of a model the repository does not have
    model_bytes = (up.repo / "scale" / "2" / "model.onnx").read_bytes()
    files = {"file:1/model.onnx": model_bytes}
    v = np.ones((1, 4), np.float32)
    with grpcclient.InferenceServerClient(up.grpc) as g:
        g.load_model("scale_files", config=json.dumps(config), files=files)
        inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(v)
        assert g.infer("scale_files", [inp]).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]
        assert g.get_model_metadata("scale_files", as_json=True)["versions"] == ["1"]
        with pytest.raises(InferenceServerException) as err:  # files without their config
            g.load_model("scale_files", files=files)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "'config'" in err.value.message()
    assert not (up.repo / "scale_files").exists()  # the repository's own models are untouched
    overrides = up.repo / ".meshserve-overrides"
    assert [p.name for p in overrides.glob("*/*")] == ["scale_files"]

    with httpclient.InferenceServerClient(up.http) as c:  # HTTP: base64 in the JSON parameters
        c.load_model("scale_files", config=json.dumps(config),
                     files={"file:1/model.onnx": (up.repo / "scale" / "1" / "model.onnx").read_bytes()})
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(v)
        assert c.infer("scale_files", [inp]).as_numpy("OUTPUT0").tolist() == [[1.0] * 4]
        for bad in ("../../evil.onnx", "1/../../../evil.onnx", "/../evil.onnx", "1/./evil.onnx", "1\\..\\evil"):
            with pytest.raises(InferenceServerException) as err:
                c.load_model("scale_files", config=json.dumps(config), files={f"file:{bad}": b"evil"})
            assert err.value.status() == "400", (bad, err.value.message())
            assert "file path" in err.value.message(), err.value.message()
        assert c.infer("scale_files", [inp]).as_numpy("OUTPUT0").tolist() == [[1.0] * 4]  # still served
        c.unload_model("scale_files")
        _until(lambda: not c.is_model_ready("scale_files"), "scale_files is unloaded")
    assert not list(up.repo.parent.rglob("evil*"))
    _until(lambda: not list(overrides.glob("*/*")), "the override files are removed after the unload")


def test_ensemble_load_and_unload_dependents(up: Up) -> None:
    _copy_model(up.repo, "add_sub", "add_sub_dep")
    (up.repo.parent / "pipe" / "1").mkdir(parents=True)
    (up.repo.parent / "pipe" / "config.pbtxt").write_text(PIPE)
    (up.repo.parent / "pipe").rename(up.repo / "pipe")
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    with httpclient.InferenceServerClient(up.http) as c:
        index = _index(c)
        assert index["pipe"]["state"] == "UNAVAILABLE" and index["add_sub_dep"]["state"] == "UNAVAILABLE"
        c.load_model("pipe")  # loads its composing model too, as Triton does
        assert c.is_model_ready("add_sub_dep") and c.is_model_ready("pipe")
        inp = httpclient.InferInput("X", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("pipe", [inp]).as_numpy("Y"), x * 2)
        c.unload_model("pipe")  # without unload_dependents: the composing model stays
        _until(lambda: not c.is_model_ready("pipe"), "pipe is unloaded")
        assert c.is_model_ready("add_sub_dep")
        assert _index(c)["pipe"] == {"name": "pipe", "state": "UNAVAILABLE", "reason": "unloaded"}
    with grpcclient.InferenceServerClient(up.grpc) as g:
        g.load_model("pipe")
        assert g.is_model_ready("pipe")
        g.unload_model("pipe", unload_dependents=True)
        _until(lambda: not g.is_model_ready("add_sub_dep"), "the composing model is unloaded too")
        assert not g.is_model_ready("pipe")
        assert _index(g)["add_sub_dep"]["reason"] == "unloaded"
