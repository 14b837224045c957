"""Triton's stream semantics, with the real python service, a real gateway and tritonclient's
gRPC stream API (issue 30, item 6):

- a client's ModelStreamInfer answers the requests for models that are not decoupled in request
  order, whatever order they complete in (Triton's rule), directly and through the gateway; a
  decoupled model's answers are not held behind them;
- a decoupled model behind an A/B route streams every response, each marked with the arm;
- an ensemble with a decoupled step answers once per response of that step (each response is a
  round of the steps after it, Triton's ensemble semantics), then the final flag; a unary call on
  it gets Triton's error; a step fed from two lineages is refused at load with Triton's text.

Models: `sleepy` (not decoupled, 2 instances) answers IN after IN milliseconds, so a later request
can finish first; `repeat_int32` (decoupled: one response per element of IN); `double` (Y = 2X);
`pair_add` (S = A + B)."""
from __future__ import annotations

import asyncio
import json
import queue
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.models import python_models
from tests.support.metrics import metric
from tests.support.waiting import eventually

SLEEPY = python_models.model_source('''
    x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
    work_for(int(x.reshape(-1)[0]))  # a model as slow as asked
    responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
''', imports='import time\n', head=python_models.WORK_FOR)

DOUBLE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''

PAIR_ADD = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "S", pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
            + pb_utils.get_input_tensor_by_name(r, "B").as_numpy())]) for r in requests]
