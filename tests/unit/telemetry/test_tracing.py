"""tracing.py and observe.py without sockets: env switches, sampling, parameter injection."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.protocol.errors import InferError
from meshserve.server import observe
from meshserve.server.core import InferResult, RequestContext
from meshserve.server.process import OTLP_TRANSPORT
from meshserve.telemetry import tracing
from meshserve.telemetry.text_lines import ARG_MAX
from tests.support import eventually, eventually_async

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
    """tracing configured for one test; its state and flags as they were afterwards."""
    saved = {k: getattr(tracing, k) for k in ("enabled", "role", "request_span_name", "late_spans", "root_bound",
                                              "state")}
    assert tracing.configure("meshserve-test", role, env=env, exporters=exporters, transport=OTLP_TRANSPORT)
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


@pytest.mark.parametrize(("sent", "kept"), [
    ("k=v", "k=v"),
    (" a=1 , ,b=2 ", "a=1,b=2"),  # (empty members dropped)
    (",".join(f"k{i}=v" for i in range(32)), ",".join(f"k{i}=v" for i in range(32))),
    (",".join(f"k{i}=v" for i in range(33)), ""),  # W3C: at most 32 members
    (f"{'k' * 256}={'v' * 256}", f"{'k' * 256}={'v' * 256}"),
    (f"ok=1,{'k' * 257}=v", ""),  # a key past 256 characters
    (f"ok=1,k={'v' * 257}", ""),  # a value past 256
])
def test_a_tracestate_keeps_w3c_lengths(sent: str, kept: str) -> None:
    parent = tracing.parent_context(f"00-{TRACE}-{PARENT}-01", sent)
    assert parent is not None and parent.state == kept


def test_a_clients_strings_are_cut_in_spans(spans: InMemorySpanExporter) -> None:
    """The request id and an error's text (which may quote a client's input) in a span: at most
    text_lines.ARG_MAX characters, on every path a span is made (observe's SERVER span, an
    emitted span's error, a forwarded request's LateSpans)."""
    cut = ARG_MAX + len("...[1000000 more characters]")
    req = pb.ModelInferRequest(model_name="m", id="i" * 1_000_000)
    ctx = RequestContext("grpc", {"traceparent": f"00-{TRACE}-{PARENT}-01"})

    class _Quoting(_Core):
        async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
            raise InferError.invalid(f"unexpected inference input '{'n' * 1_000_000}'")

    with pytest.raises(InferError):
        asyncio.run(observe.infer(_Quoting(), req, ctx))  # type: ignore[arg-type]
    parent = tracing.start_server_span("p", tracing.parent_context(f"00-{TRACE}-{PARENT}-01"))
    assert parent is not None
    tracing.emit_span("x", parent, 1, 2, error="e" * 1_000_000)
    parent.end()
    late = tracing.LateSpans(f"00-{TRACE}-{PARENT}-01", 0, tracing.fixed_attributes(), "r" * 1_000_000)
    late._record(3, ValueError("v" * 1_000_000))
    assert tracing.force_flush(5)
    done = spans.get_finished_spans()
    assert len(done) == 4
    for span in done:
        assert len(span.status.description or "") <= cut, (span.name, len(span.status.description or ""))
        assert all(len(v) <= cut for v in (span.attributes or {}).values() if isinstance(v, str)), span.name
    assert sum("meshserve.request_id" in (s.attributes or {}) for s in done) == 2


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
    ctx = RequestContext("grpc", {hop.HEADER: hop.VERIFIED})
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
        queue = tracing.state.queue
        assert isinstance(queue, LoopExportQueue)
        try:
            assert tracing.state.on_record is not None
            parent = tracing.start_server_span("service.request", tracing.parent_context(f"00-{TRACE}-{PARENT}-01", "k=v"))
            assert parent is not None
            fixed = tracing.fixed_attributes(("meshserve.model", "m"))
            batch = tracing.emit_span("service.batch", parent, 100, 200, {"meshserve.batch.size": 3}, links=[parent],
                                      error="RuntimeError: boom", fixed=fixed)
            compute = tracing.emit_span("service.compute", batch, 150, 120, None, fixed=fixed)  # end before start
            assert not isinstance(batch, Span) and batch.trace_id == parent.trace_id
            got = queue.queued()  # no running loop: encoded at once
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
            queue.discard()  # nothing to send to the dead endpoint


@pytest.fixture
def service_spans() -> Iterator[InMemorySpanExporter]:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_always_off",
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    exporter = InMemorySpanExporter()
    with configured("service", env, [exporter]):
        yield exporter


class _SpyCore(_Core):
    """Keeps what the model layer would see of the request's spans (the batch's parents)."""

    seen: list[Any]

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        self.seen = list(tracing.request_spans())
        return await super().infer(request, ctx)


def _served(core: _Core, req: pb.ModelInferRequest, ctx: RequestContext, exported: InMemorySpanExporter,
            spans: int) -> Any:
    """``observe.infer`` on a loop that lives until the request's ``spans`` late spans reached the exporter."""
    want = len(exported.get_finished_spans()) + spans

    async def main() -> Any:
        try:
            return await observe.infer(core, req, ctx)  # type: ignore[arg-type]
        finally:  # the spans are recorded a moment after the request ends, on this loop
            await eventually_async(lambda: len(exported.get_finished_spans()) >= want, what=f"{spans} spans")
    return asyncio.run(main())


