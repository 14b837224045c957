"""Python-backend test models (model.py + config.pbtxt), written the way Triton's python_backend
examples write them: add_sub, BLS (sync and async) calling another model, three faulty models
(raises / kills its worker / hangs), the decoupled repeat_int32 and square_int32, a model
configured only by ``auto_complete_config``, and the pre/post-processing steps of an ensemble.

    python -m tests.models.python_models OUT_DIR
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

WIDTH = 16


def model_source(body: str, *, imports: str = "import numpy as np\n", head: str = "", decoupled: bool = False) -> str:
    """A model.py in the shape of python_backend's examples, whose ``execute`` runs ``body`` once per
    request (named ``request``): the body appends to ``responses``, or, ``decoupled``, sends with
    ``sender`` (the request's response sender; the final flag follows the body). ``imports`` come
    before ``pb_utils``'s, ``head`` (module-level lines) after it."""
    inner = textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 12)
    if decoupled:
        loop = ("        for request in requests:\n            sender = request.get_response_sender()\n"
                f"{inner}\n            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)\n"
                "        return None\n")
    else:
        loop = f"        responses = []\n        for request in requests:\n{inner}\n        return responses\n"
    head = f"\n{head.strip()}\n" if head.strip() else ""
    return (f"\n{imports}import triton_python_backend_utils as pb_utils\n{head}\n\nclass TritonPythonModel:\n"
            f"    def execute(self, requests):\n{loop}")


# Module-level functions a model source can take (``with_helpers``): where time itself is what a
# model does, written once. (A model runs in a stub process that cannot import the test support.)
WORK_FOR = '''
def work_for(ms):
    time.sleep(ms / 1000)  # the point: the model is as slow as its request asks
'''

UNTIL_CANCELLED = '''
def until_cancelled(requests, seconds):
    """True once every request's client has gone (is_cancelled()), False after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not all(r.is_cancelled() for r in requests):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)  # the model's poll of is_cancelled() (pb_utils has no wait for it)
    return True
'''


def with_helpers(source: str, *helpers: str) -> str:
    """``source`` with the module-level ``helpers`` (WORK_FOR, UNTIL_CANCELLED) before its model class."""
    head = "\n\n".join(h.strip("\n") for h in helpers)
    return source.replace("\nclass TritonPythonModel", f"\n{head}\n\n\nclass TritonPythonModel", 1)


ADD_SUB = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0 = in_0.as_numpy() + in_1.as_numpy()
            out_1 = in_0.as_numpy() - in_1.as_numpy()
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1]))
        return responses

    def finalize(self):
        print("Cleaning up...")
'''

# How many requests each execute() got, per call: shows the dynamic batcher's lists.
BATCH_PROBE = model_source('''
    x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
    params = request.parameters()
    count = np.full(x.shape, len(requests), dtype=np.int32)
    info = np.array([params.encode()] * x.shape[0], dtype=np.object_).reshape(x.shape[0], 1)
    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("COUNT", count),
                                                 pb_utils.Tensor("PARAMS", info)]))
''')

BLS_SYNC = model_source('''
    # (bytes, as NVIDIA's bls example passes it: pybind11 takes bytes for a str argument)
    model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
    # the called model batches ([-1, 16]); this one does not ([16])
    inputs = [pb_utils.Tensor(n, pb_utils.get_input_tensor_by_name(request, n).as_numpy().reshape(1, -1))
              for n in ("INPUT0", "INPUT1")]
    infer_request = pb_utils.InferenceRequest(
        model_name=model_name, requested_output_names=["OUTPUT0", "OUTPUT1"], inputs=inputs)
    infer_response = infer_request.exec()
    if infer_response.has_error():
        raise pb_utils.TritonModelException(infer_response.error().message())
    responses.append(pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(n, pb_utils.get_output_tensor_by_name(infer_response, n).as_numpy().reshape(-1))
        for n in ("OUTPUT0", "OUTPUT1")]))
