"""services/onnx/runtime.py:check_against_graph: a config is checked against its ONNX graph at
load with Triton's onnxruntime-backend texts; OnnxInstance feeds scalars and runs BF16."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.base.runtime import RuntimeLoadError
from services.onnx.runtime import OnnxInstance, check_against_graph
from tests.models.tensors import onnx_identity, scalar_double

IDENTITY = """name: "m" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _session(model: object) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])  # type: ignore[attr-defined]


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_a_matching_config_passes() -> None:
    check_against_graph(_session(onnx_identity("FP32")), _config(IDENTITY))
    check_against_graph(_session(onnx_identity("BF16")), _config(IDENTITY.replace("TYPE_FP32", "TYPE_BF16")))


@pytest.mark.parametrize(("change", "text"), [
    (lambda c: setattr(c.input[0], "data_type", mc.TYPE_INT32),
     "unable to load model 'm', configuration expects datatype TYPE_INT32 for input 'INPUT0', model provides TYPE_FP32"),
    (lambda c: setattr(c.output[0], "data_type", mc.TYPE_FP16),
     "unable to load model 'm', configuration expects datatype TYPE_FP16 for output 'OUTPUT0', model provides "
     "TYPE_FP32"),
    (lambda c: c.input.add(name="EXTRA", data_type=mc.TYPE_FP32, dims=[1]),
     "unable to load model 'm', configuration expects 2 inputs, model provides 1"),
    (lambda c: setattr(c.output[0], "name", "OUT"), "unexpected inference output 'OUT', allowed outputs are: OUTPUT0"),
    (lambda c: c.input[0].dims.append(2),
     "model 'm', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,-1]) but the model configuration "
     "specifies 3 dimensions (an initial batch dimension because max_batch_size > 0 followed by the explicit "
     "tensor shape, making complete shape [-1,-1,2])"),
    (lambda c: setattr(c, "max_batch_size", 0),
     "model 'm', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,-1]) but the model configuration "
     "specifies 1 dimensions (shape [-1])"),
    # outputs compare exactly (Triton: compare_exact): a fixed dim where the graph has -1 is refused
    (lambda c: c.output[0].dims.__setitem__(0, 4),
     "model 'm', tensor 'OUTPUT0': the model expects 2 dimensions (shape [-1,-1]) but the model configuration "
     "specifies 2 dimensions (an initial batch dimension because max_batch_size > 0"),
])
def test_contradictions_are_refused_with_triton_s_text(change, text: str) -> None:  # type: ignore[no-untyped-def]
    config = _config(IDENTITY)
    change(config)
    with pytest.raises(RuntimeLoadError) as err:
        check_against_graph(_session(onnx_identity("FP32")), config)
    assert text in str(err.value)


def test_inputs_accept_fixed_dims_where_the_graph_has_variable_ones() -> None:
    config = _config(IDENTITY)
    config.input[0].dims[0] = 16
    check_against_graph(_session(onnx_identity("FP32")), config)


def test_scalars() -> None:
    """A scalar graph tensor takes dims of 1s only; batching needs a batch dimension."""
    ok = _config("""name: "s" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]""")
    check_against_graph(_session(scalar_double()), ok)
    ok.input[0].dims[0] = 3
    with pytest.raises(RuntimeLoadError, match=r"scalar tensor 'X', should only provide 1 in the model configuration "
                                               r"when the model doesn't support batching. Model configuration "
                                               r"provided: \[3\]\."):
        check_against_graph(_session(scalar_double()), ok)


def test_batching_needs_a_variable_first_dimension() -> None:
    from onnx import TensorProto, helper

    from tests.support.models import onnx_model

    fixed = onnx_model([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "fixed",
                       [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [4, 2])],
                       [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [4, 2])])
    with pytest.raises(RuntimeLoadError) as err:
        check_against_graph(_session(fixed), _config(IDENTITY))
    assert str(err.value) == ("model 'm', tensor 'INPUT0': for the model to support batching the shape should have at "
                              "least 1 dimension and the first dimension must be -1; but shape expected by the model "
                              "is [4,2]")


def test_hidden_sequence_tensors_are_counted_once() -> None:
    """The sequence service lists state and control inputs among the inputs too."""
    config = _config(IDENTITY)
    config.sequence_batching.state.add(input_name="INPUT0", output_name="OUTPUT0", data_type=mc.TYPE_FP32, dims=[-1])
    check_against_graph(_session(onnx_identity("FP32")), config)


def test_a_scalar_input_is_fed_a_true_scalar() -> None:
    inst = OnnxInstance(_session(scalar_double()), batched=False)
    out = inst.run({"X": np.array([3.0], np.float32)}, ["Y"])
    assert out["Y"].shape == () and out["Y"] == 6.0
    batched = OnnxInstance(_session(scalar_double()), batched=True)
    assert batched.runs_alone and not inst.runs_alone
    with pytest.raises(InferError, match="input 'X' is a scalar in the model"):
        batched.run({"X": np.array([[1.0], [2.0]], np.float32)}, ["Y"])


def test_bf16_bits_pass_through() -> None:
    bits = np.array([[0x7FC1, 0xFFA2, 0x0001, 0x7F80], [0xFF80, 0x8000, 0x7F7F, 0x3F80]], dtype=np.uint16)
    inst = OnnxInstance(_session(onnx_identity("BF16")), batched=True)
    for _ in range(2):  # (the instance's binding is reused)
        out = inst.run({"INPUT0": bits}, ["OUTPUT0"])["OUTPUT0"]
        assert out.dtype == np.uint16 and out.shape == bits.shape and out.tobytes() == bits.tobytes()
    empty = inst.run({"INPUT0": np.zeros((1, 0), np.uint16)}, ["OUTPUT0"])["OUTPUT0"]
    assert empty.shape == (1, 0)


def test_a_bf16_model_warms_up() -> None:
    """model_warmup feeds a BF16 input its raw bits (uint16), which the instance runs."""
    from pathlib import Path

    from services.base.warmup import warmup_inputs

    config = _config(IDENTITY.replace("TYPE_FP32", "TYPE_BF16") + """model_warmup [ { name: "w" batch_size: 2
inputs { key: "INPUT0" value: { data_type: TYPE_BF16 dims: [ 3 ] random_data: true } } } ]""")
    feeds = warmup_inputs(config, config.model_warmup[0], Path("."))
    assert feeds["INPUT0"].dtype == np.uint16 and feeds["INPUT0"].shape == (2, 3)
    out = OnnxInstance(_session(onnx_identity("BF16")), batched=True).run(dict(feeds), ["OUTPUT0"])
    assert out["OUTPUT0"].tobytes() == feeds["INPUT0"].tobytes()
