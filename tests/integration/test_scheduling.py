"""Schedule-policy semantics through the gateway with the real tritonclient: priority levels,
queue-full, queue timeouts (REJECT), observed through responses and the statistics extension.

The model is deliberately slow (~150 ms a request, one instance, no batching across requests)
so that requests sent while it runs really wait in the service's queue. Its one weight, shared by
its 800 MatMuls, is not prepacked (session.disable_prepacking): onnxruntime prepacked it once per
node, a 4-14 s load for the same ~150 ms a request.
"""
from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from meshserve.protocol.wire import RETRY_PUSHBACK_METADATA
from tests.conftest import Proc, start
from tests.support import eventually, models
from tests.support.metrics import sample, scrape

N, LAYERS = 2048, 800
CONFIG = """name: "slow"
platform: "onnxruntime_onnx"
max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2048 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2048 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
optimization { graph { level: 2 } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
parameters { key: "session.disable_prepacking" value: { string_value: "1" } }
dynamic_batching {
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { max_queue_size: 3 }
  priority_queue_policy { key: 1 value { max_queue_size: 3 allow_timeout_override: true } }
}
"""


def slow_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.eye(N, dtype=np.float32), "W")  # identity: values stay finite
    nodes, prev = [], "INPUT0"
    for i in range(LAYERS):
        out = "OUTPUT0" if i == LAYERS - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, "W"], [out]))
        prev = out
    return models.onnx_model(nodes, "slow", [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["b", N])],
                             [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["b", N])], [w])


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("sched")
    models.write(repo, "slow", CONFIG, {1: slow_model()})
    service = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc])
    gw.upstream = service  # type: ignore[attr-defined]
    yield gw
    gw.stop()
    service.stop()


class Outcomes:
    def __init__(self) -> None:
        self.order: list[str] = []
        self.errors: dict[str, InferenceServerException] = {}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def send(self, gw: Proc, name: str, protocol: str = "grpc", **kw: object) -> None:
        def run() -> None:
            x = np.full((1, N), 1.0, np.float32)
            try:
                if protocol == "grpc":
                    with grpcclient.InferenceServerClient(gw.grpc) as c:
                        inp = grpcclient.InferInput("INPUT0", [1, N], "FP32")
                        inp.set_data_from_numpy(x)
                        c.infer("slow", [inp], **kw)  # type: ignore[arg-type]
                else:
                    with httpclient.InferenceServerClient(gw.http) as c:
                        inp = httpclient.InferInput("INPUT0", [1, N], "FP32")
                        inp.set_data_from_numpy(x)
                        c.infer("slow", [inp], **kw)  # type: ignore[arg-type]
                with self.lock:
                    self.order.append(name)
            except InferenceServerException as exc:
                with self.lock:
                    self.errors[name] = exc

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

    def wait(self) -> None:
        for t in self.threads:
            t.join(60)


class Arrivals:
    """Requests for 'slow' that reached the service since this was made, from its /metrics:
    those in it (executing or queued: nv_inference_pending_request_count) and those it finished."""

    def __init__(self, gw: Proc) -> None:
        self.service: Proc = getattr(gw, "upstream", gw)
        self.base = self.count()

    def count(self) -> float:
        s = scrape(self.service.http)
        return sum(sample(s, name, model="slow") for name in (
            "nv_inference_pending_request_count", "nv_inference_request_success", "nv_inference_request_failure"))

    def wait(self, n: int) -> None:
        """Until ``n`` have arrived: what is sent next arrives behind them."""
        eventually(lambda: self.count() - self.base >= n, what=f"{n} requests at the service")


def _stats(gw: Proc) -> dict:
    with httpclient.InferenceServerClient(gw.http) as c:
        return c.get_inference_statistics("slow")["model_stats"][0]["inference_stats"]


