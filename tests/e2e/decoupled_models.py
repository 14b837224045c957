"""Python-backend models for the streaming tests, written the way Triton's python_backend
examples write them (decoupled ``repeat_int32`` and ``square_int32``, examples/decoupled/),
plus two small non-decoupled models for the generate extension.

``build(root)`` writes a Triton model repository under ``root``; the same tree loads in the real
Triton 2.51 (its answers, recorded: tests/e2e/triton_reference.md) and in meshserve's python
service.
"""
from __future__ import annotations

from pathlib import Path

REPEAT_CONFIG = """
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# One response per element of IN (OUT = IN[i], IDX = i), each after DELAY[i] ms, sent from a
# thread of its own; WAIT ms after the last one, the final flag alone (an empty final response).
REPEAT_MODEL = '''
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
            if values.shape != delays.shape:
                sender = request.get_response_sender()
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"expected IN and DELAY of the same shape, got {values.shape} and {delays.shape}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            worker = threading.Thread(target=self.respond, daemon=True,
                                      args=(request.get_response_sender(), values, delays, wait))
            with self.lock:
                self.threads.append(worker)
            worker.start()
        return None

    def respond(self, sender, values, delays, wait):
        for index, (value, delay) in enumerate(zip(values, delays)):
            time.sleep(int(delay) / 1000)
            out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
        time.sleep(int(wait[0]) / 1000)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for worker in threads:
            worker.join(timeout=10)
'''

SQUARE_CONFIG = """
name: "square_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

# IN = [n]: n responses, each OUT = [n], then the final flag alone (n = 0: no response at all).
SQUARE_MODEL = '''
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            worker = threading.Thread(target=self.respond, daemon=True, args=(request.get_response_sender(), n))
            self.threads.append(worker)
            worker.start()
        return None

    def respond(self, sender, n):
        for _ in range(n):
            out = pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for worker in self.threads:
            worker.join(timeout=10)
'''

# A decoupled model whose second response is an error: a stream's in-band error, and the error
# event of generate_stream.
FAULTY_STREAM_CONFIG = """
name: "faulty_stream"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

FAULTY_STREAM_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", np.array([n], np.int32))]))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"faulty_stream failed on {n}")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

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

TEXT_ECHO_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            count = pb_utils.get_input_tensor_by_name(request, "count")
            times = 1 if count is None else int(count.as_numpy()[0])
            suffix = json.loads(request.parameters()).get("suffix", "")
            answer = (text.decode() * times) + str(suffix)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([answer.encode()], dtype=np.object_)),
                pb_utils.Tensor("lengths", np.array([len(text), len(answer)], dtype=np.int32))]))
        return responses
'''

# Not decoupled, batched: generate's scalars and lists against a model with a batch dimension.
ADD_SUB_CONFIG = """
name: "add_sub_py"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""

ADD_SUB_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''

MODELS = {
    "repeat_int32": (REPEAT_CONFIG, REPEAT_MODEL),
    "square_int32": (SQUARE_CONFIG, SQUARE_MODEL),
    "faulty_stream": (FAULTY_STREAM_CONFIG, FAULTY_STREAM_MODEL),
    "text_echo": (TEXT_ECHO_CONFIG, TEXT_ECHO_MODEL),
    "add_sub_py": (ADD_SUB_CONFIG, ADD_SUB_MODEL),
}


def build(root: Path) -> Path:
    """Write the models above as a Triton repository under ``root``; returns ``root``."""
    for name, (config, model) in MODELS.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config.lstrip())
        (root / name / "1" / "model.py").write_text(model.lstrip())
    return root