'''

# repeat_int32's responses (OUT = IN[i], IDX = i), each doubled: one response per element of IN
REPEAT_THEN_DOUBLE = """
name: "repeat_then_double"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] } ]
output [ { name: "DOUBLED" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "INDEX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "repeat_int32" model_version: -1
    input_map { key: "IN" value: "IN" } input_map { key: "DELAY" value: "DELAY" }
    output_map { key: "OUT" value: "value" } output_map { key: "IDX" value: "INDEX" } },
  { model_name: "double" model_version: -1
    input_map { key: "X" value: "value" } output_map { key: "Y" value: "DOUBLED" } }
] }
"""

# pair_add reads an ensemble input and a decoupled step's output: Triton refuses it at load
MIXED_LINEAGE = """
name: "mixed_lineage"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
        { name: "K" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "repeat_int32" model_version: -1
    input_map { key: "IN" value: "IN" } input_map { key: "DELAY" value: "DELAY" }
    output_map { key: "OUT" value: "value" } },
  { model_name: "pair_add" model_version: -1
    input_map { key: "A" value: "K" } input_map { key: "B" value: "value" } output_map { key: "S" value: "SUM" } }
] }
"""

ROUTES = """
routes:
  - name: repeat-ab
    targets:
      - {model: repeat_int32, weight: 1, arm: streamed}
"""

ONE = [("IN", "TYPE_INT32", "1")]


@dataclass
class Mesh:
    service: Proc
    gateway: Proc


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    repo = tmp_path_factory.mktemp("stream_models")
    python_models.write(repo, "sleepy", SLEEPY, python_models.config(
        "sleepy", ONE, [("OUT", "TYPE_INT32", "1")], extra="instance_group [ { count: 2 kind: KIND_CPU } ]\n"))
    python_models.write(repo, "repeat_int32", python_models.REPEAT_INT32, python_models.REPEAT_CONFIG.lstrip())
    python_models.write(repo, "double", DOUBLE, python_models.config(
        "double", [("X", "TYPE_INT32", "1")], [("Y", "TYPE_INT32", "1")]))
    python_models.write(repo, "pair_add", PAIR_ADD, python_models.config(
        "pair_add", [("A", "TYPE_INT32", "1"), ("B", "TYPE_INT32", "1")], [("S", "TYPE_INT32", "1")]))
    ensembles = tmp_path_factory.mktemp("stream_ensembles")
    for name, text in (("repeat_then_double", REPEAT_THEN_DOUBLE), ("mixed_lineage", MIXED_LINEAGE)):
        (ensembles / name / "1").mkdir(parents=True)
        (ensembles / name / "config.pbtxt").write_text(text)
    routes = ensembles / "routes.yaml"
    routes.write_text(ROUTES)
    with service_and_gateway("python", ["--repository", str(repo)],
                             ["--repository", str(ensembles), "--routes", str(routes)]) as (service, gateway):
        yield Mesh(service, gateway)


def _input(name: str, values: list[int], datatype: str = "INT32") -> grpcclient.InferInput:
    arr = np.array(values, dtype=np.int32 if datatype == "INT32" else np.uint32)
    t = grpcclient.InferInput(name, [arr.size], datatype)
    t.set_data_from_numpy(arr)
    return t


def _repeat(values: list[int], delays: list[int] | None = None) -> list[grpcclient.InferInput]:
    return [_input("IN", values), _input("DELAY", delays or [0] * len(values), "UINT32")]


def _stream(url: str, calls: list[tuple[str, list[grpcclient.InferInput], str]], answers: int,
            **kwargs: Any) -> list[tuple[Any, Any]]:
    """Send ``calls`` (model, inputs, request id) on one ModelStreamInfer call; the first ``answers``
    (result, error) pairs in the order they came."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            for model, inputs, rid in calls:
                client.async_stream_infer(model, inputs, request_id=rid, **kwargs)
            return [got.get(timeout=30) for _ in range(answers)]
        finally:
            client.stop_stream()


def _ok(items: list[tuple[Any, Any]]) -> list[Any]:
    """The results (asserted: no errors)."""
    assert [error for _, error in items if error is not None] == []
    return [result for result, _ in items]


def _ids(items: list[tuple[Any, Any]]) -> list[str]:
    return [result.get_response().id for result in _ok(items)]


@pytest.mark.parametrize("where", ["service", "gateway"])
def test_answers_of_models_that_are_not_decoupled_come_in_request_order(mesh: Mesh, where: str) -> None:
    """sleepy's first request sleeps 400 ms, the next ones less: they finish first on the other
    instance, yet every answer leaves in request order (with its own value)."""
    url = getattr(mesh, where).grpc
    delays = [400, 0, 250, 0, 100]
    got = _stream(url, [("sleepy", [_input("IN", [d])], f"r{i}") for i, d in enumerate(delays)], len(delays))
    assert _ids(got) == [f"r{i}" for i in range(len(delays))]
    assert [int(r.as_numpy("OUT")[0]) for r, _ in got] == delays


@pytest.mark.parametrize("where", ["service", "gateway"])
def test_a_decoupled_models_answers_are_not_held_behind_them(mesh: Mesh, where: str) -> None:
    """A request for repeat_int32 sent after a slow sleepy request answers first (its responses are
    written as they come, as Triton's are); sleepy's requests keep their own order."""
    url = getattr(mesh, where).grpc
    got = _stream(url, [("sleepy", [_input("IN", [500])], "slow"), ("repeat_int32", _repeat([7, 8]), "rep"),
                        ("sleepy", [_input("IN", [0])], "fast")], 4)
    ids = _ids(got)
    assert ids[:2] == ["rep", "rep"], ids
    assert ids[2:] == ["slow", "fast"], ids


def test_a_decoupled_model_behind_an_ab_route_streams_every_response(mesh: Mesh) -> None:
    got = _ok(_stream(mesh.gateway.grpc, [("repeat-ab", _repeat([4, 2, 9]), "ab")], 4,
                      enable_empty_final_response=True))
    responses = [r.get_response() for r in got]
    assert [int(r.as_numpy("OUT")[0]) for r in got[:3]] == [4, 2, 9]
    for response in responses[:3]:
        assert response.id == "ab"
        assert response.parameters["meshserve_route_arm"].string_param == "streamed"
        assert not response.parameters["triton_final_response"].bool_param
    assert responses[3].parameters["triton_final_response"].bool_param and not responses[3].outputs
    labels = {"route": "repeat-ab", "arm": "streamed", "outcome": "OK"}
    eventually(lambda: metric(mesh.gateway.http, "meshserve_gateway_route_requests_total", **labels) >= 1,
               what="the arm's OK count")


def _ensemble_stats(mesh: Mesh) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{mesh.gateway.http}/v2/models/repeat_then_double/stats", timeout=10) as r:
        return dict(json.loads(r.read())["model_stats"][0]["inference_stats"])


def test_an_ensemble_answers_each_response_of_its_decoupled_step(mesh: Mesh) -> None:
    """repeat_then_double: each of repeat_int32's responses runs `double` once more and is one
    response of the ensemble (Triton's ensemble semantics), then the final flag alone."""
    before = _ensemble_stats(mesh).get("success", {}).get("count", 0)
    got = _ok(_stream(mesh.gateway.grpc, [("repeat_then_double", _repeat([4, 2, 5], [0, 30, 30]), "e1")], 4,
                      enable_empty_final_response=True))
    rounds = sorted((int(r.as_numpy("INDEX")[0]), int(r.as_numpy("DOUBLED")[0])) for r in got[:3])
    assert rounds == [(0, 8), (1, 4), (2, 10)]
    for result in got[:3]:
        response = result.get_response()
        assert (response.id, response.model_name) == ("e1", "repeat_then_double")
        assert not response.parameters["triton_final_response"].bool_param
    final = got[3].get_response()
    assert final.parameters["triton_final_response"].bool_param and not final.outputs
    eventually(lambda: _ensemble_stats(mesh)["success"]["count"] == before + 1, what="the ensemble's success")


def test_an_ensemble_with_a_decoupled_step_is_decoupled(mesh: Mesh) -> None:
    """Its config says so (as Triton's), and a unary call gets Triton's error for decoupled models."""
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as client:
        config = client.get_model_config("repeat_then_double").config
        assert config.model_transaction_policy.decoupled
        with pytest.raises(InferenceServerException) as err:
            client.infer("repeat_then_double", _repeat([1]))
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in (err.value.message() or "")


def test_a_step_fed_from_two_lineages_is_refused_with_tritons_text(mesh: Mesh) -> None:
    with grpcclient.InferenceServerClient(mesh.gateway.grpc) as client:
        assert not client.is_model_ready("mixed_lineage")
        index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["mixed_lineage"].state == "UNAVAILABLE"
    assert ("in ensemble mixed_lineage, step of model 'pair_add' receives inputs originated from different "
            "decoupled models") in index["mixed_lineage"].reason


def _model_stats(mesh: Mesh, model: str) -> tuple[int, int, float]:
    """(success, fail) of the service's statistics and its CANCELED failures on /metrics."""
    with urllib.request.urlopen(f"http://{mesh.service.http}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    canceled = metric(mesh.service.http, "nv_inference_request_failure", model=model, version="1", reason="CANCELED")
    return stats["success"].get("count", 0), stats["fail"].get("count", 0), canceled


def test_a_decoupled_request_that_ends_counts_once_as_a_success(mesh: Mesh) -> None:
    """A decoupled request that ends with its final response is one success, not a cancellation
    (its generator closes after the final response while its batch may still run)."""
    success, fail, canceled = _model_stats(mesh, "repeat_int32")
    got = _ok(_stream(mesh.service.grpc, [("repeat_int32", _repeat([1, 2], [0, 50]), "done")], 3,
                      enable_empty_final_response=True))
    assert got[2].get_response().parameters["triton_final_response"].bool_param
    eventually(lambda: _model_stats(mesh, "repeat_int32") == (success + 1, fail, canceled), what="one success")


# A model that batches (NVIDIA's qa/L0_backend_python decoupled_execute_error and lifecycle execute_error
# rely on this): each request answers OUT = [its place in the batch execute() got, its IN]; decoupled
# through its response sender, else returned.
BATCH_PLACE = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        answers = []
        for place, request in enumerate(requests):
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[place, int(x.reshape(-1)[0])]],
                                                                              dtype=np.int32))])
            if self.decoupled:
                request.get_response_sender().send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            answers.append(out)
        return None if self.decoupled else answers
'''


