"""A model's label files (``output { label_filename }``), through an onnx service and the gateway
in front, with the real tritonclient: as Triton (core's model.cc, Model::Init) they are read at
load, a file outside the model's folder (by its name, or by a symbolic link) or one that does not
read fails the load with an error naming the model and the field (never the file's content); a
good one classifies (``class_count``) with its labels, an empty line of it giving no label."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.support import models

MODULES = {"http": httpclient, "grpc": grpcclient}
LABELS = ["cat", "dog", "bird", "fish"]
SECRET = "root:x:0:0:the secret line"


def config(name: str, label_filename: str) -> str:
    return f"""name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "{label_filename}" }} ]
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    root = tmp_path_factory.mktemp("labels")
    secret = root / "secret.txt"
    secret.write_text(SECRET + "\n")
    repo = root / "models"
    identity = {1: models.identity(TensorProto.FLOAT, 4)}
    good = models.write(repo, "good", config("good", "labels.txt"), identity)
    (good / "labels.txt").write_text("\n".join(LABELS) + "\n")
    models.write(repo, "absolute", config("absolute", str(secret)), identity)
    models.write(repo, "relative", config("relative", "../../secret.txt"), identity)
    linked = models.write(repo, "linked", config("linked", "labels.txt"), identity)
    (linked / "labels.txt").symlink_to(secret)
    models.write(repo, "missing", config("missing", "no_such_labels.txt"), identity)
    blank = models.write(repo, "blank", config("blank", "labels.txt"), identity)
    (blank / "labels.txt").write_text("cat\n\nbird\n")  # index 1: an empty line; index 3: none
    big = models.write(repo, "big", config("big", "labels.txt"), identity)
    (big / "labels.txt").write_bytes(b"x" * 64 + b"\n" * ((4 << 20) + 1))
    with service_and_gateway("onnx", ["--repository", str(repo), "--model-control-mode", "explicit",
                                      "--load-model", "good", "--load-model", "blank"]) as (_, g):
        yield g, secret


def classify(proto: str, url: str, model: str, k: int) -> list[list[str]]:
    m = MODULES[proto]
    x = np.array([[0.1, 0.4, 0.2, 0.3]], dtype=np.float32)
    inp = m.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with m.InferenceServerClient(url) as c:
        res = c.infer(model, [inp], outputs=[m.InferRequestedOutput("OUTPUT0", class_count=k)])
    return [[e.decode() for e in row] for row in res.as_numpy("OUTPUT0")]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_model_with_good_labels_classifies_with_them(proto: str, served: tuple[Proc, Path]) -> None:
    gateway, _ = served
    assert classify(proto, getattr(gateway, proto), "good", 3) == [["0.400000:1:dog", "0.300000:3:fish",
                                                                     "0.200000:2:bird"]]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_an_empty_label_line_gives_no_label(proto: str, served: tuple[Proc, Path]) -> None:
    """As Triton's: an empty label is none (server's classification.cc AddClassResults adds
    ":label" only for a non-null one; core's InferenceResponse::ClassificationLabel gives null for
    an empty line), like an index past the file's lines."""
    gateway, _ = served
    assert classify(proto, getattr(gateway, proto), "blank", 4) == [["0.400000:1", "0.300000:3",
                                                                      "0.200000:2:bird", "0.100000:0:cat"]]


@pytest.mark.parametrize(("model", "why"), [
    ("absolute", "outside the model directory"), ("relative", "outside the model directory"),
    ("linked", "outside the model directory"), ("missing", "cannot read label file 'no_such_labels.txt'"),
    ("big", "label file 'labels.txt' is larger than 4194304 bytes")])
@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_label_file_outside_the_folder_or_unreadable_fails_the_load(
        proto: str, model: str, why: str, served: tuple[Proc, Path]) -> None:
    gateway, secret = served
    m = MODULES[proto]
    with m.InferenceServerClient(getattr(gateway, proto)) as c:
        with pytest.raises(InferenceServerException) as err:
            c.load_model(model)
        message = err.value.message()
        assert f"'{model}'" in message and "output[0].label_filename" in message and why in message, message
        assert "secret" not in message and str(secret.parent) not in message, message
        assert not c.is_model_ready(model)
        index = c.get_model_repository_index()
        index = index if proto == "http" else [{"name": e.name, "state": e.state, "reason": e.reason}
                                               for e in index.models]
    entry = next(e for e in index if e["name"] == model)
    assert entry["state"] == "UNAVAILABLE" and why in entry["reason"] and "secret" not in entry["reason"], entry


def test_an_uploaded_config_cannot_point_its_labels_out_of_the_folder(served: tuple[Proc, Path]) -> None:
    gateway, secret = served
    with httpclient.InferenceServerClient(gateway.http) as c:
        cfg = c.get_model_config("good")
        for escape in (str(secret), "/etc/passwd", "../labels.txt", "../../secret.txt"):
            cfg["output"][0]["label_filename"] = escape
            with pytest.raises(InferenceServerException) as err:
                c.load_model("good", config=json.dumps(cfg))
            message = err.value.message()
            assert "'good'" in message and "outside the model directory" in message, message
            assert "root:" not in message and escape not in message, message
    # the loaded version still serves, with its own labels
    assert classify("grpc", gateway.grpc, "good", 1) == [["0.400000:1:dog"]]
