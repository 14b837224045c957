"""The classification extension (``class_count``) of every datatype, through a gateway in front of
an ONNX service and of a python service, with the real tritonclient: the answers are Triton
2.51's (recorded from the real server, its Python backend returning the same tensors: integers
written as integers, floats with six decimals, largest first, equal values by index; FP16, BOOL
and BYTES refused with its text), and a response's classified entries are bounded
(services/base/classification.py: ``MAX_CLASSIFIED``)."""
from __future__ import annotations

import queue
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from services.base.classification import MAX_CLASSIFIED
from tests.conftest import Proc, served
from tests.models.tensors import PY_IDENTITY
from tests.support import models

MODULES = {"http": httpclient, "grpc": grpcclient}
# datatype -> (ONNX element type, numpy type of the tensor sent)
TYPES = {"INT32": (TensorProto.INT32, np.int32), "UINT8": (TensorProto.UINT8, np.uint8),
         "INT8": (TensorProto.INT8, np.int8), "FP32": (TensorProto.FLOAT, np.float32),
         "FP64": (TensorProto.DOUBLE, np.float64), "FP16": (TensorProto.FLOAT16, np.float16),
         "BOOL": (TensorProto.BOOL, np.bool_), "BYTES": (TensorProto.STRING, np.object_)}
CONFIG_TYPE = {"FP32": "FP32", "FP64": "FP64", "FP16": "FP16", "BYTES": "STRING"}
# Triton 2.51 (class_count=4) for these rows, over gRPC and HTTP alike
ROWS = {"INT32": [0, 5, 3, 5, 255, 128, 1], "UINT8": [0, 5, 3, 5, 255, 128, 1], "INT8": [0, 5, 3, 5, -1, -128, 1],
        "FP32": [0, 5, 3, 5, 255, 128, 1.5], "FP64": [0, 5, 3, 5, 255, 128, 1.5]}
TRITON = {"INT32": ["255:4", "128:5", "5:1", "5:3"], "UINT8": ["255:4", "128:5", "5:1", "5:3"],
          "INT8": ["5:1", "5:3", "3:2", "1:6"],
          "FP32": ["255.000000:4", "128.000000:5", "5.000000:1", "5.000000:3"],
          "FP64": ["255.000000:4", "128.000000:5", "5.000000:1", "5.000000:3"]}
DECOUPLED_PY = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            sender = r.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x[:, ::-1].copy())]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _config(name: str, datatype: str, kind: str) -> str:
    t = "TYPE_" + CONFIG_TYPE.get(datatype, datatype)
    where = 'platform: "onnxruntime_onnx"' if kind == "onnx" else 'backend: "python"'
    return (f'name: "{name}"\n{where}\nmax_batch_size: 8\n'
            f'input [ {{ name: "INPUT0" data_type: {t} dims: [ -1 ] }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: {t} dims: [ -1 ] }} ]\n')


@pytest.fixture(scope="module", params=["onnx", "python"])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    kind = request.param
    repo = tmp_path_factory.mktemp(f"classify-{kind}")
    for datatype, (elem, _) in TYPES.items():
        name = f"id_{datatype.lower()}"
        if kind == "onnx":
            models.write(repo, name, _config(name, datatype, kind), {1: models.identity(elem)})
        else:
            models.write(repo, name, _config(name, datatype, kind),
                         {1: lambda path: path.write_text(PY_IDENTITY)}, filename="model.py")
    if kind == "python":  # a decoupled model: each of its responses is classified
        models.write(repo, "decoupled", _config("decoupled", "FP32", kind)
                     + "model_transaction_policy { decoupled: true }\n",
                     {1: lambda path: path.write_text(DECOUPLED_PY)}, filename="model.py")
    with served(kind, repo) as s:
        yield s.gateway


