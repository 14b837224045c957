"""services/base/classification.py: Triton's order and text for every datatype it classifies, the
partial selection of wide rows against a whole sort, and the bound on a response's entries (one
request of a group fails alone)."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import NO_HOP
from services.base.classification import MAX_CLASSIFIED, PARTIAL_MIN, _smallest, classify
from services.base.serialization import ResponseEncoder
from services.base.validation import ModelTensors, prepare


def test_the_extremes_of_each_integer_type_sort_by_value() -> None:
    # (-x of a signed minimum overflows, of an unsigned value wraps: neither may reorder them)
    for dt, datatype in [(np.uint8, "UINT8"), (np.uint64, "UINT64"), (np.int8, "INT8"), (np.int64, "INT64")]:
        info = np.iinfo(dt)
        row = np.array([0, info.max, info.min, 5, info.min], dtype=dt)
        got = classify(row, 5, datatype, (), False, MAX_CLASSIFIED, "m").tolist()
        expect = sorted(((int(v), i) for i, v in enumerate(row)), key=lambda e: (-e[0], e[1]))
        assert got == [f"{v}:{i}" for v, i in expect], datatype


def test_labels_shapes_and_k_cut_to_the_row() -> None:
    rows = np.array([[0.5, 0.25, 0.75], [3, 2, 1]], dtype=np.float32)
    got = classify(rows, 10, "FP32", ("cat", "", "bird"), True, MAX_CLASSIFIED, "m")
    assert got.shape == (2, 3)
    assert got.tolist() == [["0.750000:2:bird", "0.500000:0:cat", "0.250000:1"],
                            ["3.000000:0:cat", "2.000000:1", "1.000000:2:bird"]]
    assert classify(rows[0], 2, "FP32", (), False, MAX_CLASSIFIED, "m").shape == (2,)
    assert classify(np.zeros((0, 3), np.float32), 2, "FP32", (), True, MAX_CLASSIFIED, "m").shape == (0, 2)


@pytest.mark.parametrize("datatype", ["FP16", "BF16", "BOOL", "BYTES"])
def test_datatypes_triton_does_not_classify_are_refused_in_its_words(datatype: str) -> None:
    with pytest.raises(InferError) as err:
        classify(np.zeros(2, np.uint8), 1, datatype, (), False, MAX_CLASSIFIED, "m")
    assert err.value.code == Code.INVALID_ARG
    assert err.value.message == f"class result not available for output due to unsupported type '{datatype}'"


def test_a_wide_row_is_partitioned_to_the_same_answer_as_a_whole_sort() -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(PARTIAL_MIN, 4 * PARTIAL_MIN))
        k = int(rng.integers(1, n // 4 + 1))
        x = rng.integers(-3, 3, n).astype(np.float32)  # many equal values: ties at the k-th
        if rng.random() < 0.3:
            x[rng.integers(0, n, int(rng.integers(1, n)))] = np.nan
        key = -x
        assert _smallest(key, k).tolist() == np.argsort(key, kind="stable")[:k].tolist()
        whole = [f"{v:f}:{i}" for i, v in ((int(i), float(x[i])) for i in np.argsort(key, kind="stable")[:k])]
        assert classify(x, k, "FP32", (), False, MAX_CLASSIFIED, "m").tolist() == whole


def test_the_bound_counts_a_responses_outputs_together_and_fails_that_request_alone() -> None:
    model = ModelTensors.from_config(text_format.Parse("""name: "two" max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]""",
        mc.ModelConfig()))
    encoder = ResponseEncoder(model, "1")
    width = MAX_CLASSIFIED // 2 + 1

    def payload(ks: tuple[int, int]):  # type: ignore[no-untyped-def]
        r = pb.ModelInferRequest(model_name="two")
        r.inputs.add(name="IN", datatype="FP32", shape=[1, width])
        r.raw_input_contents.append(np.zeros(width, np.float32).tobytes())
        for name, k in zip("AB", ks, strict=True):
            o = r.outputs.add(name=name)
            o.parameters["classification"].int64_param = k
        return prepare(model, r, NO_HOP)

    produced = {n: np.arange(2 * width, dtype=np.float32).reshape(2, width) for n in "AB"}
    both, one = encoder.encode([payload((width, width)), payload((width, 1))], produced)
    assert isinstance(both, InferError) and both.code == Code.INVALID_ARG
    assert both.message == (f"model 'two' output 'B': classification of {width} classes for 1 row(s) makes {width} "
                         f"entries, more than {MAX_CLASSIFIED} in one response")
    resp = pb.ModelInferResponse.FromString(one)  # the group's other request is answered
    assert [list(o.shape) for o in resp.outputs] == [[1, width], [1, 1]]


@pytest.mark.parametrize("ks", [(0, 2), (0, 0)])
def test_an_output_requested_twice_is_refused_in_tritons_words(ks: tuple[int, int]) -> None:
    """Triton's core refuses it since 2026-04 (AddOriginalRequestedOutput; NVIDIA's qa/L0_http
    asserts the text); an ONNX model answered it twice before."""
    model = ModelTensors.from_config(text_format.Parse("""name: "m" max_batch_size: 8
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ -1 ] } ]""",
        mc.ModelConfig()))
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="IN", datatype="FP32", shape=[1, 3])
    r.raw_input_contents.append(np.zeros(3, np.float32).tobytes())
    for name, k in (("A", ks[0]), ("B", 0), ("A", ks[1])):
        o = r.outputs.add(name=name)
        if k:
            o.parameters["classification"].int64_param = k
    with pytest.raises(InferError) as err:
        prepare(model, r, NO_HOP)
    assert err.value.message == "output 'A' already exists in request"