def test_higher_priority_overtakes_queued_requests(gateway: Proc) -> None:
    o = Outcomes()
    arrived = Arrivals(gateway)
    o.send(gateway, "blocker")
    arrived.wait(1)  # the blocker is executing; the rest queue behind it
    for i in range(3):
        o.send(gateway, f"low{i}")
    arrived.wait(4)
    o.send(gateway, "high0", priority=1)
    o.send(gateway, "high1", priority=1)
    o.wait()
    assert not o.errors, o.errors
    assert o.order[0] == "blocker"
    assert set(o.order[1:3]) == {"high0", "high1"}, o.order
    assert set(o.order[3:]) == {"low0", "low1", "low2"}


def _full_queue(gateway: Proc) -> Outcomes:
    """One request executing and the default level's queue full behind it (max_queue_size 3)."""
    o = Outcomes()
    arrived = Arrivals(gateway)
    o.send(gateway, "blocker")
    arrived.wait(1)
    for i in range(3):
        o.send(gateway, f"queued{i}")
    arrived.wait(4)
    return o


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_queue_full_is_resource_exhausted(gateway: Proc, protocol: str) -> None:
    o = _full_queue(gateway)
    o.send(gateway, "overflow", protocol)
    o.wait()
    assert set(o.errors) == {"overflow"}, (o.order, o.errors)
    err = o.errors["overflow"]
    assert err.status() == ("StatusCode.RESOURCE_EXHAUSTED" if protocol == "grpc" else "429")
    assert "queue" in err.message()


def _refusal_hint(gw: Proc, protocol: str) -> tuple[str, str | None]:
    """One request for 'slow' by raw HTTP or tritonclient's gRPC stub (tritonclient itself keeps
    no headers or trailing metadata): (status, Retry-After or grpc-retry-pushback-ms)."""
    x = np.full((1, N), 1.0, np.float32)
    if protocol == "http":
        host, port = gw.http.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, N], "datatype": "FP32",
                                           "data": x.ravel().tolist()}]})
            conn.request("POST", "/v2/models/slow/infer", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            return str(r.status), r.getheader("Retry-After")
        finally:
            conn.close()
    req = service_pb2.ModelInferRequest(model_name="slow")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, N])
    req.raw_input_contents.append(x.tobytes())
    with grpc.insecure_channel(gw.grpc) as channel:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
            return "OK", None
        except grpc.RpcError as exc:
            md = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
            return str(exc.code()), md.get(RETRY_PUSHBACK_METADATA)  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_queue_full_says_when_to_retry(gateway: Proc, protocol: str) -> None:
    """The service's queue-full refusal carries a retry hint, and the gateway passes it on."""
    o = _full_queue(gateway)
    status, hint = _refusal_hint(gateway, protocol)
    o.wait()
    assert not o.errors, o.errors
    assert (status, hint) == (("StatusCode.RESOURCE_EXHAUSTED", "1000") if protocol == "grpc" else ("429", "1"))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_queue_timeout_rejects_and_is_counted(gateway: Proc, protocol: str) -> None:
    before = _stats(gateway)
    o = Outcomes()
    arrived = Arrivals(gateway)
    o.send(gateway, "blocker")
    arrived.wait(1)
    o.send(gateway, "impatient", protocol, priority=1, timeout=5000)  # 5 ms in the queue at most
    o.send(gateway, "patient", protocol, priority=1)
    o.wait()
    assert set(o.errors) == {"impatient"}, (o.order, o.errors)
    err = o.errors["impatient"]
    assert err.status() == ("StatusCode.DEADLINE_EXCEEDED" if protocol == "grpc" else "504")
    assert "deadline" in err.message()
    after = _stats(gateway)
    assert after["fail"]["count"] - before["fail"]["count"] == 1
    assert after["success"]["count"] - before["success"]["count"] == 2


