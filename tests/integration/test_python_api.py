"""The names of triton_python_backend_utils whose behaviour needs a running worker, exercised by
our own models in `meshserve service python` behind a gateway, with the real tritonclient:
BLS (exec, async_exec, decoupled iteration as NVIDIA's bls_decoupled example does), a decoupled
model that checks ``using_decoupled_model_transaction_policy`` in initialize() (NVIDIA's decoupled
repeat/square examples do), the response sender of a non-decoupled model, a received request's
accessors, model control from a model, get_model_dir, Logger, and HISTOGRAM metrics on the
service's /metrics and the gateway's federated one.

The list of names covered here is tests/unit/services/test_python_api_names.py:WORKER_NAMES.
"""
from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Served, served
from tests.deploy.support import free_port
from tests.models import python_models
from tests.support.metrics import scrape
from tests.support.waiting import eventually
from tests.unit.services.test_python_api_names import WORKER_NAMES

IN_X = [("X", "TYPE_FP32", "1")]
OUT_JSON = [("OUT", "TYPE_STRING", "1")]

ECHO = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X")
                                                            .as_numpy() * 2)]) for r in requests]
'''

# decoupled: N = X responses, each Y = i, from a thread; refuses to load unless decoupled (as NVIDIA's repeat)
REPEAT = '''
import json, threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise pb_utils.TritonModelException("api_repeat must be decoupled")

    def execute(self, requests):
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])
            sender = r.get_response_sender()
            threading.Thread(target=self.send, args=(sender, n)).start()
        return None

    def send(self, sender, n):
        for i in range(n):
            assert not sender.is_cancelled()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([i], dtype=np.float32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

PROBE = '''
import json
import sys
import numpy as np
import triton_python_backend_utils as pb_utils

def attempt(fn):
    try:
        return fn()
    except pb_utils.TritonModelException as exc:
        return "error: " + str(exc)

class TritonPythonModel:
    def initialize(self, args):
        self.dir = pb_utils.get_model_dir()
        # the family is kept: on Triton a Metric whose MetricFamily object was collected fails
        self.family = pb_utils.MetricFamily("api_input_value", "inputs seen by api_probe",
                                            pb_utils.MetricFamily.HISTOGRAM)
        self.hist = self.family.Metric(labels={"model": args["model_name"]}, buckets=[1.0, 10.0])
        pb_utils.Logger.log_info("api_probe: initialized")
        self.init_bls = attempt(lambda: pb_utils.InferenceRequest(model_name="api_echo", requested_output_names=["Y"],
                                                                  inputs=[]).exec())

    def execute(self, requests):
        out = []
        for r in requests:
            x = float(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])
            self.hist.observe(x)
            facts = {"request_id": r.request_id(), "correlation_id": r.correlation_id(), "flags": r.flags(),
                     "timeout": r.timeout(), "parameters": json.loads(r.parameters()),
                     "requested": sorted(r.requested_output_names()), "trace": r.trace().get_context(),
                     "cancelled": r.is_cancelled(), "model_dir": self.dir, "init_bls": self.init_bls,
                     "argv": sys.argv}
            pb_utils.Logger.log_warn(f"api_probe: warn {x}")
            pb_utils.Logger.log_error(f"api_probe: error {x}")
            pb_utils.Logger.log(f"api_probe: log {x}", pb_utils.Logger.LogLevel.INFO)
            pb_utils.Logger.log_verbose(f"api_probe: verbose {x}")
            echo = pb_utils.InferenceRequest(model_name="api_echo", requested_output_names=["Y"],
                                             inputs=[pb_utils.Tensor("X", np.array([x], dtype=np.float32))]).exec()
            facts["echo"] = echo.output_tensors()[0].as_numpy().tolist() if not echo.has_error() else echo.error().message()
            missing = pb_utils.InferenceRequest(model_name="api_nope", requested_output_names=["Y"], inputs=[]).exec()
            facts["missing"] = [missing.has_error(), int(missing.error().code()), missing.error().message()]
            stream = pb_utils.InferenceRequest(model_name="api_repeat", requested_output_names=["Y"],
                                               inputs=[pb_utils.Tensor("X", np.array([3], dtype=np.float32))]
                                               ).exec(decoupled=True)
            it = iter(stream)
            first = next(it)
            rest = [resp.output_tensors()[0].as_numpy().tolist() for resp in it if resp.output_tensors()]
            facts["stream"] = [type(stream).__name__, first.output_tensors()[0].as_numpy().tolist(), rest]
            if json.loads(r.parameters()).get("control"):
                facts["control"] = [
                    pb_utils.is_model_ready("api_victim"), attempt(lambda: pb_utils.unload_model("api_victim")),
                    pb_utils.is_model_ready("api_victim"), attempt(lambda: pb_utils.load_model("api_victim")),
                    pb_utils.is_model_ready("api_victim", "1"), attempt(lambda: pb_utils.is_model_ready("api_victim", "abc")),
                    attempt(lambda: pb_utils.load_model("api_victim", files=[1])),
                    attempt(lambda: pb_utils.load_model("api_never_there"))]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(facts)], dtype=np.object_))]))
        return out
'''

ASYNC = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            one = pb_utils.InferenceRequest(model_name="api_echo", requested_output_names=["Y"],
                                            inputs=[pb_utils.Tensor("X", x)])
            many = pb_utils.InferenceRequest(model_name="api_repeat", requested_output_names=["Y"],
                                             inputs=[pb_utils.Tensor("X", np.array([4], dtype=np.float32))])
            echo, stream = await asyncio.gather(one.async_exec(), many.async_exec(decoupled=True))
            total = sum(float(s.output_tensors()[0].as_numpy()[0]) for s in stream if s.output_tensors())
            y = echo.output_tensors()[0].as_numpy() + total
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return out
'''

# non-decoupled, answering through the response sender (Triton 24.10 allows exactly one response)
SENDER = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            sender = r.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            try:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
            except pb_utils.TritonModelException as exc:
                pb_utils.Logger.log_info("api_sender: " + str(exc))
        return None
'''

# torch inside a model, as NVIDIA's pytorch example: inputs to torch, outputs back by DLPack and by numpy
TORCH = python_models.model_source('''
    a = torch.from_numpy(pb_utils.get_input_tensor_by_name(request, "X").as_numpy())
    b = torch.utils.dlpack.from_dlpack(pb_utils.get_input_tensor_by_name(request, "X").to_dlpack())
    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("Y", a + b),
                                                 pb_utils.Tensor("Z", (a - 2 * b).numpy())]))
''', imports='import numpy as np\nimport torch\n')

# decoupled: one response with what the request says of itself (from execute(), then the final flag)
STREAM_ID = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            facts = {"request_id": r.request_id(), "timeout": r.timeout()}
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([json.dumps(facts)],
                                                                                    dtype=np.object_))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

