"""triton_python_backend_utils as meshserve's worker provides it: the parts a model uses
without a service (tensors, errors, auto-complete's ModelConfig, the config JSON it sees)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from services.python import pb_utils
from services.python.autocomplete import config_json
from services.python.core import render_custom_metrics


def test_tensor_keeps_numpy_and_maps_datatypes() -> None:
    t = pb_utils.Tensor("OUT", np.arange(4, dtype=np.float32).reshape(2, 2))
    assert t.name() == "OUT" and t.shape() == [2, 2] and t.triton_dtype() == 11 and t.is_cpu()
    assert pb_utils.wire_datatype(t.as_numpy()) == "FP32"
    assert pb_utils.wire_datatype(np.array([b"a"], dtype=np.object_)) == "BYTES"
    assert pb_utils.triton_string_to_numpy("TYPE_INT64") is np.int64
    # the stub's words (pb_stub_utils.cc); "... Please use np.object_ instead." was the Python stub's
    # before python_backend #62
    with pytest.raises(pb_utils.TritonModelException, match="^NumPy dtype is not supported.$"):
        pb_utils.Tensor("S", np.array(["text"]))
    back = pb_utils.Tensor.from_dlpack("X", np.arange(3, dtype=np.int32))
    assert back.as_numpy().tolist() == [0, 1, 2]


def test_bytes_tensors_round_trip() -> None:
    arr = np.array([b"ab", b"", "é"], dtype=np.object_)
    data = pb_utils.serialize_byte_tensor(arr)
    assert data is not None
    assert pb_utils.deserialize_bytes_tensor(data.tobytes()).tolist() == [b"ab", b"", "é".encode()]


def test_triton_error_codes_and_response() -> None:
    err = pb_utils.TritonError("bad input", pb_utils.TritonError.INVALID_ARG)
    assert err.message() == "bad input" and err.code() == 3
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    resp = pb_utils.InferenceResponse(error=err)
    assert resp.has_error() and resp.output_tensors() == []
    with pytest.raises(pb_utils.TritonModelException, match='"output_tensors" must be a list'):
        pb_utils.InferenceResponse(output_tensors=("not", "a list"))  # type: ignore[arg-type]
    # a non-decoupled model's request has a response sender too (Triton 24.10): exactly one response
    req = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=["A"])
    sender = req.get_response_sender()
    with pytest.raises(pb_utils.TritonModelException, match="cannot send complete final before sending a response"):
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    sender.send(resp)
    with pytest.raises(pb_utils.TritonModelException, match="Non-decoupled model cannot send more than one response"):
        sender.send(resp)


def test_model_config_auto_complete_rules() -> None:
    cfg = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 0,
                                           "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}]}))
    cfg.set_max_batch_size(8)
    cfg.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})  # the same: fine
    cfg.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [-1]})
    cfg.set_dynamic_batching()
    cfg.set_model_transaction_policy({"decoupled": True})
    d = cfg.as_dict()
    assert d["max_batch_size"] == 8 and len(d["input"]) == 1 and d["output"][0]["name"] == "Y"
    assert d["dynamic_batching"] == {} and d["model_transaction_policy"] == {"decoupled": True}
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32 for input 'X', model provides"):
        cfg.add_input({"name": "X", "data_type": "TYPE_INT8", "dims": [4]})
    with pytest.raises(ValueError, match="the model expects dims \\[5\\] but the model configuration specifies dims"):
        cfg.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="is missing 'dims' property"):
        cfg.add_output({"name": "Z", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="specified max_batch_size 8"):
        cfg.set_max_batch_size(2)
    with pytest.raises(ValueError, match="already set to 'True'"):
        cfg.set_model_transaction_policy({"decoupled": False})


def test_metrics_and_their_merge_across_instances() -> None:
    fam = pb_utils.MetricFamily("unit_requests", "help", pb_utils.MetricFamily.COUNTER)
    m = fam.Metric(labels={"k": "v"})
    other = fam.Metric(labels={"k": "v"})  # same family and labels: the same metric (another object, as the stub's)
    m.increment(2)
    assert m.value() == other.value() == 2
    with pytest.raises(pb_utils.TritonModelException):
        m.increment(-1)
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.MetricFamily("bad-name", "", pb_utils.MetricFamily.GAUGE)
    mine = [x for x in pb_utils.metrics_snapshot() if x[0] == "unit_requests"]
    assert [(x[3], x[4]) for x in mine] == [((("k", "v"),), 2.0)]
    # two instances' snapshots: counters add up, a gauge shows the later set
    text = render_custom_metrics([
        ("c", "a counter", 0, (("m", "x"),), 2.0, 1.0), ("c", "a counter", 0, (("m", "x"),), 3.0, 2.0),
        ("g", "a gauge", 1, (("m", "x"),), 7.0, 5.0), ("g", "a gauge", 1, (("m", "x"),), 1.0, 4.0)]).decode()
    assert text.splitlines() == ["# HELP c a counter", "# TYPE c counter", 'c{m="x"} 5',
                                 "# HELP g a gauge", "# TYPE g gauge", 'g{m="x"} 7']
    assert render_custom_metrics([]) == b""


def test_config_json_is_tritons_form() -> None:
    config = text_format.Parse('name: "m" backend: "python" max_batch_size: 4 '
                               'input { name: "X" data_type: TYPE_FP32 dims: [ 4, -1 ] }', mc.ModelConfig())
    as_dict = json.loads(config_json(config))
    assert as_dict["input"][0]["dims"] == [4, -1]  # numbers, not protobuf's int64 strings
    assert as_dict["input"][0]["data_type"] == "TYPE_FP32" and as_dict["max_batch_size"] == 4
    assert pb_utils.get_input_config_by_name(as_dict, "X") is as_dict["input"][0]
    assert pb_utils.get_output_config_by_name(as_dict, "X") is None


def test_dlpack_round_trip_with_torch() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils import dlpack

    t = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
    as_torch = dlpack.from_dlpack(t.to_dlpack())
    assert as_torch.shape == (2, 3) and as_torch.dtype == torch.float32
    back = pb_utils.Tensor.from_dlpack("Y", as_torch * 2)
    assert back.name() == "Y" and back.as_numpy().tolist() == [[0, 2, 4], [6, 8, 10]]
    capsule = pb_utils.Tensor.from_dlpack("Z", dlpack.to_dlpack(torch.ones(2, dtype=torch.int64)))
    assert capsule.as_numpy().dtype == np.int64 and capsule.as_numpy().tolist() == [1, 1]