''')

BLS_ASYNC = '''
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0].decode()
            # the called model batches ([-1, 16]); this one does not ([16])
            inputs = [pb_utils.Tensor(n, pb_utils.get_input_tensor_by_name(request, n).as_numpy().reshape(1, -1))
                      for n in ("INPUT0", "INPUT1")]
            # two calls in flight at once: OUTPUT0 from the first, OUTPUT1 from the second
            awaits = [pb_utils.InferenceRequest(model_name=model_name, requested_output_names=[name],
                                                inputs=inputs).async_exec()
                      for name in ("OUTPUT0", "OUTPUT1")]
            first, second = await asyncio.gather(*awaits)
            for r in (first, second):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy().reshape(-1)),
                pb_utils.Tensor("OUTPUT1", pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy().reshape(-1))]))
        return responses
'''

# exec(decoupled=True) on square_int32: the responses of a decoupled model, summed
BLS_DECOUPLED = model_source('''
    n = pb_utils.get_input_tensor_by_name(request, "IN")
    infer_request = pb_utils.InferenceRequest(model_name="square_int32", requested_output_names=["OUT"],
                                              inputs=[n])
    total, count = 0, 0
    for r in infer_request.exec(decoupled=True):
        if r.has_error():
            raise pb_utils.TritonModelException(r.error().message())
        if len(r.output_tensors()) > 0:
            total += int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
            count += 1
    responses.append(pb_utils.InferenceResponse([
        pb_utils.Tensor("SUM", np.array([total], dtype=np.int32)),
        pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32))]))
''')

# A running sum per sequence, kept in the instance by correlation id (sequence batching sends a
# sequence's requests to one instance, in order); OUT also says which instance answered.
ACCUMULATE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid, flags = request.correlation_id(), request.flags()
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.sums[corrid] = 0
            self.sums[corrid] += int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().sum())
            total = self.sums[corrid]
            if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sums[corrid]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([[total]], dtype=np.int32)),
                pb_utils.Tensor("WHERE", np.array([[self.instance.encode()]], dtype=np.object_))]))
        return responses
'''

FAULTY_RAISE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [self.divide(r) for r in requests]

    def divide(self, request):
        return 1 / 0
'''

FAULTY_ERROR_RESPONSE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("INPUT0 is not welcome here",
                                                                      pb_utils.TritonError.INVALID_ARG))
                for _ in requests]
'''

FAULTY_INIT = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("the weights are missing")

    def execute(self, requests):
        return []
'''

FAULTY_KILL = '''
import os
import signal

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        os.kill(os.getpid(), signal.SIGKILL)
'''

# Its readiness is what the file named by its GATE parameter says, read at each check: "true",
# "false", "raise" (is_ready() raises), "none" (returns None), "async" (returns a coroutine that
# ends True), "sleep S" (True after S seconds). Each check appends a line to GATE.calls. It answers
# its worker's pid.
GATED = '''
import asyncio
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.gate = json.loads(args["model_config"])["parameters"]["GATE"]["string_value"]

    def is_ready(self):
        with open(self.gate + ".calls", "a") as calls:
            calls.write("check\\n")
        with open(self.gate) as f:
            word = f.read().strip()
        if word.startswith("sleep "):
            time.sleep(float(word.split()[1]))
            return True
        if word == "async":
            return self.later()
        if word == "raise":
            raise RuntimeError("the feature store is unreachable")
        if word == "none":
            return None
        return word == "true"

    async def later(self):
        await asyncio.sleep(0)
        return True

    def execute(self, requests):
        pid = np.array([os.getpid()], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]) for _ in requests]
'''

# Not decoupled, answers X[0] == 0 at once; X[0] == 1 from a thread after execute() returned (its
# response sender, the input read then: 2 * X); X[0] == 2 never (execute() returns None for it).
LATE_ANSWER = '''
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if x[0] == 0:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
                continue
            sender = r.get_response_sender()
            if x[0] == 1:
                threading.Thread(target=self.later, args=(r, sender), daemon=True).start()
            out.append(None)
        return out

    def later(self, request, sender):
        time.sleep(0.2)  # the point: after execute() returned, other requests' batches ran meanwhile
        x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