# BF16 (no NumPy view, as in Triton's stub): as_numpy() raises Triton's text; DLPack carries it
# both ways, and through BLS (parameter bls: a call to api_bf16_echo, this code too); parameter raise: as_numpy()
# uncaught, the request's error
BF16 = '''
import json
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X")
            params = json.loads(r.parameters())
            if params.get("raise"):
                x.as_numpy()
            try:
                numpy = x.as_numpy().tolist()
            except pb_utils.TritonModelException as exc:
                numpy = "error: " + str(exc)
            t = torch.utils.dlpack.from_dlpack(x.to_dlpack())
            same = pb_utils.Tensor.from_dlpack("Y", x)  # (a Tensor has __dlpack__, as on Triton)
            facts = {"dtype": x.triton_dtype(), "shape": x.shape(), "numpy": numpy, "torch": str(t.dtype),
                     "same": torch.utils.dlpack.from_dlpack(same.to_dlpack()).tolist() == t.tolist()}
            y = pb_utils.Tensor.from_dlpack("Y", t * 2)
            if params.get("bls"):
                resp = pb_utils.InferenceRequest(model_name="api_bf16_echo", requested_output_names=["Y"],
                                                 inputs=[pb_utils.Tensor.from_dlpack("X", t * 2)]).exec()
                if resp.has_error():
                    raise pb_utils.TritonModelException(resp.error().message())
                y = pb_utils.get_output_tensor_by_name(resp, "Y")
                facts["bls_dtype"] = y.triton_dtype()
            out.append(pb_utils.InferenceResponse([y, pb_utils.Tensor("OUT", np.array([json.dumps(facts)],
                                                                                      dtype=np.object_))]))
        return out
'''