@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "not-decoupled"])
def test_one_streams_requests_reach_the_model_in_the_order_sent(tmp_path: Any, decoupled: bool) -> None:
    """Requests on one stream to a model that batches are one batch, in the order the
    client sent them, as in Triton (whose stream hands its requests to the scheduler one after the
    other; NVIDIA's qa/L0_backend_python decoupled_execute_error test relies on it). Through a fresh
    gateway whose first hop stream is open (another client's streamed request opened it), the
    gateway spread one client stream's requests round robin over its two hop streams: read in one
    go, the first opened the second hop stream and waited for it, the next went out at once on the
    open one and reached the batch first (3 runs of 4 on the code before; a model that is not
    decoupled went by the unary path, whose hop stream was chosen the same way)."""
    python_models.write(tmp_path, "repeat_int32", python_models.REPEAT_INT32, python_models.REPEAT_CONFIG.lstrip())
    python_models.write(tmp_path, "batch_place", BATCH_PLACE, python_models.config(
        "batch_place", [("IN", "TYPE_INT32", "1")], [("OUT", "TYPE_INT32", "2")], max_batch_size=8,
        extra=("model_transaction_policy { decoupled: true }\n" if decoupled else "")
              + "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 3000000 }\n"))
    with service_and_gateway("python", ["--repository", str(tmp_path)]) as (_, gateway):
        got: queue.Queue[Any] = queue.Queue()
        with grpcclient.InferenceServerClient(gateway.grpc) as first:
            first.start_stream(callback=lambda result, error: got.put(error or result))
            first.async_stream_infer("repeat_int32", _repeat([7]), enable_empty_final_response=True)
            assert [got.get(timeout=30).get_response().parameters["triton_final_response"].bool_param
                    for _ in range(2)] == [False, True]
            first.stop_stream()
        # four requests written at once (as tritonclient's stream sends quick ones)
        answers = asyncio.run(_in_one_write(gateway.grpc, "batch_place", (10, 20, 30, 40)))
    assert not [a for a in answers if a.error_message], answers
    places = sorted(_out(a) for a in answers)
    assert places == [[0, 10], [1, 20], [2, 30], [3, 40]]


