"""Classification (``class_count``) of an ensemble's output, through the real tritonclient against
a service and a gateway: Triton classifies it with the ensemble's own labels where the ensemble's
config names a ``label_filename`` for that output, else with the labels of the step model that
makes it (core's model_lifecycle.cc); an index past the labels gets none (server's
classification.cc). An ensemble whose label file does not read does not load (core's model.cc)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto

from tests.conftest import Proc, service_and_gateway
from tests.support import models

MODULES = {"http": httpclient, "grpc": grpcclient}
STEP_LABELS = ["step0", "step1", "step2", "step3"]
OWN_LABELS = ["own0", "own1", "own2"]  # one short: index 3 has no label of the ensemble's

SCORES = """name: "scores"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "step_labels.txt" } ]
"""


def ensemble(name: str, label_filename: str = "") -> str:
    labels = f' label_filename: "{label_filename}"' if label_filename else ""
    return f"""name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ]{labels} }} ]
ensemble_scheduling {{ step [ {models.step("scores", {"INPUT0": "X"}, {"OUTPUT0": "Y"})} ] }}
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("models")
    folder = models.write(repo, "scores", SCORES, {1: models.identity(TensorProto.FLOAT, 4)})
    (folder / "step_labels.txt").write_text("\n".join(STEP_LABELS) + "\n")
    ens = tmp_path_factory.mktemp("ensembles")
    for name, label_filename in (("own_labels", "ens_labels.txt"), ("inherited", ""),
                                 ("missing_labels", "no_such_file.txt")):
        (ens / name / "1").mkdir(parents=True)
        (ens / name / "config.pbtxt").write_text(ensemble(name, label_filename))
    (ens / "own_labels" / "ens_labels.txt").write_text("\n".join(OWN_LABELS) + "\n")
    with service_and_gateway("onnx", ["--repository", str(repo)], ["--repository", str(ens)]) as (_, g):
        yield g


def classify(proto: str, url: str, model: str, x: np.ndarray, k: int) -> list[list[str]]:
    m = MODULES[proto]
    inp = m.InferInput("X", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with m.InferenceServerClient(url) as c:
        res = c.infer(model, [inp], outputs=[m.InferRequestedOutput("Y", class_count=k)])
    got = res.as_numpy("Y")
    assert got.shape == (x.shape[0], k), got
    return [[entry.decode() for entry in row] for row in got]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_an_ensemble_output_with_its_own_label_file_is_classified_with_it(proto: str, gateway: Proc) -> None:
    x = np.array([[0.1, 0.4, 0.2, 0.3], [0.9, 0.1, 0.0, 0.5]], dtype=np.float32)
    own = classify(proto, getattr(gateway, proto), "own_labels", x, 4)
    assert own == [["0.400000:1:own1", "0.300000:3", "0.200000:2:own2", "0.100000:0:own0"],
                   ["0.900000:0:own0", "0.500000:3", "0.100000:1:own1", "0.000000:2:own2"]]
    # without a label file of its own, the step model's labels (as before)
    inherited = classify(proto, getattr(gateway, proto), "inherited", x, 2)
    assert inherited == [["0.400000:1:step1", "0.300000:3:step3"], ["0.900000:0:step0", "0.500000:3:step3"]]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_an_ensemble_whose_label_file_does_not_read_does_not_load(proto: str, gateway: Proc) -> None:
    m = MODULES[proto]
    with m.InferenceServerClient(getattr(gateway, proto)) as c:
        assert c.is_model_ready("own_labels") and c.is_model_ready("inherited")
        assert not c.is_model_ready("missing_labels")
        index = c.get_model_repository_index()
        index = index if proto == "http" else [{"name": e.name, "state": e.state, "reason": e.reason}
                                               for e in index.models]
    entry = next(e for e in index if e["name"] == "missing_labels")
    assert entry["state"] == "UNAVAILABLE"
    assert "label_filename" in entry["reason"] and "no_such_file.txt" in entry["reason"], entry
