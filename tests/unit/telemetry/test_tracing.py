"""tracing.py and observe.py without sockets: env switches, sampling, parameter injection."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError
from meshserve.server import observe
from meshserve.server.core import InferResult, RequestContext
from meshserve.telemetry import tracing

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_TRACES_SAMPLER": "always_on"}, False),  # a sampler alone exports nothing
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
])
def test_exporter_configured(env: dict[str, str], on: bool) -> None:
    assert tracing.exporter_configured(env) is on


def test_off_by_default_leaves_the_sdk_alone() -> None:
    assert tracing.configure("meshserve-test", "service", env={}) is False
    assert tracing.enabled is False


@contextlib.contextmanager
def configured(role: str, env: dict[str, str], exporters: list[Any] | None = None) -> Iterator[None]:
    """tracing configured for one test; its module state as it was afterwards."""
    saved = {k: getattr(tracing, k) for k in ("enabled", "role", "request_span_name", "_sampler", "root_bound",
                                              "_queue", "_scope", "_encoded", "_on_record")}
    assert tracing.configure("meshserve-test", role, env=env, exporters=exporters)
    try:
        yield
    finally:
        tracing.shutdown()
        for k, v in saved.items():
            setattr(tracing, k, v)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.5", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    exporter = InMemorySpanExporter()
    with configured("gateway", env, [exporter]):
        yield exporter


def test_sampled_roots_keep_the_trace_id_the_sampler_judged(spans: InMemorySpanExporter) -> None:
    made = [tracing.start_server_span("gateway.request", None) for _ in range(400)]
    sampled = [s for s in made if s is not None]
    assert 120 < len(sampled) < 280  # ratio 0.5
    bound = round(0.5 * (1 << 64))
    for s in sampled:
        assert s.get_span_context().trace_id & ((1 << 64) - 1) < bound  # TraceIdRatioBased's rule
        s.end()


def test_remote_parent_decides(spans: InMemorySpanExporter) -> None:
    span = tracing.start_server_span("x", tracing.parent_context(f"00-{TRACE}-{PARENT}-01"))
    assert span is not None and f"{span.get_span_context().trace_id:032x}" == TRACE
    assert f"{span.parent.span_id:016x}" == PARENT and span.parent.is_remote
    assert tracing.start_server_span("x", tracing.parent_context(f"00-{TRACE}-{PARENT}-00")) is None
    assert tracing.parent_context("garbage") is None
    assert tracing.parent_context(f"00-{'0' * 32}-{PARENT}-01") is None


def test_inject_parameters_last_entry_wins(spans: InMemorySpanExporter) -> None:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    request.parameters["traceparent"].string_param = "00-client-old-01"
    span = tracing.start_server_span("x", tracing.parent_context(f"00-{TRACE}-{PARENT}-01", "k=v"))
    assert span is not None
    out = pb.ModelInferRequest.FromString(tracing.inject_parameters(request.SerializeToString(), span))
    assert out.parameters["traceparent"].string_param == tracing.traceparent(span)
    assert out.parameters["tracestate"].string_param == "k=v"
    assert out.id == "r1" and out.model_name == "m"


class _Core:
    def __init__(self, fail: bool = False):
        self.fail = fail

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        if self.fail:
            raise InferError.invalid("bad shape")
        return InferResult(raw=b"")


def test_observe_server_span_from_header_and_error_status(spans: InMemorySpanExporter) -> None:
    req = pb.ModelInferRequest(model_name="m", model_version="1", id="abc")
    ctx = RequestContext("http", {"traceparent": f"00-{TRACE}-{PARENT}-01"})
    _, returned = asyncio.run(observe.infer(_Core(), req, ctx))  # type: ignore[arg-type]
    assert returned is not None and returned.traceparent().split("-")[1] == TRACE
    with pytest.raises(InferError):
        asyncio.run(observe.infer(_Core(fail=True), req, ctx))  # type: ignore[arg-type]
    assert tracing.force_flush(5)
    ok, failed = spans.get_finished_spans()
    assert ok.name == "gateway.request" and ok.parent is not None and f"{ok.parent.span_id:016x}" == PARENT
    assert ok.attributes is not None and ok.attributes["meshserve.request_id"] == "abc"
    assert ok.attributes["meshserve.model"] == "m" and ok.attributes["rpc.system"] == "http"
    assert not ok.status.is_ok or ok.status.status_code.name == "UNSET"
    assert failed.status.status_code.name == "ERROR"


def test_observe_skips_gateway_hop_requests_without_context(spans: InMemorySpanExporter) -> None:
    req = pb.ModelInferRequest(model_name="m")
    ctx = RequestContext("grpc", {tracing.HOP_HEADER: tracing.HOP_GATEWAY})
    for _ in range(20):
        assert asyncio.run(observe.infer(_Core(), req, ctx))[1] is None  # type: ignore[arg-type]
    assert tracing.force_flush(5)
    assert spans.get_finished_spans() == ()


def test_observe_unsampled_request_gets_no_span_and_its_errors_still_map(spans: InMemorySpanExporter) -> None:
    req = pb.ModelInferRequest(model_name="m", id="abc")
    ctx = RequestContext("grpc", {"traceparent": f"00-{TRACE}-{PARENT}-00"})  # the client did not sample it
    assert asyncio.run(observe.infer(_Core(), req, ctx))[1] is None  # type: ignore[arg-type]
    with pytest.raises(InferError) as caught:
        asyncio.run(observe.infer(_Core(fail=True), req, ctx))  # type: ignore[arg-type]
    assert caught.value.code.value == "INVALID_ARG" and "bad shape" in caught.value.message
    assert tracing.force_flush(5)
    assert spans.get_finished_spans() == ()


def test_observe_off_returns_no_trace_header() -> None:
    assert tracing.enabled is False
    ctx = RequestContext("grpc", {"traceparent": f"00-{TRACE}-{PARENT}-01"})
    result, returned = asyncio.run(observe.infer(_Core(), pb.ModelInferRequest(), ctx))  # type: ignore[arg-type]
    assert returned is None


def test_observe_prefers_the_parameter_context_to_the_header(spans: InMemorySpanExporter) -> None:
    """A traceparent request parameter (the gateway -> service hop) wins over a header; without
    one (or without any parameters) the header is the parent."""
    other = "1" * 16
    req = pb.ModelInferRequest(model_name="m", id="p")
    req.parameters["traceparent"].string_param = f"00-{TRACE}-{PARENT}-01"
    header = {"traceparent": f"00-{TRACE}-{other}-01"}
    _, by_param = asyncio.run(observe.infer(_Core(), req, RequestContext("grpc", header, raw=req.SerializeToString())))  # type: ignore[arg-type]
    plain = pb.ModelInferRequest(model_name="m", id="h")
    _, by_header = asyncio.run(observe.infer(_Core(), plain, RequestContext("grpc", header, raw=plain.SerializeToString())))  # type: ignore[arg-type]
    assert by_param is not None and by_param.parent_id == int(PARENT, 16)
    assert by_header is not None and by_header.parent_id == int(other, 16)


def test_emitted_spans_are_records_that_encode_like_spans() -> None:
    """Where the event-loop OTLP queue exports, emit_span queues a Record (no Span object); its
    bytes are those of the same span made the Span way, and the Ref it returns parents and links."""
    from meshserve.telemetry.otlp_encode import encode_span
    from meshserve.telemetry.otlp_loop import LoopExportQueue
    from meshserve.telemetry.spans import ERROR, INTERNAL, Span

    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_SAMPLER": "always_on"}
    with configured("service", env):
        queue = tracing._queue
        assert isinstance(queue, LoopExportQueue)
        try:
            assert tracing._on_record is not None
            parent = tracing.start_server_span("service.request", tracing.parent_context(f"00-{TRACE}-{PARENT}-01", "k=v"))
            assert parent is not None
            fixed = tracing.fixed_attributes(("meshserve.model", "m"))
            batch = tracing.emit_span("service.batch", parent, 100, 200, {"meshserve.batch.size": 3}, links=[parent],
                                      error="RuntimeError: boom", fixed=fixed)
            compute = tracing.emit_span("service.compute", batch, 150, 120, None, fixed=fixed)  # end before start
            assert not isinstance(batch, Span) and batch.trace_id == parent.trace_id
            got = [blob for _, blob in queue._spans]  # no running loop: encoded at once
            want_batch = Span("service.batch", parent.trace_id, batch.span_id, parent.span_id, False, INTERNAL, 100,
                              {"meshserve.batch.size": 3}, parent._scope, None, trace_state="k=v",
                              links=[(parent.trace_id, parent.span_id)], fixed=fixed)
            want_batch.set_error("RuntimeError: boom")
            want_batch.end(200)
            want_compute = Span("service.compute", parent.trace_id, compute.span_id, batch.span_id, False, INTERNAL,
                                150, None, parent._scope, None, trace_state="k=v", fixed=fixed)
            want_compute.end(120)
            assert want_batch.status_code == ERROR and want_compute.end_time == 150
            assert got == [encode_span(want_batch), encode_span(want_compute)]
        finally:
            queue._spans.clear()  # nothing to send to the dead endpoint