# Iterative sequence models (sequence_batching { iterative_sequence: true }): each execution of a
# request sends one response (decoupled: the count left, the worker's pid, the request's flags and
# correlation id) and reschedules it until IN[0] passes ran (Triton's iterative_sequence example).
ITERATE = '''
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    left = {}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            key = request.correlation_id()
            left = self.left.get(key, int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])) - 1
            out = [pb_utils.Tensor("OUT", np.array([left], np.int32)),
                   pb_utils.Tensor("PID", np.array([os.getpid()], np.int64)),
                   pb_utils.Tensor("FLAGS", np.array([request.flags()], np.int32)),
                   pb_utils.Tensor("CORRID", np.array([key], np.uint64))]
            if left > 0:
                self.left[key] = left
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(pb_utils.InferenceResponse(out))
                continue
            self.left.pop(key, None)
            sender.send(pb_utils.InferenceResponse(out), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

# Not decoupled: the first pass of each request is rescheduled (None in its place), the second
# answers 2 * X and how many passes it took.
RESCHEDULE_ONCE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    passes = {}

    def execute(self, requests):
        out = []
        for request in requests:
            key = request.correlation_id()
            self.passes[key] = self.passes.get(key, 0) + 1
            if self.passes[key] == 1:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                out.append(None)
                continue
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            passes = np.array([self.passes.pop(key)], np.int32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("PASSES", passes)]))
        return out
'''

# A python-based backend (Triton's: backend "scaler", its model.py in the backend directory):
# each model's folder holds only config.pbtxt and <version>/model.json, read from get_model_dir();
# its inputs and outputs come from auto_complete_config.
SCALER_BACKEND = '''
import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [1]})
        return config

    def initialize(self, args):
        with open(os.path.join(pb_utils.get_model_dir(), "model.json")) as f:
            self.factor = json.load(f)["factor"]

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * self.factor)]) for r in requests]
'''

# Answers where its python runs (sys.prefix): under EXECUTION_ENV_PATH, the environment's.
WHERE_AM_I = model_source('''
responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("WHERE", np.array([sys.prefix.encode()], np.object_))]))
''', imports="import sys\n\nimport numpy as np\n")

# Runs until its client goes away (request.is_cancelled()), at most 20 s, and logs which.
WAIT_FOR_CANCEL = with_helpers('''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        cancelled = until_cancelled(requests, 20)
        pb_utils.Logger.log_info("wait_for_cancel: " + ("cancelled" if cancelled else "not cancelled"))
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.zeros(1, dtype=np.float32))]) for _ in requests]
''', UNTIL_CANCELLED)

# Custom metrics (Triton's MetricFamily): a counter of requests and a gauge of the last input.
COUNTED = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"]}
        # (the families are kept: a metric lives while its MetricFamily object does, as in Triton)
        self.families = [pb_utils.MetricFamily("counted_requests", "requests counted by the model",
                                               pb_utils.MetricFamily.COUNTER),
                         pb_utils.MetricFamily("counted_last_input", "the last input seen",
                                               pb_utils.MetricFamily.GAUGE)]
        self.requests = self.families[0].Metric(labels=labels)
        self.last = self.families[1].Metric(labels=labels)

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            self.requests.increment(1)
            self.last.set(float(x.reshape(-1)[0]))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
'''

# How many requests its instance executed (model_warmup's included).
WARMED = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = 0

    def execute(self, requests):
        out = []
        for r in requests:
            self.seen += 1
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", np.array([[self.seen]], dtype=np.int32))]))
        return out
'''

FAULTY_HANG = '''
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        threading.Event().wait()  # never returns: a hung model
'''

