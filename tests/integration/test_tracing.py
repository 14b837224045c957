"""One trace across client -> gateway -> service -> batch, exported over OTLP to a real receiver.

The test runs a small OTLP/gRPC TraceService (the collector's protocol, from opentelemetry-proto)
and starts a gateway and an ONNX service as separate processes that export to it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.telemetry.text_lines import ARG_MAX
from tests.conftest import Proc, _wait_http_ready, start
from tests.integration.test_gateway_routes import ROUTES
from tests.support import eventually, models


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    links: list[tuple[str, str]]
    attributes: dict[str, object]
    status: int
    status_message: str = ""
    trace_state: str = ""


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request, context):  # the collector's RPC name
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {}
                    for a in s.attributes:
                        v = a.value
                        attrs[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
                    got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    s.kind, [(lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links], attrs,
                                    s.status.code, s.status.message, s.trace_state))
        with self.lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def wait(self, pred, timeout: float = 15) -> list[Span]:
        """The spans once ``pred`` holds for them, or after ``timeout`` (the caller's assertions say what is missing)."""
        with contextlib.suppress(AssertionError):
            eventually(lambda: pred(self.snapshot()), timeout, interval=0.1)
        return self.snapshot()


@dataclass
class TracedStack:
    receiver: Receiver
    service: Proc
    gateway: Proc
    endpoint: str  # the receiver's OTLP endpoint


# Two independent branches over small_mlp: both steps are children of the ensemble span.
PAIR = models.ensemble_config("mlp_pair", {"X": 64}, {"A": 64, "B": 64}, [
    models.step("small_mlp", {"INPUT0": "X"}, {"OUTPUT0": "A"}), models.step("small_mlp", {"INPUT0": "X"}, {"OUTPUT0": "B"})])


def _otel_env(endpoint: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_SAMPLER": "parentbased_always_off",
            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": ""}


def _extra_gateway(traced: TracedStack, *args: str) -> Proc:
    """Another gateway over the same service, exporting to the same receiver."""
    gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", traced.service.grpc, *args],
                    env=_otel_env(traced.endpoint))
    _wait_http_ready(gateway.http)
    return gateway


# small_mlp gathering exactly BURST requests per batch: a full batch runs at once, and none runs
# before it is full (a 60 s delay, early release off), so the burst below shares one batch
# however slowly the suite's load lets its requests arrive.
BURST = 8
MLP_BURST = f"""name: "mlp_burst"
platform: "onnxruntime_onnx"
max_batch_size: {BURST}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 60000000 }}
parameters {{ key: "meshserve_early_release" value: {{ string_value: "false" }} }}
"""


def _traced_repo(model_repo: Path, repo: Path) -> Path:
    """The tests' small_mlp and scale, and mlp_burst (small_mlp's graph, MLP_BURST's config)."""
    for name in ("small_mlp", "scale"):
        shutil.copytree(model_repo / name, repo / name)
    (repo / "mlp_burst" / "1").mkdir(parents=True)
    shutil.copy(model_repo / "small_mlp" / "1" / "model.onnx", repo / "mlp_burst" / "1" / "model.onnx")
    (repo / "mlp_burst" / "config.pbtxt").write_text(MLP_BURST)
    return repo


@pytest.fixture(scope="module")
def traced(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedStack]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = _otel_env(f"http://127.0.0.1:{port}")
    repo = _traced_repo(model_repo, tmp_path_factory.mktemp("traced-models"))
    service = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"],
                    env=env)
    try:
        ens = tmp_path_factory.mktemp("traced-ensembles")
        (ens / "mlp_pair" / "1").mkdir(parents=True)
        (ens / "mlp_pair" / "config.pbtxt").write_text(PAIR)
        # coalescing off: concurrent requests reach the service's batcher as they are sent
        # (the merging gateway below covers traces through the coalescer)
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                         "--log-format", "json", "--repository", str(ens), "--coalesce-inflight", "0"], env=env)
    except Exception:
        service.stop()
        server.stop(0)
        raise
    _wait_http_ready(gateway.http)
    yield TracedStack(receiver, service, gateway, f"http://127.0.0.1:{port}")
    gateway.stop()
    service.stop()
    server.stop(0)


