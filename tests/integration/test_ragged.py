"""Ragged batching (Triton semantics): requests of different lengths share one execution; the
model sees the ragged input as one 1-D tensor plus a generated batch input (accumulated element
counts), and a batch output is scattered back to each request in its own input's shape."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from tests.conftest import Proc, start
from tests.support import models

CONFIG = """name: "ragged"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" data_type: TYPE_FP32 source_input: "INPUT" } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "ENDS" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]
batch_output [ { target_name: "OUTPUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT" } ]
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 2000000 }
"""


def model() -> onnx.ModelProto:
    two = helper.make_tensor("TWO", TensorProto.FLOAT, [], [2.0])
    return models.onnx_model(
        [helper.make_node("Mul", ["INPUT", "TWO"], ["OUTPUT"]), helper.make_node("Identity", ["INDEX"], ["ENDS"])],
        "ragged",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("INDEX", TensorProto.FLOAT, ["b"])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("ENDS", TensorProto.FLOAT, ["b"])], [two])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo: Path = tmp_path_factory.mktemp("ragged")
    models.write(repo, "ragged", CONFIG, {1: model()})
    svc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    yield svc
    svc.stop()


def test_requests_of_different_lengths_share_one_execution(service: Proc) -> None:
    inputs = [np.arange(n, dtype=np.float32).reshape(1, n) + 10 * n for n in (3, 4, 5)]

    def send(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with grpcclient.InferenceServerClient(service.grpc) as c:
            inp = grpcclient.InferInput("INPUT", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            res = c.infer("ragged", [inp])
            return res.as_numpy("OUTPUT"), res.as_numpy("ENDS")

    with httpclient.InferenceServerClient(service.http) as c:
        before = c.get_inference_statistics("ragged")["model_stats"][0]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(send, inputs))
    for x, (out, _) in zip(inputs, results, strict=True):
        assert out.shape == x.shape  # scattered back in the request's own shape
        np.testing.assert_array_equal(out, x * 2)
    # the model saw one batch: INDEX = accumulated element counts of the three requests
    ends = sorted(float(e.reshape(-1)[0]) for _, e in results)
    assert len(set(ends)) == 3 and ends[-1] == 12.0, ends
    with httpclient.InferenceServerClient(service.http) as c:
        after = c.get_inference_statistics("ragged")["model_stats"][0]
    assert after["execution_count"] - before["execution_count"] == 1
    assert after["inference_count"] - before["inference_count"] == 3


def test_batch_input_kinds() -> None:
    from meshserve._proto import model_config_pb2 as mc
    from services.base.batching import batch_input_value

    shapes = [(1, 3), (1, 4), (1, 5)]
    f32 = np.dtype(np.float32)
    k = mc.BatchInput
    assert batch_input_value(mc.BatchInput(kind=k.BATCH_ELEMENT_COUNT), shapes, f32).tolist() == [3, 4, 5]
    assert batch_input_value(mc.BatchInput(kind=k.BATCH_ACCUMULATED_ELEMENT_COUNT), shapes, f32).tolist() == [3, 7, 12]
    assert batch_input_value(mc.BatchInput(kind=k.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO), shapes,
                             f32).tolist() == [0, 3, 7, 12]
    assert batch_input_value(mc.BatchInput(kind=k.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE), shapes, f32).shape == (5,)
    assert batch_input_value(mc.BatchInput(kind=k.BATCH_ITEM_SHAPE), shapes, f32).tolist() == [[3], [4], [5]]
    assert batch_input_value(mc.BatchInput(kind=k.BATCH_ITEM_SHAPE_FLATTEN), shapes, f32).tolist() == [3, 4, 5]