# Triton's examples/decoupled (repeat_model.py, square_model.py), reduced; tests/e2e loads the same
# two in the real Triton. repeat_int32: one response per element of IN (OUT = IN[i], IDX = i), each
# after DELAY[i] ms, sent from a thread of its own (a cancelled request stops early); WAIT ms
# (optional) after the last one, the final flag alone (an empty final response).
REPEAT_CONFIG = """
name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] optional: true }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

REPEAT_INT32 = with_helpers('''
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
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT")
            if values.shape != delays.shape:
                sender = request.get_response_sender()
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"expected IN and DELAY of the same shape, got {values.shape} and {delays.shape}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            wait_ms = 0 if wait is None else int(wait.as_numpy()[0])
            worker = threading.Thread(target=self.respond, daemon=True, args=(request, values, delays, wait_ms))
            with self.lock:
                self.threads.append(worker)
            worker.start()
        return None

    def respond(self, request, values, delays, wait_ms):
        sender = request.get_response_sender()
        for index, (value, delay) in enumerate(zip(values, delays)):
            work_for(int(delay))  # each answer's requested delay (Triton's repeat model)
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"repeat_int32: request cancelled after {index} responses")
                break
            out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
        else:
            work_for(wait_ms)  # the requested wait before the final flag
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        with self.lock:
            threads = list(self.threads)
        for worker in threads:
            worker.join(timeout=10)
''', WORK_FOR)

# square_int32: IN = [n]: n responses, each OUT = [n], sent from execute(), then the final flag
# alone (n = 0: no response at all).
SQUARE_CONFIG = """
name: "square_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

SQUARE_INT32 = model_source('''
    n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
    for _ in range(n):
        sender.send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))]))
''', decoupled=True)

AUTO_COMPLETE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 3)]) for r in requests]
'''

AUTO_COMPLETE_BAD = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32"})
        return auto_complete_model_config

    def execute(self, requests):
        return []
'''

# ensemble steps: RAW -> preprocess (x2, and x+1) -> onnx add_sub -> postprocess (sum, as INT32 ... FP32)
PREPROCESS = model_source('''
    raw = pb_utils.get_input_tensor_by_name(request, "RAW").as_numpy()
    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("A", raw * 2), pb_utils.Tensor("B", raw + 1)]))
''', imports='')

POSTPROCESS = model_source('''
    s = pb_utils.get_input_tensor_by_name(request, "S").as_numpy()
    d = pb_utils.get_input_tensor_by_name(request, "D").as_numpy()
    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOTAL", (s + d).sum(axis=-1, keepdims=True))]))
''')


def _tensors(entries: list[tuple[str, str, str]]) -> str:
    return ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in entries)


def config(name: str, inputs: list[tuple[str, str, str]], outputs: list[tuple[str, str, str]],
           max_batch_size: int = 0, extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
            f"input [\n{_tensors(inputs)}\n]\noutput [\n{_tensors(outputs)}\n]\n{extra}")


def write(repo: Path, name: str, code: str, config_text: str | None) -> Path:
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(textwrap.dedent(code).lstrip())
    if config_text is not None:
        (folder / "config.pbtxt").write_text(config_text)
    return folder


PAIR_IN = [("INPUT0", "TYPE_FP32", str(WIDTH)), ("INPUT1", "TYPE_FP32", str(WIDTH))]
PAIR_OUT = [("OUTPUT0", "TYPE_FP32", str(WIDTH)), ("OUTPUT1", "TYPE_FP32", str(WIDTH))]