@pytest.fixture(scope="module")
def gated(traced: TracedStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A second gateway, with tenants and an A/B route, exporting to the same receiver."""
    d = tmp_path_factory.mktemp("traced-gated")
    (d / "routes.yaml").write_text(ROUTES)  # scale-ab: scale versions 1 and 2, arms v1 and v2
    key = hashlib.sha256(b"acme-key").hexdigest()
    (d / "tenants.yaml").write_text(f"""
tenants:
  - name: acme
    keys_sha256: ["{key}"]
    rate: 1000
    burst: 1000
    models: ["scale-ab"]
""")
    gateway = _extra_gateway(traced, "--routes", str(d / "routes.yaml"), "--tenants", str(d / "tenants.yaml"))
    yield gateway
    gateway.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _mlp_input(i: int = 1) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.full((1, 64), float(i), dtype=np.float32))
    return inp


def _complete(trace_id: str):
    names = {"gateway.request", "gateway.route", "gateway.upstream", "service.request", "service.queue",
             "service.batch", "service.compute"}
    return lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id}


def _burst(url: str, model: str = "mlp_burst", n: int = BURST) -> set[str]:
    """``n`` concurrent requests, each with a sampled traceparent of its own; their trace ids."""
    parents = [_traceparent() for _ in range(n)]
    done: list[object] = []
    with grpcclient.InferenceServerClient(url) as c:
        for i, (tp, _, _) in enumerate(parents):
            c.async_infer(model, [_mlp_input(i)], lambda result, error, out=done: out.append(error),
                          headers={"traceparent": tp})
        eventually(lambda: len(done) >= n, what=f"{n} answers")
    assert done == [None] * n
    return {t for _, t, _ in parents}


def _all_batched(trace_ids: set[str]):
    """Every request's spans are in, and a batch span links each one's service span (the batch
    and compute spans themselves belong to the trace of one member only)."""
    names = {"gateway.request", "gateway.route", "gateway.upstream", "service.request", "service.queue"}

    def done(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id in trace_ids]
        if any(not names <= {s.name for s in mine if s.trace_id == t} for t in trace_ids):
            return False
        linked = {lk for s in spans if s.name == "service.batch" for lk in s.links}
        return all((s.trace_id, s.span_id) in linked for s in mine if s.name == "service.request")
    return done


def test_one_trace_client_gateway_service_batch(traced: TracedStack) -> None:
    tp, trace_id, client_span = _traceparent()
    with grpcclient.InferenceServerClient(traced.gateway.grpc) as c:
        out = c.infer("small_mlp", [_mlp_input()], headers={"traceparent": tp}).as_numpy("OUTPUT0")
    assert out.shape == (1, 64)
    traced.receiver.wait(_complete(trace_id))
    spans = {s.name: s for s in traced.receiver.trace(trace_id)}
    assert set(spans) >= {"gateway.request", "gateway.route", "gateway.upstream", "service.request",
                          "service.queue", "service.batch", "service.compute"}, spans
    gw, route, up = spans["gateway.request"], spans["gateway.route"], spans["gateway.upstream"]
    svc, queue, batch, compute = (spans[n] for n in ("service.request", "service.queue", "service.batch",
                                                     "service.compute"))
    # two processes, one trace id, named per process
    assert {gw.service, route.service, up.service} == {"meshserve-gateway"}
    assert {svc.service, queue.service, batch.service, compute.service} == {"meshserve-onnx"}
    # parent/child edges: client -> gateway -> upstream call -> service -> queue/batch -> compute
    assert gw.parent == client_span and gw.kind == 2  # SPAN_KIND_SERVER
    assert route.parent == gw.span_id and route.attributes["meshserve.model"] == "small_mlp"
    assert "meshserve.model_version" in route.attributes
    assert up.parent == gw.span_id and up.kind == 3  # SPAN_KIND_CLIENT
    assert svc.parent == up.span_id and svc.kind == 2
    assert queue.parent == svc.span_id
    assert batch.parent == svc.span_id and (trace_id, svc.span_id) in batch.links
    assert batch.attributes["meshserve.batch.size"] == 1 and "meshserve.instance" in batch.attributes
    assert compute.parent == batch.span_id


def test_batch_span_links_every_request_that_shared_it(traced: TracedStack) -> None:
    trace_ids = _burst(traced.gateway.grpc)  # (mlp_burst runs them as one batch of BURST: MLP_BURST)
    spans = traced.receiver.wait(_all_batched(trace_ids))
    requests = {s.trace_id: s for s in spans if s.name == "service.request" and s.trace_id in trace_ids}
    assert set(requests) == trace_ids
    wanted = {(s.trace_id, s.span_id) for s in requests.values()}
    batches = [s for s in spans if s.name == "service.batch" and set(s.links) & wanted]
    assert len(batches) == 1 and set(batches[0].links) == wanted, [b.links for b in batches]
    assert batches[0].attributes["meshserve.batch.size"] == BURST
    assert batches[0].attributes["meshserve.batch.requests"] == BURST


def test_trace_id_returned_http_header_and_grpc_trailer(traced: TracedStack) -> None:
    tp, trace_id, _ = _traceparent()
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
    req = urllib.request.Request(f"http://{traced.gateway.http}/v2/models/scale/infer", data=body,
                                 headers={"traceparent": tp, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        returned = r.headers["traceparent"]
    assert returned.split("-")[1] == trace_id
    tp, trace_id, _ = _traceparent()
    request = pb.ModelInferRequest(model_name="scale")
    t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    t.contents.fp32_contents.extend([1, 2, 3, 4])
    with grpc.insecure_channel(traced.gateway.grpc) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=pb.ModelInferRequest.SerializeToString,
                              response_deserializer=pb.ModelInferResponse.FromString)
        _, info = call.with_call(request, metadata=(("traceparent", tp),), timeout=10)
        trailer = dict(info.trailing_metadata())
    assert trailer["traceparent"].split("-")[1] == trace_id


def _settled(receiver: Receiver) -> int:
    """The span count once earlier tests' exports stopped arriving."""
    count = -1
    while count != len(receiver.spans):
        count = len(receiver.spans)
        time.sleep(0.6)  # the point: > OTEL_BSP_SCHEDULE_DELAY with no new span means none is coming
    return count


def test_unsampled_requests_leave_no_spans(traced: TracedStack) -> None:
    before = _settled(traced.receiver)
    with grpcclient.InferenceServerClient(traced.gateway.grpc) as c:
        for i in range(5):
            c.infer("small_mlp", [_mlp_input(i)])  # no traceparent; the sampler is parentbased_always_off
        tp = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00"  # client says: not sampled
        c.infer("small_mlp", [_mlp_input()], headers={"traceparent": tp})
    assert _settled(traced.receiver) == before


def test_failed_request_marks_spans_as_errors(traced: TracedStack) -> None:
    tp, trace_id, _ = _traceparent()
    bad = grpcclient.InferInput("INPUT0", [1, 63], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 63), dtype=np.float32))
    with grpcclient.InferenceServerClient(traced.gateway.grpc) as c, pytest.raises(Exception, match="shape"):
        c.infer("small_mlp", [bad], headers={"traceparent": tp})
    spans = traced.receiver.wait(
        lambda ss: {"gateway.request", "service.request"} <= {s.name for s in ss if s.trace_id == trace_id})
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    assert by_name["gateway.request"].status == 2  # STATUS_CODE_ERROR
    assert by_name["service.request"].status == 2
    assert by_name["gateway.upstream"].status == 2


