"""services/base/validation.py's refusals in Triton's words, where NVIDIA's own QA asserts them:
L0_input_validation's two texts for a request without its required inputs (core's
infer_request.cc, ValidateRequestInputs), with its models' configs."""
from __future__ import annotations

import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from meshserve.server.core import NO_HOP
from services.base.validation import ModelTensors, prepare


def _model(name: str, optional: bool) -> ModelTensors:
    inputs = ", ".join(f'{{ name: "INPUT{i}" data_type: TYPE_FP32 dims: [ 1 ] }}' for i in range(3))
    if optional:
        inputs += ', { name: "INPUT3" data_type: TYPE_FP32 dims: [ 1 ] optional: true }'
    return ModelTensors.from_config(text_format.Parse(
        f'name: "{name}" max_batch_size: 8 input [ {inputs} ] '
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]', mc.ModelConfig()))


@pytest.mark.parametrize(("name", "optional", "expected"), [
    ("input_all_required", False, "expected 3 inputs but got 0 inputs for model 'input_all_required'. Got input(s) "
     "[], but missing required input(s) ['INPUT0','INPUT1','INPUT2']. Please provide all required input(s)."),
    ("input_optional", True, "expected number of inputs between 3 and 4 but got 0 inputs for model "
     "'input_optional'. Got input(s) [], but missing required input(s) ['INPUT0','INPUT1','INPUT2']. Please "
     "provide all required input(s)."),
])
def test_a_request_without_its_required_inputs_is_refused_as_triton_words_it(name: str, optional: bool,
                                                                             expected: str) -> None:
    with pytest.raises(InferError) as err:
        prepare(_model(name, optional), pb.ModelInferRequest(model_name=name), NO_HOP)
    assert err.value.message == expected


def test_the_inputs_it_got_are_listed_in_its_order() -> None:
    request = pb.ModelInferRequest(model_name="input_optional")
    for name in ("INPUT3", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(InferError) as err:
        prepare(_model("input_optional", True), request, NO_HOP)
    assert err.value.message == (
        "expected number of inputs between 3 and 4 but got 2 inputs for model 'input_optional'. Got input(s) "
        "['INPUT3','INPUT1'], but missing required input(s) ['INPUT0','INPUT2']. Please provide all required input(s).")