def _classify(gateway: Proc, proto: str, datatype: str, row: list, k: int) -> list[list[str]]:
    m = MODULES[proto]
    x = np.array([row], dtype=TYPES[datatype][1])
    inp = m.InferInput("INPUT0", list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    with m.InferenceServerClient(getattr(gateway, proto)) as c:
        res = c.infer(f"id_{datatype.lower()}", [inp], outputs=[m.InferRequestedOutput("OUTPUT0", class_count=k)])
    return [[e.decode() for e in r] for r in res.as_numpy("OUTPUT0")]


@pytest.mark.parametrize("proto", ["grpc", "http"])
@pytest.mark.parametrize("datatype", list(TRITON))
def test_classification_answers_as_triton(gateway: Proc, proto: str, datatype: str) -> None:
    assert _classify(gateway, proto, datatype, ROWS[datatype], 4) == [TRITON[datatype]]


@pytest.mark.parametrize("proto", ["grpc", "http"])
@pytest.mark.parametrize("datatype", ["FP16", "BOOL", "BYTES"])
def test_classification_of_a_datatype_triton_does_not_classify_is_refused_in_its_words(
        gateway: Proc, proto: str, datatype: str) -> None:
    row = [b"a", b"b"] if datatype == "BYTES" else [0, 1]
    with pytest.raises(InferenceServerException) as err:
        _classify(gateway, proto, datatype, row, 1)
    assert err.value.status() == ("StatusCode.INVALID_ARGUMENT" if proto == "grpc" else "400")
    assert err.value.message() == f"class result not available for output due to unsupported type '{datatype}'"


def test_a_responses_classified_entries_are_bounded(gateway: Proc) -> None:
    row = np.arange(MAX_CLASSIFIED + 1, dtype=np.float32).tolist()  # 1 MiB
    with pytest.raises(InferenceServerException) as err:
        _classify(gateway, "grpc", "FP32", row, MAX_CLASSIFIED + 1)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message() == (
        f"model 'id_fp32' output 'OUTPUT0': classification of {MAX_CLASSIFIED + 1} classes for 1 row(s) "
        f"makes {MAX_CLASSIFIED + 1} entries, more than {MAX_CLASSIFIED} in one response")
    # at the bound it is served: the largest first
    got = _classify(gateway, "grpc", "FP32", row, MAX_CLASSIFIED)
    assert len(got[0]) == MAX_CLASSIFIED
    assert got[0][:2] == [f"{MAX_CLASSIFIED:.6f}:{MAX_CLASSIFIED}", f"{MAX_CLASSIFIED - 1:.6f}:{MAX_CLASSIFIED - 1}"]
    assert got[0][-1] == "1.000000:1"


def test_a_decoupled_models_responses_are_classified_each_and_bounded(gateway: Proc,
                                                                     request: pytest.FixtureRequest) -> None:
    if request.node.callspec.params["gateway"] != "python":
        pytest.skip("decoupled models are python models")
    got: queue.Queue = queue.Queue()
    wide = np.arange(MAX_CLASSIFIED + 1, dtype=np.float32).reshape(1, -1)
    with grpcclient.InferenceServerClient(gateway.grpc) as c:
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        for rid, x, k in [("past", wide, MAX_CLASSIFIED + 1), ("good", np.array([[0.5, 2, 1]], np.float32), 2)]:
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            c.async_stream_infer("decoupled", [inp], request_id=rid,
                                 outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=k)])
        answers = [got.get(timeout=30) for _ in range(3)]  # the refused one's error, the good one's two
        c.stop_stream()
    errors = [e for _, e in answers if e is not None]
    assert len(errors) == 1, errors  # (in band: a stream's error carries its text, no status)
    assert errors[0].message().endswith(f"makes {MAX_CLASSIFIED + 1} entries, more than {MAX_CLASSIFIED} in one response")
    good = [[e.decode() for e in r.as_numpy("OUTPUT0").reshape(-1)] for r, e in answers if e is None]
    assert good == [["2.000000:1", "1.000000:2"], ["2.000000:1", "1.000000:0"]]


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_an_output_requested_twice_is_refused_in_tritons_words(gateway: Proc, proto: str) -> None:
    """Triton's core refuses it since 2026-04 ("output 'OUTPUT0' already exists in request",
    NVIDIA's qa/L0_http asserts it; 2.51 answered it once). Before, an ONNX model answered the
    output twice over gRPC, and HTTP refused it in other words."""
    m = MODULES[proto]
    x = np.array([[0, 5, 3]], dtype=np.int32)
    inp = m.InferInput("INPUT0", list(x.shape), "INT32")
    inp.set_data_from_numpy(x)
    with m.InferenceServerClient(getattr(gateway, proto)) as c, pytest.raises(InferenceServerException) as err:
        c.infer("id_int32", [inp], outputs=[m.InferRequestedOutput("OUTPUT0"),
                                            m.InferRequestedOutput("OUTPUT0", class_count=1)])
    assert err.value.status() == ("StatusCode.INVALID_ARGUMENT" if proto == "grpc" else "400")
    assert err.value.message() == "output 'OUTPUT0' already exists in request"