def test_a_clients_long_strings_are_cut_in_spans_and_log_lines(traced: TracedStack) -> None:
    """A request id and an input name of a million characters each, and a tracestate member past
    W3C's 256 characters: every span keeps at most ``ARG_MAX`` characters of them (and no
    tracestate), every log line of the failed request is a few KiB (text_lines.py; the code
    before: each span and each line held the whole id and name, ~2 MB a line)."""
    tp, trace_id, _ = _traceparent()
    long_id, long_name = "LONGID" + "i" * 1_000_000, "LONGNAME" + "n" * 1_000_000
    bad = grpcclient.InferInput(long_name, [1, 64], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    with grpcclient.InferenceServerClient(traced.gateway.grpc) as c, \
            pytest.raises(InferenceServerException, match="unexpected inference input 'LONGNAMEnnn"):
        c.infer("small_mlp", [bad], request_id=long_id,
                headers={"traceparent": tp, "tracestate": f"ok=1,vendor={'v' * 257}"})
    spans = traced.receiver.wait(
        lambda ss: {"gateway.request", "service.request"} <= {s.name for s in ss if s.trace_id == trace_id})
    mine = [s for s in spans if s.trace_id == trace_id]
    assert {"gateway.request", "service.request"} <= {s.name for s in mine}, mine
    most = ARG_MAX + len("...[1000000 more characters]")
    for s in mine:
        assert s.trace_state == "", (s.name, s.trace_state[:80])
        assert len(s.status_message) <= most, (s.name, len(s.status_message))
        assert all(len(v) <= most for v in s.attributes.values() if isinstance(v, str)), \
            (s.name, {k: len(v) for k, v in s.attributes.items() if isinstance(v, str)})
    assert any(str(s.attributes.get("meshserve.request_id", "")).startswith("LONGIDiii") for s in mine), mine
    # (the service's line has the gateway's id for the hop, and the input name)
    for proc, what in ((traced.gateway, "the gateway's JSON line"), (traced.service, "the service's text line")):
        eventually(lambda p=proc: any("LONGNAMEnnn" in line for line in p.output), what=what)
        logged = [line for line in proc.output if "LONGIDiii" in line or "LONGNAMEnnn" in line]
        assert all(len(line) <= 4 * ARG_MAX for line in logged), [len(line) for line in logged]


def test_ensemble_steps_are_children_of_the_ensemble_span(traced: TracedStack) -> None:
    tp, trace_id, _ = _traceparent()
    inp = grpcclient.InferInput("X", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
    with grpcclient.InferenceServerClient(traced.gateway.grpc) as c:
        res = c.infer("mlp_pair", [inp], headers={"traceparent": tp})
    assert res.as_numpy("A").shape == (1, 64) and res.as_numpy("B").shape == (1, 64)

    def done(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return sum(s.name == "service.request" for s in mine) == 2 and any(s.name == "gateway.ensemble" for s in mine)

    traced.receiver.wait(done)
    spans = traced.receiver.trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    (request,) = [s for s in spans if s.name == "gateway.request"]
    (ensemble,) = [s for s in spans if s.name == "gateway.ensemble"]
    steps = [s for s in spans if s.name == "gateway.ensemble.step"]
    assert ensemble.parent == request.span_id and ensemble.attributes["meshserve.ensemble"] == "mlp_pair"
    assert sorted(s.attributes["meshserve.step"] for s in steps) == [0, 1]
    assert all(s.parent == ensemble.span_id for s in steps)
    # each step's upstream call, and the service work under it, hang below that step
    upstreams = [s for s in spans if s.name == "gateway.upstream"]
    assert sorted(by_id[u.parent].attributes["meshserve.step"] for u in upstreams) == [0, 1]
    services = [s for s in spans if s.name == "service.request"]
    assert {by_id[s.parent].name for s in services} == {"gateway.upstream"}


def _scale_input() -> grpcclient.InferInput:
    inp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    return inp


def test_admission_and_route_decision_spans(traced: TracedStack, gated: Proc) -> None:
    tp, trace_id, _ = _traceparent()
    with grpcclient.InferenceServerClient(gated.grpc) as c:
        res = c.infer("scale-ab", [_scale_input()], headers={"traceparent": tp, "x-api-key": "acme-key"})
    arm = res.get_response().parameters["meshserve_route_arm"].string_param
    assert arm in ("v1", "v2")
    spans = traced.receiver.wait(
        lambda ss: {"gateway.admission", "gateway.route", "service.request"} <= {s.name for s in ss
                                                                                   if s.trace_id == trace_id})
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    request, admission, route = by_name["gateway.request"], by_name["gateway.admission"], by_name["gateway.route"]
    assert admission.parent == request.span_id and admission.attributes["meshserve.tenant"] == "acme"
    assert admission.status == 0  # STATUS_CODE_UNSET
    assert route.parent == request.span_id
    assert route.attributes["meshserve.route"] == "scale-ab" and route.attributes["meshserve.arm"] == arm
    assert route.attributes["meshserve.model"] == "scale"
    assert route.attributes["meshserve.model_version"] == arm.removeprefix("v")
    assert request.attributes["meshserve.arm"] == arm


def test_rejected_admission_is_an_error_span(traced: TracedStack, gated: Proc) -> None:
    tp, trace_id, _ = _traceparent()
    with grpcclient.InferenceServerClient(gated.grpc) as c, pytest.raises(Exception, match="may not call"):
        c.infer("scale", [_scale_input()], headers={"traceparent": tp, "x-api-key": "acme-key"})
    spans = traced.receiver.wait(lambda ss: any(s.name == "gateway.admission" and s.trace_id == trace_id
                                                for s in ss))
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    admission = by_name["gateway.admission"]
    assert admission.status == 2 and admission.attributes["meshserve.error_code"] == "PERMISSION_DENIED"
    assert "service.request" not in by_name and "gateway.upstream" not in by_name


@pytest.fixture(scope="module")
def merging(traced: TracedStack) -> Iterator[Proc]:
    """A gateway whose coalescer sends one request at a time: the rest of a burst is merged."""
    gateway = _extra_gateway(traced, "--coalesce-inflight", "1")
    yield gateway
    gateway.stop()


def test_merged_requests_keep_one_trace_each(traced: TracedStack, merging: Proc) -> None:
    for _attempt in range(3):  # the burst must reach the coalescer while the first request is out
        trace_ids = _burst(merging.grpc, "small_mlp")
        spans = traced.receiver.wait(_all_batched(trace_ids))
        by_trace: dict[str, dict[str, Span]] = {t: {} for t in trace_ids}
        for s in spans:
            if s.trace_id in by_trace:
                by_trace[s.trace_id][s.name] = s
        # every client request keeps its own trace: gateway -> upstream -> service -> queue
        for t, mine in by_trace.items():
            assert mine["gateway.upstream"].parent == mine["gateway.request"].span_id, t
            assert mine["gateway.route"].parent == mine["gateway.request"].span_id, t
            assert mine["service.request"].parent == mine["gateway.upstream"].span_id, t
            assert mine["service.queue"].parent == mine["service.request"].span_id, t
        merged = [m for m in by_trace.values() if m["gateway.upstream"].attributes.get("meshserve.merged_requests")]
        if not merged:
            continue
        count = merged[0]["gateway.upstream"].attributes["meshserve.merged_requests"]
        assert isinstance(count, int) and count >= 2
        members = {m["service.request"].attributes["meshserve.member"] for m in merged
                   if m["service.request"].attributes.get("meshserve.merged_requests") == count}
        assert members <= set(range(count)) and len(members) >= 2
        # the batch that ran a merged request links the service span of each member in it
        wanted = {(m["service.request"].trace_id, m["service.request"].span_id) for m in merged}
        batches = [s for s in spans if s.name == "service.batch" and set(s.links) & wanted]
        assert sorted(lk for b in batches for lk in b.links if lk in wanted) == sorted(wanted)
        assert max(b.attributes["meshserve.batch.requests"] for b in batches) >= count
        return
    raise AssertionError("no burst of 8 was merged by a gateway with --coalesce-inflight 1 in 3 attempts")


def _roots(receiver: Receiver, model: str) -> set[str]:
    """Trace ids of the gateway's root request spans (no parent) for ``model``."""
    with receiver.lock:
        return {s.trace_id for s in receiver.spans if s.name == "gateway.request" and not s.parent
                and s.attributes.get("meshserve.model") == model}


def test_trace_extension_settings_steer_sampling(traced: TracedStack) -> None:
    """Triton's trace extension (tritonclient's get/update_trace_settings, HTTP and gRPC): the
    settings describe this process's sampler, a model's trace_rate/trace_count start and stop
    root traces for that model only, trace_level OFF stops even a client's sampled trace, and
    bad settings get 400 / INVALID_ARGUMENT naming the setting."""
    from tritonclient.http import InferenceServerClient as HttpClient
    from tritonclient.utils import InferenceServerException

    gw = traced.gateway
    http = HttpClient(gw.http)
    assert "trace" in http.get_server_metadata()["extensions"]
    assert http.get_trace_settings() == {  # parentbased_always_off: roots never sampled
        "trace_file": "", "trace_level": ["TIMESTAMPS"], "trace_rate": "0", "trace_count": "-1",
        "log_frequency": "0", "trace_mode": "opentelemetry"}
    try:
        with grpcclient.InferenceServerClient(gw.grpc) as c:
            got = c.update_trace_settings("small_mlp", {"trace_rate": "1", "trace_count": "2"}, as_json=True)
            assert got["settings"]["trace_rate"]["value"] == ["1"] and got["settings"]["trace_count"]["value"] == ["2"]
            assert c.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["0"]  # global unchanged
            before = _settled(traced.receiver)
            mlp_before, scale_before = _roots(traced.receiver, "small_mlp"), _roots(traced.receiver, "scale")
            for i in range(5):  # no traceparent: roots; two of them are traced, then the count is spent
                c.infer("small_mlp", [_mlp_input(i)])
            scale = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            scale.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
            c.infer("scale", [scale])  # no override: the global rate 0 holds
            assert _settled(traced.receiver) > before
            assert len(_roots(traced.receiver, "small_mlp") - mlp_before) == 2
            assert _roots(traced.receiver, "scale") == scale_before
            assert c.get_trace_settings("small_mlp", as_json=True)["settings"]["trace_count"]["value"] == ["0"]

            assert http.update_trace_settings(settings={"trace_level": ["OFF"]})["trace_level"] == ["OFF"]
            before = _settled(traced.receiver)
            tp, trace_id, _ = _traceparent()  # the client sampled it; level OFF still traces nothing
            c.infer("small_mlp", [_mlp_input()], headers={"traceparent": tp})
            assert _settled(traced.receiver) == before and not traced.receiver.trace(trace_id)

            with pytest.raises(InferenceServerException, match="TENSORS is not supported"):
                http.update_trace_settings(settings={"trace_level": ["TENSORS"]})
            with pytest.raises(InferenceServerException, match="trace_rate must be at least 1") as caught:
                c.update_trace_settings(settings={"trace_rate": "0"})
            assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
            with pytest.raises(InferenceServerException, match="'trace_file' cannot be updated"):
                http.update_trace_settings("small_mlp", {"trace_file": "/tmp/x.json"})
            with pytest.raises(InferenceServerException, match="no_such_model") as caught:
                c.get_trace_settings("no_such_model")
            assert caught.value.status() == "StatusCode.NOT_FOUND"
            req = urllib.request.Request(f"http://{gw.http}/v2/trace/setting", data=b"[1]", method="POST")
            with pytest.raises(urllib.error.HTTPError) as bad:
                urllib.request.urlopen(req, timeout=10)
            assert bad.value.code == 400 and b"JSON object" in bad.value.read()
    finally:
        http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
        cleared = http.update_trace_settings("small_mlp", {"trace_rate": None, "trace_count": None})
        http.close()
    assert cleared["trace_rate"] == "0" and cleared["trace_count"] == "-1" and cleared["trace_level"] == ["TIMESTAMPS"]


def test_perf_analyzer_trace_flags_set_the_settings(traced: TracedStack) -> None:
    """perf_analyzer's --trace-* flags go through TraceSetting before it measures."""
    import subprocess

    from tritonclient.http import InferenceServerClient as HttpClient

    from tests.integration.test_perf_analyzer import TOOL

    if not TOOL.exists() and not os.environ.get("CI"):  # as test_perf_analyzer.py: CI must have it
        pytest.skip(f"perf_analyzer wrapper not found at {TOOL}")
    gw = traced.gateway
    http = HttpClient(gw.http)
    before = _roots(traced.receiver, "small_mlp")
    try:
        proc = subprocess.run([str(TOOL), "-m", "small_mlp", "-u", gw.grpc, "-i", "grpc", "--concurrency-range", "1",
                               "--measurement-interval", "200", "--stability-percentage", "999", "--max-trials", "8",
                               "--trace-level", "TIMESTAMPS", "--trace-rate", "1", "--trace-count", "3",
                               "--log-frequency", "7"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        settings = http.get_trace_settings()
        assert (settings["trace_rate"], settings["trace_count"], settings["log_frequency"]) == ("1", "0", "7")
        _settled(traced.receiver)
        assert len(_roots(traced.receiver, "small_mlp") - before) == 3  # every root until the count ran out
    finally:
        http.update_trace_settings(settings={"trace_rate": "1000", "trace_count": "0", "log_frequency": "0"})
        http.close()
