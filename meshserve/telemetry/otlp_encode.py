"""OTLP trace encoding by hand: SDK spans -> ExportTraceServiceRequest bytes.

The SDK's own encoder (opentelemetry-exporter-otlp-proto-common) builds a protobuf object per
span, attribute and link in Python: ~28 µs per span here, more than creating the span. This
writes the same message straight to bytes (~5 µs per span); tests compare the result field by
field with the SDK's encoder. Used by the OTLP/gRPC exporter (tracing.py).
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshserve.protocol.wire import varint

_F64 = struct.Struct("<Q")
_D = struct.Struct("<d")
_F32 = struct.Struct("<I")
HAS_IS_REMOTE = 0x100  # SpanFlags: the is_remote bit below is meaningful
IS_REMOTE = 0x200


def _ld(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2) of a small field number."""
    return bytes(((tag << 3) | 2,)) + varint(len(payload)) + payload


def _any_value(v: Any) -> bytes:
    if isinstance(v, str):
        return _ld(1, v.encode())
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")
    if isinstance(v, int):
        return b"\x18" + varint(v & 0xFFFFFFFFFFFFFFFF)
    if isinstance(v, float):
        return b"\x21" + _D.pack(v)
    if isinstance(v, bytes):
        return _ld(7, v)
    if isinstance(v, Sequence):
        return _ld(5, b"".join(_ld(1, _any_value(x)) for x in v))
    return _ld(1, str(v).encode())


def _attributes(tag: int, attrs: Mapping[str, Any] | None) -> bytes:
    if not attrs:
        return b""
    return b"".join(_ld(tag, _ld(1, k.encode()) + _ld(2, _any_value(v))) for k, v in attrs.items())


def _span(span: Any) -> bytes:
    ctx = span.context
    out = [_ld(1, ctx.trace_id.to_bytes(16, "big")), _ld(2, ctx.span_id.to_bytes(8, "big"))]
    if ctx.trace_state:
        out.append(_ld(3, ctx.trace_state.to_header().encode()))
    parent = span.parent
    if parent is not None:
        out.append(_ld(4, parent.span_id.to_bytes(8, "big")))
    out.append(_ld(5, span.name.encode()))
    out.append(b"\x30" + varint(span.kind.value + 1))  # proto SpanKind = SDK SpanKind + 1
    out.append(b"\x39" + _F64.pack(span.start_time or 0))
    out.append(b"\x41" + _F64.pack(span.end_time or 0))
    out.append(_attributes(9, span.attributes))
    if span.dropped_attributes:
        out.append(b"\x50" + varint(span.dropped_attributes))
    for ev in span.events:
        body = b"\x09" + _F64.pack(ev.timestamp) + _ld(2, ev.name.encode()) + _attributes(3, ev.attributes)
        if ev.dropped_attributes:
            body += b"\x20" + varint(ev.dropped_attributes)
        out.append(_ld(11, body))
    if span.dropped_events:
        out.append(b"\x60" + varint(span.dropped_events))
    for link in span.links:
        lc = link.context
        body = _ld(1, lc.trace_id.to_bytes(16, "big")) + _ld(2, lc.span_id.to_bytes(8, "big"))
        body += _attributes(4, link.attributes)
        if link.dropped_attributes:
            body += b"\x28" + varint(link.dropped_attributes)
        body += b"\x35" + _F32.pack(HAS_IS_REMOTE | (IS_REMOTE if lc.is_remote else 0))
        out.append(_ld(13, body))
    if span.dropped_links:
        out.append(b"\x70" + varint(span.dropped_links))
    status = span.status
    if status is not None:
        st = b""
        if status.description:
            st += _ld(2, status.description.encode())
        if status.status_code.value:
            st += b"\x18" + varint(status.status_code.value)
        out.append(_ld(15, st))
    flags = HAS_IS_REMOTE | (IS_REMOTE if parent is not None and parent.is_remote else 0)
    out.append(b"\x85\x01" + _F32.pack(flags))  # field 16, fixed32
    return b"".join(out)


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    body = _ld(1, scope.name.encode()) if scope.name else b""
    if scope.version:
        body += _ld(2, scope.version.encode())
    body += _attributes(3, getattr(scope, "attributes", None))
    return body


def encode_spans(spans: Iterable[Any]) -> bytes:
    """Serialized ExportTraceServiceRequest for finished SDK spans, grouped by resource and
    instrumentation scope as the SDK's encoder does."""
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        res_group = groups.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        res_group[1].setdefault(id(scope), (scope, []))[1].append(_span(span))
    out = []
    for resource, scopes in groups.values():
        rs = _ld(1, _attributes(1, resource.attributes))
        for scope, encoded in scopes.values():
            ss = _ld(1, _scope(scope)) + b"".join(_ld(2, s) for s in encoded)
            if scope is not None and scope.schema_url:
                ss += _ld(3, scope.schema_url.encode())
            rs += _ld(2, ss)
        if resource.schema_url:
            rs += _ld(3, resource.schema_url.encode())
        out.append(_ld(1, rs))
    return b"".join(out)