COVERED = frozenset({
    "get_model_dir", "load_model", "unload_model", "is_model_ready", "InferenceRequest.exec",
    "InferenceRequest.async_exec", "InferenceRequest.is_cancelled", "InferenceRequest.request_id",
    "InferenceRequest.correlation_id", "InferenceRequest.flags", "InferenceRequest.timeout",
    "InferenceRequest.parameters", "InferenceRequest.requested_output_names", "InferenceRequest.get_response_sender",
    "InferenceRequest.trace", "InferenceResponseSender", "InferenceResponseSender.send",
    "InferenceResponseSender.is_cancelled", "ResponseIterator", "ResponseIterator.__iter__",
    "ResponseIterator.__next__", "Logger.log", "Logger.log_info", "Logger.log_warn", "Logger.log_error",
    "Metric.observe", "MetricFamily.HISTOGRAM",
})


def test_this_file_covers_the_worker_names() -> None:
    assert COVERED == WORKER_NAMES


Mesh = Served  # the python service (``service``) on the repository below, and a gateway in front


# answers a fixed-width bytes array (np.bytes_, 'S6'), as NVIDIA's qa/python_models/string_fixed
FIXED_BYTES = python_models.model_source(
    'responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([b"123456", b"7"], '
    'dtype=np.bytes_))]))')


# what execute() must not return: a decoupled model's list (NVIDIA's decoupled_return_response_error),
# anything but a list from another model
RETURNS_LIST = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""
RETURNS_DICT = RETURNS_LIST.replace("return [pb_utils.InferenceResponse([]) for _ in requests]", "return {}")


# a decoupled async execute that answers after it returned, from a task it left on the loop (NVIDIA's
# response_sender_async model); X = 0: the execute coroutine itself raises, after an await
ASYNC_LATER = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.tasks = set()

    async def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if x[0] == 0:
                await asyncio.sleep(0.1)
                raise ValueError("no answer for zero")
            task = asyncio.create_task(self.later(r.get_response_sender(), x))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return None

    async def later(self, sender, x):
        await asyncio.sleep(0.2)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 3)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# answers through its sender, then raises (a second send, in NVIDIA's response_sender model) or returns
# another response for the same request (X = 2): the sent answer stands, as in Triton
SENT_THEN_RAISED = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 10)]))
        if x[0] == 2:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 0)]) for _ in requests]
        r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))  # raises
        return None