def test_the_model_is_slow_enough_for_these_tests(gateway: Proc) -> None:
    stats = _stats(gateway)
    per_request_ms = stats["compute_infer"]["ns"] / max(1, stats["compute_infer"]["count"]) / 1e6
    assert per_request_ms > 60, f"the test model runs in {per_request_ms:.1f} ms: timing assumptions break"


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_priority_above_the_levels_queues_at_the_default_level(gateway: Proc, protocol: str) -> None:
    """As Triton's (core's infer_request.cc, InferenceRequest::SetPriority: 0 or a priority
    above priority_levels queues at default_priority_level): priority 99 on this model of 2
    levels is served, behind the default level's requests queued before it and behind a
    priority-1 request sent after it."""
    o = Outcomes()
    arrived = Arrivals(gateway)
    o.send(gateway, "blocker")
    arrived.wait(1)  # the blocker is executing; the rest queue behind it
    o.send(gateway, "default")  # level 2 (the default)
    arrived.wait(2)
    o.send(gateway, "p99", protocol, priority=99)
    arrived.wait(3)
    o.send(gateway, "high", priority=1)
    o.wait()
    assert not o.errors, o.errors
    assert o.order == ["blocker", "high", "default", "p99"]


def test_a_negative_priority_is_invalid(gateway: Proc) -> None:
    """Triton's frontends refuse it (server's grpc infer_handler.cc: "invalid value for
    'priority', expected value >= 0"); tritonclient's gRPC client cannot send one (uint64)."""
    o = Outcomes()
    o.send(gateway, "negative", "http", priority=-1)
    o.wait()
    assert o.errors["negative"].status() == "400", o.errors
    assert "expected value >= 0" in o.errors["negative"].message()


def test_a_client_deadline_expires_the_request_in_the_service_queue(gateway: Proc) -> None:
    """The gRPC deadline crosses the gateway's stream hop: the expired request never runs."""
    with httpclient.InferenceServerClient(gateway.http) as c:
        before = c.get_inference_statistics("slow")["model_stats"][0]
    o = Outcomes()
    arrived = Arrivals(gateway)
    o.send(gateway, "blocker")
    arrived.wait(1)
    o.send(gateway, "hasty", client_timeout=0.03)  # expires while the blocker runs
    o.send(gateway, "follower")
    o.wait()
    assert set(o.errors) == {"hasty"}, (o.order, o.errors)
    assert o.errors["hasty"].status() == "StatusCode.DEADLINE_EXCEEDED"
    with httpclient.InferenceServerClient(gateway.http) as c:
        after = c.get_inference_statistics("slow")["model_stats"][0]
    assert after["execution_count"] - before["execution_count"] == 2  # blocker + follower only
    assert after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 1


def test_client_cancellation_removes_queued_work(gateway: Proc) -> None:
    """A request cancelled by its client while queued never reaches the model (service direct:
    over the gateway's shared stream a cancel cannot reach the service)."""
    service: Proc = gateway.upstream  # type: ignore[attr-defined]
    with httpclient.InferenceServerClient(gateway.http) as c:
        before = c.get_inference_statistics("slow")["model_stats"][0]["execution_count"]
    o = Outcomes()
    arrived = Arrivals(service)
    # Every request goes straight to the service, so none can overtake another on a slower
    # path; the blockers get a head start and the cancelled request waits behind both.
    o.send(service, "blocker0")
    o.send(service, "blocker1")
    arrived.wait(2)
    done = threading.Event()
    with grpcclient.InferenceServerClient(service.grpc) as c:
        inp = grpcclient.InferInput("INPUT0", [1, N], "FP32")
        inp.set_data_from_numpy(np.zeros((1, N), np.float32))
        call = c.async_infer("slow", [inp], callback=lambda result, error: done.set())
        arrived.wait(3)
        call.cancel()
        assert done.wait(10)
    o.send(service, "follower")
    o.wait()
    assert not o.errors
    with httpclient.InferenceServerClient(gateway.http) as c:
        after = c.get_inference_statistics("slow")["model_stats"][0]["execution_count"]
    assert after - before == 3  # two blockers + follower; the cancelled request never ran