def _out(answer: Any) -> list[int]:
    return np.frombuffer(answer.infer_response.raw_output_contents[0], np.int32).tolist()


async def _in_one_write(target: str, model: str, values: tuple[int, ...]) -> list[Any]:
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    requests = []
    for value in values:
        r = service_pb2.ModelInferRequest(model_name=model, id=str(value))
        r.inputs.add(name="IN", datatype="INT32", shape=[1, 1])
        r.raw_input_contents.append(np.array([[value]], np.int32).tobytes())
        requests.append(r)
    async with grpc.aio.insecure_channel(target) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests))
        return [await call.read() for _ in values]


@pytest.mark.parametrize("where", ["gateway", "service"])
def test_tritons_grpc_error_mode_ends_the_stream_with_the_errors_status(mesh: Mesh, where: str) -> None:
    """With the client's metadata ``triton_grpc_error: true`` (Triton's gRPC error mode, NVIDIA's
    qa/L0_backend_python/lifecycle), a request's error ends the call with its gRPC status, and no
    later answer comes; without it the error travels in band (no status) and the call goes on."""
    target = mesh.gateway.grpc if where == "gateway" else mesh.service.grpc
    for mode in (True, False):
        got: queue.Queue[Any] = queue.Queue()
        client = grpcclient.InferenceServerClient(target)
        client.start_stream(callback=lambda result, error, got=got: got.put(error or result),
                            headers={"triton_grpc_error": "true"} if mode else None)
        try:
            client.async_stream_infer("double", [_input("X", [2])])
            assert got.get(timeout=20).as_numpy("Y").tolist() == [4]
            client.async_stream_infer("no_such_model", [_input("X", [2])])
            error = got.get(timeout=20)
            assert isinstance(error, InferenceServerException)
            assert "no_such_model" in error.message()
            if mode:
                assert str(error.status()) == "StatusCode.NOT_FOUND"
                with pytest.raises(InferenceServerException, match="no longer in valid state"):
                    client.async_stream_infer("double", [_input("X", [3])])  # (tritonclient: the call ended)
                assert got.empty()
            else:
                assert error.status() is None
                client.async_stream_infer("double", [_input("X", [3])])
                assert got.get(timeout=20).as_numpy("Y").tolist() == [6]
        finally:
            client.stop_stream()
            client.close()