"""


# response parameters (NVIDIA's qa/python_models/response_parameters): X = 1 sets three, X = 2 a float
# (the stub refuses it: the model answers the refusal's text as its error)
RESP_PARAMS = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            params = {"tag": "t", "n": 3, "ok": True} if x[0] == 1 else {"f": 0.5}
            try:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)], parameters=params))
            except pb_utils.TritonModelException as exc:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return out
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    repo = tmp_path_factory.mktemp("python_api")
    y = [("Y", "TYPE_FP32", "1")]
    python_models.write(repo, "api_echo", ECHO, python_models.config("api_echo", IN_X, y))
    python_models.write(repo, "api_victim", ECHO, python_models.config("api_victim", IN_X, y))
    python_models.write(repo, "api_repeat", REPEAT, python_models.config(
        "api_repeat", IN_X, y, extra="model_transaction_policy { decoupled: true }\n"))
    python_models.write(repo, "api_probe", PROBE, python_models.config("api_probe", IN_X, OUT_JSON + [
        ("UNUSED", "TYPE_FP32", "1")]))
    python_models.write(repo, "api_async", ASYNC, python_models.config("api_async", IN_X, y))
    python_models.write(repo, "api_sender", SENDER, python_models.config("api_sender", IN_X, y))
    python_models.write(repo, "api_stream_id", STREAM_ID, python_models.config(
        "api_stream_id", IN_X, OUT_JSON, extra="model_transaction_policy { decoupled: true }\n"))
    for name in ("api_bf16", "api_bf16_echo"):
        python_models.write(repo, name, BF16, python_models.config(
            name, [("X", "TYPE_BF16", "2")], [("Y", "TYPE_BF16", "2")] + OUT_JSON))
    python_models.write(repo, "api_fixed_bytes", FIXED_BYTES, python_models.config(
        "api_fixed_bytes", IN_X, [("OUT", "TYPE_STRING", "-1")]))
    python_models.write(repo, "api_returns_list", RETURNS_LIST, python_models.config(
        "api_returns_list", IN_X, y, extra="model_transaction_policy { decoupled: true }\n"))
    python_models.write(repo, "api_returns_dict", RETURNS_DICT, python_models.config("api_returns_dict", IN_X, y))
    python_models.write(repo, "api_async_later", ASYNC_LATER, python_models.config(
        "api_async_later", IN_X, y, extra="model_transaction_policy { decoupled: true }\n"))
    python_models.write(repo, "api_sent_then_raised", SENT_THEN_RAISED, python_models.config(
        "api_sent_then_raised", IN_X, y))
    python_models.write(repo, "api_resp_params", RESP_PARAMS, python_models.config("api_resp_params", IN_X, y))
    python_models.write(repo, "api_torch", TORCH, python_models.config("api_torch", IN_X, y + [("Z", "TYPE_FP32", "1")]))
    gateway_grpc = free_port()  # known before the gateway starts: the service's BLS calls go to it
    with served("python", repo, ["--model-control-mode", "explicit", "--load-model", "*",
                                 "--bls-target", f"127.0.0.1:{gateway_grpc}"],
                ["--grpc-port", str(gateway_grpc), "--federate-metrics"]) as mesh:
        yield mesh


def _probe(mesh: Mesh, direct: bool = False, request_id: str = "req-7", **params: object) -> dict:
    inp = grpcclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([2.0], dtype=np.float32))
    with grpcclient.InferenceServerClient(mesh.service.grpc if direct else mesh.gateway.grpc) as c:
        result = c.infer("api_probe", [inp], request_id=request_id, outputs=[grpcclient.InferRequestedOutput("OUT")],
                         parameters=params or None)
    return dict(json.loads(result.as_numpy("OUT")[0]))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gateway"])
def test_a_received_request_and_bls_from_it(mesh: Mesh, direct: bool) -> None:
    facts = _probe(mesh, direct, tag="t1", n=3)
    assert facts["correlation_id"] == 0 and facts["flags"] == 0
    assert facts["timeout"] == 0 and facts["trace"] is None and facts["cancelled"] is False
    assert facts["parameters"] == {"tag": "t1", "n": 3}
    assert facts["requested"] == ["OUT"]  # the client named OUT only
    assert facts["model_dir"] == str(mesh.repo / "api_probe" / "1")
    assert facts["argv"] == [""]  # an embedded interpreter's, as in Triton's stub (unittest.main() reads it)
    assert facts["init_bls"] == "error: BLS is only supported during the 'execute' function."
    assert facts["echo"] == [4.0]  # exec(): api_echo through the gateway
    # an unknown model: the response's error, with Triton's prefix; NOT_FOUND here (Triton 2.51: INTERNAL)
    assert facts["missing"][:2] == [True, 2]
    assert facts["missing"][2].startswith("Model api_nope - Error when running inference: ")
    # exec(decoupled=True): a ResponseIterator, iter()/next() over 3 responses and the empty final
    assert facts["stream"] == ["ResponseIterator", [0.0], [[1.0], [2.0]]]
    assert facts["request_id"] == "req-7"


def test_request_id_through_the_gateway_is_the_clients(mesh: Mesh) -> None:
    """Behind the gateway the hop's id is its stream key; the client's id rides along
    (meshserve_request_id) and is the model's request_id(), as direct."""
    assert _probe(mesh)["request_id"] == "req-7"
    assert _probe(mesh, request_id="")["request_id"] == ""  # no id: none (never the hop's key)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gateway"])
