"""Our hand-written OTLP span encoding must produce the message the SDK's encoder produces."""
from __future__ import annotations

import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from meshserve.telemetry import spans as sp
from meshserve.telemetry.otlp_encode import encode_span, encode_spans


def _spans() -> list[sp.Span]:
    ended: list[sp.Span] = []
    resource = Resource.create({"service.name": "t", "n": 3, "f": 0.5, "b": True, "l": ["a", "b"]})
    scope = sp.Scope(resource, InstrumentationScope("meshserve", "1.2.3"))
    other = sp.Scope(resource, InstrumentationScope("other"))  # a second instrumentation scope
    now = time.time_ns()
    root = sp.Span("root", 0x1234, 0xABC, 0x99, True, sp.SERVER, now,
                   {"s": "ü", "i": -5, "big": 2**62, "d": 1.25, "t": True, "arr": [1, 2], "farr": [0.5]},
                   scope, ended.append, flags=1, trace_state="k=v,x=y")
    root.set_error("broke: ✓")
    child = sp.Span("child", 0x1234, 0xDEF, 0xABC, False, sp.CLIENT, now + 5, None, scope, ended.append)
    child.end(now + 10)
    root.end(now + 20)
    sp.Span("batch", 0x1234, 0x77, 0xABC, False, sp.INTERNAL, now, {"meshserve.batch.size": 8}, other, ended.append,
            links=[(0x1234, 0xABC), (0x5678, 0x42)]).end(now + 3)
    sp.Span("ok", 0x9, 0x8, 0, False, sp.INTERNAL, now, None, scope, ended.append).end(now)
    okstatus = sp.Span("okstatus", 0x9, 0x7, 0, False, sp.INTERNAL, now, None, scope, ended.append)
    okstatus.status_code = sp.OK
    okstatus.end(now - 5)  # an end before the start is clamped to the start
    return ended


def test_same_message_as_the_sdk_encoder() -> None:
    spans = _spans()
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    theirs = sdk_encode(spans)
    assert ours == theirs, f"ours:\n{ours}\nsdk:\n{theirs}"


def test_encoded_at_end_is_the_same_message() -> None:
    spans = _spans()
    plain = encode_spans(spans)
    for span in spans:
        span.encoded = encode_span(span)
    assert encode_spans(spans) == plain


def test_empty_batch() -> None:
    assert encode_spans([]) == b"" == sdk_encode([]).SerializeToString()


def test_shared_attributes_encode_as_if_they_were_the_spans_own() -> None:
    """A span's ``fixed`` Attrs (encoded once, reused by every span that shares them) come out as
    the same KeyValues the SDK writes for one dict holding both sets."""
    ended: list[sp.Span] = []
    scope = sp.Scope(Resource.create({"service.name": "t"}), InstrumentationScope("meshserve"))
    shared = sp.Attrs({"meshserve.model": "add_sub", "meshserve.model_version": "", "n": 7})
    now = time.time_ns()
    for i, own in enumerate(({"meshserve.member": 1}, None, {"s": "x" * 200})):
        sp.Span(f"s{i}", 0x1234, 0x10 + i, 0xABC, True, sp.CLIENT, now, own, scope, ended.append,
                fixed=shared).end(now + 7)
    merged = [sp.Span(s.name, s.trace_id, s.span_id, s.parent_id, s.parent_remote, s._kind, s.start_time,
                      {**shared.items, **s.attributes}, scope, None) for s in ended]
    for m, s in zip(merged, ended, strict=True):
        m.end_time = s.end_time
    ours = ExportTraceServiceRequest.FromString(encode_spans(ended))
    assert shared.encoded is not None  # made for the first span, reused by the others
    assert ours == sdk_encode(merged), f"ours:\n{ours}\nsdk:\n{sdk_encode(merged)}"
    assert list(ours.resource_spans[0].scope_spans[0].spans[2].attributes)[-1].value.string_value == "x" * 200


def test_reused_int_entries_stay_apart_from_bools_and_other_values() -> None:
    """Int-valued entries are encoded once and reused: a bool or float equal to a cached int
    (True == 1 == 1.0 as dict keys) must still come out as a bool or a double."""
    ended: list[sp.Span] = []
    scope = sp.Scope(Resource.create({"service.name": "t"}), InstrumentationScope("meshserve"))
    now = time.time_ns()
    for i, own in enumerate(({"v": 1}, {"v": True}, {"v": 1.0}, {"v": 1}, {"v": 2}, {"v": 300})):
        sp.Span(f"s{i}", 0x1234, 0x10 + i, 0xABC, False, sp.INTERNAL, now, own, scope, ended.append).end(now + 1)
    ours = ExportTraceServiceRequest.FromString(encode_spans(ended))
    assert ours == sdk_encode(ended), f"ours:\n{ours}\nsdk:\n{sdk_encode(ended)}"
    values = [s.attributes[0].value for s in ours.resource_spans[0].scope_spans[0].spans]
    assert [v.WhichOneof("value") for v in values] == ["int_value", "bool_value", "double_value", "int_value",
                                                       "int_value", "int_value"]