def test_requests_the_gateway_forwarded_get_their_server_spans_late(service_spans: InMemorySpanExporter) -> None:
    """A merged request: a SERVER span per traced member (parent: that member's upstream span,
    sampled by the parent's flag), recorded after the request ends, with the ids the batch's
    spans were given while it ran; a request sent alone gets one, with its request id."""
    other_trace, other_parent = "1" * 32, "2" * 16
    merged = pb.ModelInferRequest(model_name="m", model_version="1")
    merged.parameters[hop.MERGED].int64_param = 4
    merged.parameters[hop.TRACEPARENTS].string_param = "\n".join([
        f"00-{TRACE}-{PARENT}-01", "", f"00-{other_trace}-{other_parent}-01\tk=v", f"00-{TRACE}-{'3' * 16}-00"])
    marker = {hop.HEADER: hop.VERIFIED}
    core = _SpyCore()
    result, echoed = _served(core, merged, RequestContext("grpc", marker), service_spans, 2)
    assert echoed is None  # nothing to echo on the gateway's stream
    assert [(f"{r.trace_id:032x}", r.trace_state) for r in core.seen] == [(TRACE, ""), (other_trace, "k=v")]
    alone = pb.ModelInferRequest(model_name="m", model_version="1", id="solo")
    alone.parameters["traceparent"].string_param = f"00-{other_trace}-{PARENT}-01"
    with pytest.raises(InferError):
        _served(_Core(fail=True), alone, RequestContext("grpc", marker), service_spans, 1)
    tracing.force_flush(5)
    eventually(lambda: len(service_spans.get_finished_spans()) >= 3)  # the exporter thread's batch delay
    got = {(f"{s.context.trace_id:032x}", f"{s.parent.span_id:016x}"): s for s in service_spans.get_finished_spans()}
    assert set(got) == {(TRACE, PARENT), (other_trace, other_parent), (other_trace, PARENT)}
    for ref in core.seen:  # the ids the batch's spans would hang off are the spans' own
        assert any(s.context.span_id == ref.span_id for s in got.values())
    first, third, failed = got[(TRACE, PARENT)], got[(other_trace, other_parent)], got[(other_trace, PARENT)]
    for s in (first, third, failed):
        assert s.name == "service.request" and s.kind.name == "SERVER" and s.parent.is_remote
        assert s.attributes["meshserve.model"] == "m" and s.attributes["rpc.system"] == "grpc"
        assert s.start_time <= s.end_time
    assert first.attributes["meshserve.member"] == 0 and first.attributes["meshserve.merged_requests"] == 4
    assert third.attributes["meshserve.member"] == 2 and third.context.trace_state.to_header() == "k=v"
    assert first.status.status_code.name == "UNSET"
    assert failed.attributes["meshserve.request_id"] == "solo" and "meshserve.member" not in failed.attributes
    assert failed.status.status_code.name == "ERROR" and "bad shape" in failed.status.description
    assert failed.attributes["meshserve.error_code"] == "INVALID_ARG"