def test_a_streamed_requests_id_and_timeout_are_the_clients(mesh: Mesh, direct: bool) -> None:
    """A decoupled model's request on a gRPC stream: request_id() and timeout() are the client's,
    direct and through the gateway (whose hop streams carry it as a streamed request)."""
    got: list[dict] = []
    errors: list[object] = []

    def on(result: Any, error: object) -> None:
        if error is not None:
            errors.append(error)
        elif result.get_response().outputs:
            got.append(json.loads(result.as_numpy("OUT")[0]))

    with grpcclient.InferenceServerClient(mesh.service.grpc if direct else mesh.gateway.grpc) as c:
        c.start_stream(callback=on)
        for request_id, timeout in (("s-1", 9_000_000), ("", None)):
            inp = grpcclient.InferInput("X", [1], "FP32")
            inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
            c.async_stream_infer("api_stream_id", [inp], request_id=request_id, timeout=timeout)
        eventually(lambda: len(got) + len(errors) >= 2, timeout=20, what="two responses")
        c.stop_stream()
    assert not errors, errors
    assert sorted(got, key=lambda f: f["request_id"]) == [{"request_id": "", "timeout": 0},
                                                         {"request_id": "s-1", "timeout": 9_000_000}]


@pytest.mark.parametrize("proto", ["http", "grpc"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gateway"])
def test_timeout_is_the_clients_timeout_parameter(mesh: Mesh, direct: bool, proto: str) -> None:
    """InferenceRequest.timeout() is the client's ``timeout`` (µs), as Triton 2.51 gives it (not in
    parameters()); 0 without one."""
    mod: Any = grpcclient if proto == "grpc" else httpclient
    proc = mesh.service if direct else mesh.gateway
    for timeout, want in ((None, 0), (7_000_000, 7_000_000)):
        inp = mod.InferInput("X", [1], "FP32")
        inp.set_data_from_numpy(np.array([2.0], dtype=np.float32))
        with mod.InferenceServerClient(proc.grpc if proto == "grpc" else proc.http) as c:
            result = c.infer("api_probe", [inp], outputs=[mod.InferRequestedOutput("OUT")], timeout=timeout)
        facts = json.loads(result.as_numpy("OUT")[0])
        assert facts["timeout"] == want and facts["parameters"] == {}, facts


def test_async_exec_one_and_decoupled(mesh: Mesh) -> None:
    inp = httpclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([5.0], dtype=np.float32))
    with httpclient.InferenceServerClient(mesh.gateway.http) as c:
        y = c.infer("api_async", [inp]).as_numpy("Y")
    assert y.tolist() == [10.0 + (0 + 1 + 2 + 3)]


def test_decoupled_model_checks_its_policy_and_streams(mesh: Mesh) -> None:
    got: list[float] = []
    done: list[bool] = []

    def on(result: object, error: object) -> None:
        assert error is None, error
        got.extend(result.as_numpy("Y").tolist())  # type: ignore[attr-defined]
        if len(got) == 5:
            done.append(True)

    inp = grpcclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([5.0], dtype=np.float32))
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        c.start_stream(callback=on)
        c.async_stream_infer("api_repeat", [inp])
        eventually(lambda: bool(done), timeout=20, what="five responses")
        c.stop_stream()
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_non_decoupled_model_answers_through_its_response_sender(mesh: Mesh) -> None:
    inp = httpclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([1.5], dtype=np.float32))
    with httpclient.InferenceServerClient(mesh.gateway.http) as c:
        assert c.infer("api_sender", [inp]).as_numpy("Y").tolist() == [2.5]
    eventually(lambda: "api_sender: Unable to send response. Non-decoupled model cannot send more than one "
                       "response." in "".join(mesh.service.output), timeout=10, what="the second send refused")


