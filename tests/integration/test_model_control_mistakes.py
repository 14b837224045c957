"""Model control answers like Triton for every client mistake (issue 30 item 4, issue 29 item 7),
with the real tritonclient over HTTP and gRPC, through the gateway and direct to a service:
an over-long or otherwise unwritable `file:` path, files without `config`, a config that does not
parse, a file that is not a model, a model name over NAME_MAX or with a control character. Each
is 400 / INVALID_ARGUMENT with Triton's text, no answer names a path of the host, nothing is
left on disk, and the server keeps serving."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.adversarial.support import add_sub_inputs
from tests.conftest import Proc, service_and_gateway

POLL = "failed to poll from model repository"
CONFIG = json.dumps({"name": "m", "backend": "onnxruntime", "max_batch_size": 0,
                     "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
                     "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}]})


def _unknown_op_model() -> bytes:
    """A well-formed ONNX ModelProto whose one node is an operator onnxruntime does not have."""
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="meshserve.test")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("meshserve.test", 1)])
    model.ir_version = 8
    return model.SerializeToString()


@dataclass
class Mistake:
    what: str
    name: str
    config: str | None
    files: dict[str, bytes]
    texts: tuple[str, ...]  # each in the answer


MISTAKES = [
    Mistake("file path component over NAME_MAX", "m", CONFIG, {f"file:1/{'x' * 300}.onnx": b"x"},
            (f"failed to load 'm', {POLL}", "longer than 255")),
    Mistake("whole file path over PATH_MAX", "m", CONFIG, {"file:" + "/".join(["d" * 250] * 20) + "/model.onnx": b"x"},
            (f"failed to load 'm', {POLL}", "File name too long")),
    Mistake("a file where a directory must go", "m", CONFIG, {"file:1/model.onnx": b"x", "file:1/model.onnx/x": b"y"},
            (f"failed to load 'm', {POLL}",)),
    Mistake("file path with a control character", "m", CONFIG, {"file:1/model\n.onnx": b"x"},
            (f"failed to load 'm', {POLL}", "U+000A")),
    Mistake("files without config", "m", None, {"file:1/model.onnx": b"x"},
            (f"failed to load 'm', {POLL}", "Load parameter 'config' must be specified for model file override")),
    Mistake("config that is not JSON", "m", "{not json", {"file:1/model.onnx": b"x"},
            (f"failed to load 'm', {POLL}", "Invalid config override")),
    Mistake("config with an unknown field", "m", json.dumps({"name": "m", "backend": "onnxruntime", "nme": 1}),
            {"file:1/model.onnx": b"x"}, (f"failed to load 'm', {POLL}", "Invalid config override", "nme")),
    Mistake("a file that is not a model", "m", CONFIG, {"file:1/model.onnx": b"not an onnx model"},
            ("failed to load 'm'", "1/model.onnx", "cannot read ONNX model")),
    Mistake("an ONNX graph onnxruntime cannot run", "m", CONFIG, {"file:1/model.onnx": _unknown_op_model()},
            ("failed to load 'm'", "load failed for model 'm': version 1 is at UNAVAILABLE state", "NoSuchOp")),
    Mistake("model name over NAME_MAX", "n" * 300, None, {}, ("invalid model name", "longer than 255")),
    Mistake("model name with a newline", "bad\nname", None, {}, ("invalid model name", "U+000A")),
    Mistake("model name with ESC", "\x1b[31mred", CONFIG, {"file:1/model.onnx": b"x"}, ("invalid model name", "U+001B")),
]


@pytest.fixture(scope="module")
def mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Path]]:
    repo = tmp_path_factory.mktemp("mistakes") / "repo"
    shutil.copytree(model_repo / "add_sub", repo / "add_sub")
    with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit", "--load-model",
                                      "add_sub", "--allow-model-uploads"],
                             ["--discovery-interval", "0.5", "--allow-model-uploads"]) as (service, gateway):
        yield service, gateway, repo


def _answer(call: Callable[[], object]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), err.value.message() or ""


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.what for m in MISTAKES])
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_each_mistake_is_a_client_error_with_triton_s_text(mesh: tuple[Proc, Proc, Path], proto: str,
                                                           mistake: Mistake) -> None:
    service, gateway, repo = mesh
    module = httpclient if proto == "http" else grpcclient
    for where in (gateway, service):
        with module.InferenceServerClient(getattr(where, proto)) as c:
            status, message = _answer(lambda: c.load_model(mistake.name, config=mistake.config,
                                                           files=mistake.files or None))
            assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (where.argv[:4], status, message)
            for text in mistake.texts:
                assert text in message, (where.argv[:4], text, message)
            assert str(repo) not in message and str(repo.resolve()) not in message, message
            assert ".meshserve-overrides" not in message, message
            assert c.is_server_live()
            assert c.infer("add_sub", add_sub_inputs(module)).as_numpy("OUTPUT0") is not None
    overrides = repo / ".meshserve-overrides"
    assert not overrides.exists() or not any(overrides.iterdir()), list(overrides.rglob("*"))[:5]
    assert sorted(p.name for p in repo.iterdir() if not p.name.startswith(".")) == ["add_sub"]