def build(repo: Path, instances: int = 2) -> Path:
    """The python models (names distinct from the ONNX repository's, so one gateway serves both)."""
    repo.mkdir(parents=True, exist_ok=True)
    write(repo, "py_add_sub", ADD_SUB, config(
        "py_add_sub", PAIR_IN, PAIR_OUT, 8,
        f"dynamic_batching {{ max_queue_delay_microseconds: 2000 }}\n"
        f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"))
    write(repo, "batch_probe", BATCH_PROBE, config(
        "batch_probe", [("INPUT0", "TYPE_FP32", "4")], [("COUNT", "TYPE_INT32", "4"), ("PARAMS", "TYPE_STRING", "1")],
        8, "dynamic_batching { max_queue_delay_microseconds: 300000 }\n"))
    bls_in = [*PAIR_IN, ("MODEL_NAME", "TYPE_STRING", "1")]
    write(repo, "bls_sync", BLS_SYNC, config("bls_sync", bls_in, PAIR_OUT))
    write(repo, "bls_async", BLS_ASYNC, config("bls_async", bls_in, PAIR_OUT))
    write(repo, "bls_decoupled", BLS_DECOUPLED, config(
        "bls_decoupled", [("IN", "TYPE_INT32", "1")], [("SUM", "TYPE_INT32", "1"), ("COUNT", "TYPE_INT32", "1")]))
    one = [("INPUT0", "TYPE_FP32", str(WIDTH))]
    write(repo, "faulty_raise", FAULTY_RAISE, config("faulty_raise", one, one))
    write(repo, "faulty_error", FAULTY_ERROR_RESPONSE, config("faulty_error", one, one))
    write(repo, "faulty_kill", FAULTY_KILL, config("faulty_kill", one, one))
    write(repo, "faulty_hang", FAULTY_HANG, config(
        "faulty_hang", one, one, 0, 'parameters { key: "execute_timeout_seconds" value: { string_value: "1" } }\n'))
    write(repo, "counted", COUNTED, config("counted", [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")], 0,
                                          "instance_group [ { count: 2 kind: KIND_CPU } ]\n"))
    write(repo, "warmed", WARMED, config(
        "warmed", [("X", "TYPE_FP32", "1")], [("SEEN", "TYPE_INT32", "1")], 4,
        'model_warmup [ { name: "zeros" batch_size: 2 count: 3 inputs { key: "X" value: '
        "{ data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } } ]\n"))
    write(repo, "wait_for_cancel", WAIT_FOR_CANCEL, config(
        "wait_for_cancel", [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")]))
    write(repo, "repeat_int32", REPEAT_INT32, REPEAT_CONFIG.lstrip())
    write(repo, "square_int32", SQUARE_INT32, SQUARE_CONFIG.lstrip())
    write(repo, "auto_complete", AUTO_COMPLETE, None)
    write(repo, "accumulate", ACCUMULATE, config(
        "accumulate", [("IN", "TYPE_INT32", "1")], [("SUM", "TYPE_INT32", "1"), ("WHERE", "TYPE_STRING", "1")], 2,
        "sequence_batching { max_sequence_idle_microseconds: 10000000 }\n"
        "instance_group [ { count: 2 kind: KIND_CPU } ]\n"))
    write(repo, "preprocess", PREPROCESS, config(
        "preprocess", [("RAW", "TYPE_FP32", str(WIDTH))], [("A", "TYPE_FP32", str(WIDTH)), ("B", "TYPE_FP32", str(WIDTH))], 8))
    write(repo, "postprocess", POSTPROCESS, config(
        "postprocess", [("S", "TYPE_FP32", str(WIDTH)), ("D", "TYPE_FP32", str(WIDTH))], [("TOTAL", "TYPE_FP32", "1")], 8))
    return repo


# preprocess (python) -> add_sub (onnx) -> postprocess (python)
def mixed_pipeline(name: str, torchscript: bool = False) -> str:
    """The ensemble preprocess (python) -> add_sub (onnx) [-> ts_add_sub (torchscript: s + d,
    s - d)] -> postprocess (python): RAW [WIDTH] -> TOTAL [1]."""
    last = "s", "d"
    ts_step = ""
    if torchscript:
        ts_step = """
  { model_name: "ts_add_sub" model_version: -1
    input_map { key: "INPUT__0" value: "s" } input_map { key: "INPUT__1" value: "d" }
    output_map { key: "OUTPUT__0" value: "s2" } output_map { key: "OUTPUT__1" value: "d2" } },"""
        last = "s2", "d2"
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "RAW" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "TOTAL" data_type: TYPE_FP32 dims: [ 1 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "preprocess" model_version: -1
    input_map {{ key: "RAW" value: "RAW" }}
    output_map {{ key: "A" value: "a" }} output_map {{ key: "B" value: "b" }} }},
  {{ model_name: "add_sub" model_version: -1
    input_map {{ key: "INPUT0" value: "a" }} input_map {{ key: "INPUT1" value: "b" }}
    output_map {{ key: "OUTPUT0" value: "s" }} output_map {{ key: "OUTPUT1" value: "d" }} }},{ts_step}
  {{ model_name: "postprocess" model_version: -1
    input_map {{ key: "S" value: "{last[0]}" }} input_map {{ key: "D" value: "{last[1]}" }}
    output_map {{ key: "TOTAL" value: "TOTAL" }} }}
] }}
"""


MIXED_ENSEMBLE = mixed_pipeline("mixed_pipeline")
MIXED_ALL_KINDS = mixed_pipeline("mixed_all_kinds", torchscript=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