def test_torch_inside_a_model_with_dlpack_both_ways(mesh: Mesh) -> None:
    pytest.importorskip("torch")
    inp = httpclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([3.0], dtype=np.float32))
    with httpclient.InferenceServerClient(mesh.gateway.http) as c:
        result = c.infer("api_torch", [inp])
    assert result.as_numpy("Y").tolist() == [6.0] and result.as_numpy("Z").tolist() == [-3.0]


@pytest.mark.parametrize("proto", ["http", "grpc"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "gateway"])
def test_bf16_through_dlpack_as_triton(mesh: Mesh, direct: bool, proto: str) -> None:
    """A BF16 input: no NumPy view (as_numpy() raises Triton's text), triton_dtype() 14, DLPack to
    torch.bfloat16 and back (Tensor.from_dlpack), a BLS call with a BF16 input and output; the
    answer is BF16 with the values doubled (twice with BLS). A model whose as_numpy() fails
    uncaught: its error with Triton's text and none of meshserve's files."""
    pytest.importorskip("torch")
    import ml_dtypes

    mod: Any = grpcclient if proto == "grpc" else httpclient
    x = np.array([1.5, -3.0], dtype=ml_dtypes.bfloat16)
    proc = mesh.service if direct else mesh.gateway
    with mod.InferenceServerClient(proc.grpc if proto == "grpc" else proc.http) as c:
        for bls, factor in ((False, 2), (True, 4)):
            inp = mod.InferInput("X", [2], "BF16")
            inp.set_data_from_numpy(x)
            result = c.infer("api_bf16", [inp], parameters={"bls": True} if bls else None)
            y = result.as_numpy("Y")
            assert y.dtype == ml_dtypes.bfloat16 and y.astype(np.float32).tolist() == [1.5 * factor, -3.0 * factor]
            facts = json.loads(result.as_numpy("OUT")[0])
            assert facts["dtype"] == 14 and facts["shape"] == [2] and facts["torch"] == "torch.bfloat16" and facts["same"]
            assert facts["numpy"] == ("error: Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() "
                                      "and from_dlpack() instead.")
            assert facts.get("bls_dtype") == (14 if bls else None)
        inp = mod.InferInput("X", [2], "BF16")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as err:
            c.infer("api_bf16", [inp], parameters={"raise": True})
    text = str(err.value)
    assert "Tensor dtype is BF16 and cannot be converted to NumPy." in text, text
    assert "pb_utils" not in text and "services/python" not in text and "model.py" in text, text


def test_model_control_from_a_model(mesh: Mesh) -> None:
    control = _probe(mesh, control=True)["control"]
    assert control[:5] == [True, None, False, None, True]  # ready, unloaded, not ready, loaded, ready
    assert control[5] == ("error: Failed to check model readiness: Failed to process the request for model "
                          "'api_probe_0', message: failed to get model version from specified version string 'abc' "
                          "(details: stol), version should be an integral value > 0")
    assert control[6] == ("error: failed to load model 'api_victim', files should be a dictionary of file paths "
                          "and file contents")
    assert control[7].startswith("error: Failed to load model: Failed to process the request for model "
                                 "'api_probe_0', message: ") and "api_never_there" in control[7]


