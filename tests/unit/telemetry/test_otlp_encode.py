"""Our hand-written OTLP span encoding must produce the message the SDK's encoder produces."""
from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from meshserve.telemetry.otlp_encode import encode_spans


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []

    def export(self, spans):  # type: ignore[no-untyped-def]
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def _spans() -> list:
    keep = _Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": "t", "n": 3, "f": 0.5, "b": True,
                                                        "l": ["a", "b"]}))
    provider.add_span_processor(SimpleSpanProcessor(keep))
    tracer = provider.get_tracer("meshserve", "1.2.3")
    other = provider.get_tracer("other")  # a second instrumentation scope
    remote = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=True, trace_flags=TraceFlags(1),
                         trace_state=TraceState([("k", "v")]))
    with tracer.start_as_current_span("root", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
                                      kind=SpanKind.SERVER, attributes={"s": "ü", "i": -5, "big": 2**62, "d": 1.25,
                                                                        "t": True, "arr": [1, 2], "farr": [0.5]}) as root:
        root.add_event("ev", {"x": 1})
        root.set_status(Status(StatusCode.ERROR, "broke: ✓"))
        with tracer.start_as_current_span("child", kind=SpanKind.CLIENT):
            pass
        ctx = root.get_span_context()
    other.start_span("batch", links=[Link(ctx, {"why": "member"}), Link(remote)], kind=SpanKind.INTERNAL,
                     start_time=time.time_ns()).end()
    tracer.start_span("ok").end()
    s = tracer.start_span("okstatus")
    s.set_status(Status(StatusCode.OK))
    s.end()
    return keep.spans


def test_same_message_as_the_sdk_encoder() -> None:
    spans = _spans()
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    theirs = sdk_encode(spans)
    assert ours == theirs, f"ours:\n{ours}\nsdk:\n{theirs}"


def test_empty_batch() -> None:
    assert encode_spans([]) == b"" == sdk_encode([]).SerializeToString()