def test_late_server_spans_encode_like_spans_and_wait_for_the_deferred_pass() -> None:
    """Where the event-loop OTLP queue exports, a late SERVER span is a Record recorded by a job
    that runs with the queue's next encoding pass; its bytes are those of the same Span."""
    from meshserve.telemetry.otlp_encode import encode_span
    from meshserve.telemetry.otlp_loop import LoopExportQueue
    from meshserve.telemetry.spans import SERVER, Span

    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    with configured("service", env):
        queue = tracing.state.queue
        assert isinstance(queue, LoopExportQueue)
        fixed = tracing.fixed_attributes(("meshserve.model", "m"))

        async def main() -> tuple[tracing.LateSpans, int]:
            tracing.emit_span("warm-up", tracing.Ref(1, 1, 1, ""), 1, 2)  # binds the queue to this loop
            await eventually_async(lambda: len(queue.queued()) == 1, what="the warm-up span encoded")
            late = tracing.LateSpans(f"00-{TRACE}-{PARENT}-01\tk=v", 0, fixed, "r9")
            late.finish(InferError.invalid("bad shape"))
            waiting = queue.deferred_jobs()
            await eventually_async(lambda: not queue.deferred_jobs() and len(queue.queued()) == 2,
                                   what="the deferred pass")
            return late, waiting

        try:
            late, waiting = asyncio.run(main())
            assert waiting == 1 and not queue.deferred_jobs() and len(queue.queued()) == 2  # the warm-up span and this one
            late._record(late.start_ns + 5, InferError.invalid("bad shape"))  # no loop now: encoded at once
            ((_, _, ref),) = late.members()
            want = Span("service.request", ref.trace_id, ref.span_id, int(PARENT, 16), True, SERVER, late.start_ns,
                        {"meshserve.request_id": "r9", "meshserve.error_code": "INVALID_ARG"}, queue_scope(),
                        None, trace_state="k=v", fixed=fixed)
            want.set_error("INVALID_ARG: bad shape")
            want.end(late.start_ns + 5)
            queued = queue.queued()
            assert queued[2] == encode_span(want)
            assert len(queued[1]) == len(queued[2])  # the deferred one: same span, its own end
        finally:
            queue.discard()  # nothing to send to the dead endpoint


def queue_scope() -> Any:
    assert tracing.state.scope is not None
    return tracing.state.scope


def test_a_span_recorded_late_keeps_the_id_its_traceparent_carried(spans: InMemorySpanExporter) -> None:
    """The gateway draws an upstream span's id before the call (its traceparent goes upstream)
    and records the CLIENT span after it, failed calls with the error's status and code."""
    from meshserve.telemetry.spans import CLIENT

    parent = tracing.start_server_span("gateway.request", tracing.parent_context(f"00-{TRACE}-{PARENT}-01"))
    assert parent is not None
    upstream = tracing.Ref(parent.trace_id, 0x1234, parent.flags, parent.trace_state)
    assert upstream.traceparent() == f"00-{TRACE}-{0x1234:016x}-01"
    description, code = tracing.error_fields(InferError.unavailable("replica gone"))
    tracing.emit_span("gateway.upstream", parent, 100, 200, {"meshserve.error_code": code}, error=description,
                      kind=CLIENT, span_id=upstream.span_id)
    parent.end()
    tracing.force_flush(5)
    upstream_spans = eventually(  # the exporter thread's batch delay
        lambda: [s for s in spans.get_finished_spans() if s.name == "gateway.upstream"])
    (got,) = upstream_spans
    assert got.context.span_id == 0x1234 and got.parent.span_id == parent.span_id and got.kind.name == "CLIENT"
    assert got.status.status_code.name == "ERROR" and got.status.description == "UNAVAILABLE: replica gone"
    assert got.attributes["meshserve.error_code"] == "UNAVAILABLE"


def test_a_streamed_request_has_one_span_ended_after_its_last_response(spans: InMemorySpanExporter) -> None:
    from tests.integration.decoupled_service import DecoupledCore
    from tests.unit.server.test_decoupled_frontends import one_int

    async def run(model: str) -> list[bool]:
        ctx = RequestContext("grpc", {"traceparent": f"00-{TRACE}-{PARENT}-01"})
        finals = []
        async for _, final in observe.infer_stream(DecoupledCore(), one_int(model, "s1", 3), ctx):  # type: ignore[arg-type]
            assert tracing.current_span() is not None  # the request's span is current while it streams
            finals.append(final)
        return finals

    assert asyncio.run(run("square_int32")) == [False, False, False, True]
    with pytest.raises(InferError):
        asyncio.run(run("faulty_stream"))
    assert tracing.force_flush(5)
    ok, failed = spans.get_finished_spans()
    assert ok.attributes is not None and ok.attributes["meshserve.request_id"] == "s1"
    assert ok.parent is not None and f"{ok.parent.span_id:016x}" == PARENT
    assert failed.status.status_code.name == "ERROR"