@pytest.mark.parametrize("client", [grpcclient, httpclient], ids=["grpc", "http"])
def test_a_fixed_width_bytes_array_answers_as_bytes(mesh: Mesh, client: Any) -> None:
    inp = client.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    with client.InferenceServerClient(mesh.gateway.grpc if client is grpcclient else mesh.gateway.http) as c:
        out = c.infer("api_fixed_bytes", [inp]).as_numpy("OUT")
    assert out.tolist() == [b"123456", b"7"]


def test_what_execute_must_not_return_is_refused_in_the_stubs_words(mesh: Mesh) -> None:
    inp = grpcclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    got: list[Any] = []
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        c.start_stream(callback=lambda result, error: got.append(error))
        c.async_stream_infer("api_returns_list", [inp])
        eventually(lambda: got, timeout=20, what="the decoupled model's answer")
        c.stop_stream()
        assert isinstance(got[0], InferenceServerException)
        assert ("Python model 'api_returns_list_0' is using the decoupled mode and the execute function must "
                "return None.") in got[0].message()
        with pytest.raises(InferenceServerException) as err:
            c.infer("api_returns_dict", [inp])
    assert "Expected a list in the execute return, found type '<class 'dict'>'." in err.value.message()


def test_an_async_decoupled_execute_answers_from_what_it_left_on_the_loop(mesh: Mesh) -> None:
    """Triton's stub keeps its event loop running between batches and does not wait for a decoupled
    model's async execute: a task it leaves answers later; an execute that raises ends its requests
    with that error (the worker ran the loop only while execute() ran: the task froze, the call hung)."""
    got: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        c.start_stream(callback=lambda result, error: got.put(error or result))
        for x in (4.0, 0.0):
            inp = grpcclient.InferInput("X", [1], "FP32")
            inp.set_data_from_numpy(np.array([x], dtype=np.float32))
            c.async_stream_infer("api_async_later", [inp], request_id=str(x))
        answers = [got.get(timeout=20) for _ in range(2)]
        c.stop_stream()
    ok = [a for a in answers if not isinstance(a, InferenceServerException)]
    failed = [a for a in answers if isinstance(a, InferenceServerException)]
    assert [a.as_numpy("Y").tolist() for a in ok] == [[12.0]]
    assert len(failed) == 1 and "no answer for zero" in failed[0].message()


@pytest.mark.parametrize("x", [1.0, 2.0], ids=["then-raised", "then-returned"])
def test_a_response_sent_before_execute_failed_or_returned_stands(mesh: Mesh, x: float) -> None:
    inp = grpcclient.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([x], dtype=np.float32))
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as c:
        assert c.infer("api_sent_then_raised", [inp]).as_numpy("Y").tolist() == [x * 10]


@pytest.mark.parametrize("client", [grpcclient, httpclient], ids=["grpc", "http"])
def test_response_parameters_reach_the_client(mesh: Mesh, client: Any) -> None:
    inp = client.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    with client.InferenceServerClient(mesh.gateway.grpc if client is grpcclient else mesh.gateway.http) as c:
        result = c.infer("api_resp_params", [inp])
        inp.set_data_from_numpy(np.array([2.0], dtype=np.float32))
        with pytest.raises(InferenceServerException) as err:
            c.infer("api_resp_params", [inp])
    if client is grpcclient:
        params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in result.get_response().parameters.items()}
    else:
        params = result.get_response()["parameters"]
    assert params == {"tag": "t", "n": 3, "ok": True}
    assert "Expect parameters values to have type bool/int/str, found type <class 'float'>" in err.value.message()


def test_logger_lines_reach_the_service_log(mesh: Mesh) -> None:
    _probe(mesh)
    for line in ("api_probe: initialized", "api_probe: warn 2.0", "api_probe: error 2.0", "api_probe: log 2.0"):
        eventually(lambda line=line: line in "".join(mesh.service.output), timeout=10, what=line)  # type: ignore[misc]
    text = "".join(mesh.service.output)
    assert " WARNING " in text.split("api_probe: warn 2.0")[0].rsplit("\n", 1)[-1]
    assert " ERROR " in text.split("api_probe: error 2.0")[0].rsplit("\n", 1)[-1]


