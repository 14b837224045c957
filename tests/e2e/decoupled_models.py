"""Python-backend models for the streaming tests, written the way Triton's python_backend
examples write them (decoupled ``repeat_int32`` and ``square_int32``, examples/decoupled/: their
one source is tests/models/python_models.py), plus a faulty decoupled model and small
non-decoupled ones for the generate extension.

``build(root)`` writes a Triton model repository under ``root``; the same tree loads in the real
Triton 2.51 (its answers, recorded: tests/e2e/triton_reference.md) and in meshserve's python
service.
"""
from __future__ import annotations

from pathlib import Path

from tests.models.python_models import (
    REPEAT_CONFIG,
    REPEAT_INT32,
    SQUARE_CONFIG,
    SQUARE_INT32,
    config,
    model_source,
)

# A decoupled model whose second response is an error: a stream's in-band error, and the error
# event of generate_stream.
FAULTY_STREAM_CONFIG = config("faulty_stream", [("IN", "TYPE_INT32", "1")], [("OUT", "TYPE_INT32", "1")],
                              extra="model_transaction_policy { decoupled: true }\n")

FAULTY_STREAM_MODEL = model_source('''
    n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
    sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", np.array([n], np.int32))]))
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"faulty_stream failed on {n}")))
''', decoupled=True)

# Not decoupled: the usual text-in, text-out shape of an LLM front (generate's text_input /
# text_output), with a request parameter echoed into the answer.
TEXT_ECHO_CONFIG = """
name: "text_echo"
backend: "python"
max_batch_size: 0
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "count" data_type: TYPE_INT32 dims: [ 1 ] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "lengths" data_type: TYPE_INT32 dims: [ 2 ] }
]
"""

TEXT_ECHO_MODEL = model_source('''
    text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
    count = pb_utils.get_input_tensor_by_name(request, "count")
    times = 1 if count is None else int(count.as_numpy()[0])
    suffix = json.loads(request.parameters()).get("suffix", "")
    answer = (text.decode() * times) + str(suffix)
    responses.append(pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([answer.encode()], dtype=np.object_)),
        pb_utils.Tensor("lengths", np.array([len(text), len(answer)], dtype=np.int32))]))
''', imports='import json\n\nimport numpy as np\n')

# Not decoupled, batched: generate's scalars and lists against a model with a batch dimension.
ADD_SUB_CONFIG = config("add_sub_py", [("INPUT0", "TYPE_FP32", "4"), ("INPUT1", "TYPE_FP32", "4")],
                        [("OUTPUT0", "TYPE_FP32", "4"), ("OUTPUT1", "TYPE_FP32", "4")], max_batch_size=8)

ADD_SUB_MODEL = model_source('''
    a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
    b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
    responses.append(pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
''', imports='')

MODELS = {
    "repeat_int32": (REPEAT_CONFIG, REPEAT_INT32),
    "square_int32": (SQUARE_CONFIG, SQUARE_INT32),
    "faulty_stream": (FAULTY_STREAM_CONFIG, FAULTY_STREAM_MODEL),
    "text_echo": (TEXT_ECHO_CONFIG, TEXT_ECHO_MODEL),
    "add_sub_py": (ADD_SUB_CONFIG, ADD_SUB_MODEL),
}


def build(root: Path) -> Path:
    """Write the models above as a Triton repository under ``root``; returns ``root``."""
    for name, (config_text, model) in MODELS.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config_text.lstrip())
        (root / name / "1" / "model.py").write_text(model.lstrip())
    return root