def _histogram_counts(samples: dict) -> dict[str, float]:
    """api_probe's api_input_value histogram samples, by name and bucket."""
    return {n + "|" + dict(lab).get("le", ""): v for (n, lab), v in samples.items()
            if n.startswith("api_input_value") and ("model", "api_probe") in lab}


def test_log_settings_at_the_gateway_reach_the_models_lines(mesh: Mesh) -> None:
    """/v2/logging at the gateway goes to its services and their workers, as Triton's one process
    applies it to its models' lines (NVIDIA's qa/L0_backend_python/logging): log_verbose_level 1
    shows the model's verbose lines, log_info false hides its INFO lines (warnings still show)."""
    def count(line: str) -> int:
        return "".join(mesh.service.output).count(line)

    with httpclient.InferenceServerClient(mesh.service.http) as service:
        before = service.get_log_settings()
    with httpclient.InferenceServerClient(mesh.gateway.http) as c:
        try:
            c.update_log_settings({"log_verbose_level": 0, "log_info": True})
            start = count("api_probe: warn 2.0")
            _probe(mesh)
            eventually(lambda: count("api_probe: warn 2.0") == start + 1, timeout=10, what="the probe's warning")
            verbose = count("api_probe: verbose 2.0")
            c.update_log_settings({"log_verbose_level": 1})
            _probe(mesh)
            eventually(lambda: count("api_probe: verbose 2.0") == verbose + 1, timeout=10, what="its verbose line")
            info, warn = count("api_probe: log 2.0"), count("api_probe: warn 2.0")
            c.update_log_settings({"log_verbose_level": 0, "log_info": False})
            _probe(mesh)
            _probe(mesh)
            # (the first probe's INFO line, were it written, came before the second's warning: one stream)
            eventually(lambda: count("api_probe: warn 2.0") == warn + 2, timeout=10, what="the warnings")
            assert count("api_probe: log 2.0") == info
            assert count("api_probe: verbose 2.0") == verbose + 1
        finally:
            c.update_log_settings({k: before[k] for k in ("log_verbose_level", "log_info", "log_warning", "log_error")})


def test_histogram_on_the_services_and_the_gateways_metrics(mesh: Mesh) -> None:
    counts = _histogram_counts
    before = counts(scrape(mesh.service.http))
    _probe(mesh)
    after = counts(scrape(mesh.service.http))
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    assert grew == {"api_input_value_bucket|1": 0.0, "api_input_value_bucket|10": 1.0,
                    "api_input_value_bucket|+Inf": 1.0, "api_input_value_count|": 1.0, "api_input_value_sum|": 2.0}
    # one python replica has the family: the gateway shows it with the model's own labels, as
    # Triton does (NVIDIA's custom_metrics example looks for the exact sample text)
    gateway_samples = scrape(mesh.gateway.http)
    federated = counts(gateway_samples)
    assert federated["api_input_value_count|"] >= after["api_input_value_count|"]
    assert set(federated) == set(after)
    assert not [lab for (n, lab), _ in gateway_samples.items()
                if n.startswith("api_input_value") and "replica" in dict(lab)]


def test_the_gateways_metrics_show_what_a_model_did_a_moment_before(mesh: Mesh) -> None:
    """Each federated /metrics answer comes from a read of the services that began after its
    request arrived: an observation the model made just before is in it, scrape after scrape
    (NVIDIA's custom_metrics QA model reads /metrics right after its change; before, one read
    was reused for 0.5 s and the second scrape here missed it)."""
    for _ in range(3):
        before = _histogram_counts(scrape(mesh.gateway.http)).get("api_input_value_count|", 0.0)
        _probe(mesh)
        assert _histogram_counts(scrape(mesh.gateway.http))["api_input_value_count|"] == before + 1
