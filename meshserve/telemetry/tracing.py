"""OpenTelemetry tracing, configured from the standard ``OTEL_*`` environment variables.

Off unless an exporter is configured (``OTEL_TRACES_EXPORTER=otlp|console``, or an
``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turn it off. While off, ``enabled`` is False and callers skip
every tracing call (one attribute check per request), and the SDK is never imported.

Context travels as W3C ``traceparent``/``tracestate``: HTTP headers and gRPC metadata from
clients, and request *parameters* (``string_param``) on the gateway -> service hop, whose
long-lived streams cannot carry per-request metadata. Only sampled requests get the
parameters; the gateway marks its streams (``meshserve-hop: gateway``) so a service does not
start a fresh root trace for the gateway's unsampled requests.
"""
from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from meshserve.protocol import wire

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext, Tracer

log = logging.getLogger("meshserve.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
HOP_HEADER = "meshserve-hop"  # stream metadata the gateway sets on its upstream streams
HOP_GATEWAY = "gateway"

enabled = False  # read on the hot path: `if tracing.enabled:`
role = "service"  # "gateway" | "service": prefixes span names
_tracer: Tracer | None = None
_provider: Any = None
_sampler: Any = None
_ids: Any = None  # _PresetIdGenerator
_otel: Any = None  # (opentelemetry.context, opentelemetry.trace, SpanKind.SERVER), bound by configure()

_PARAMETERS_TAG = b"\x22"  # ModelInferRequest.parameters = 4 (map entry, length-delimited)


def exporter_configured(env: Mapping[str, str] = os.environ) -> bool:
    """True when the environment asks for spans to be exported somewhere."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return any(e.strip() not in ("", "none") for e in exporters.split(","))
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(service_name: str, process_role: str, env: Mapping[str, str] = os.environ) -> bool:
    """Set up the SDK for this process if the environment configures an exporter.

    ``service_name`` (e.g. ``meshserve-gateway``) applies unless OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES names the service. Returns whether tracing is on.
    """
    global enabled, role, _tracer, _provider
    role = process_role
    if not exporter_configured(env):
        enabled = False
        return False
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _PresetIdGenerator(RandomIdGenerator):
        """Hands out a trace id chosen before the span (see start_server_span); random otherwise."""

        preset = 0

        def generate_trace_id(self) -> int:
            tid, self.preset = self.preset, 0
            return tid or super().generate_trace_id()

    global _sampler, _ids, _otel
    attrs: dict[str, str] = {}
    if not env.get("OTEL_SERVICE_NAME") and "service.name=" not in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = service_name
    _ids = _PresetIdGenerator()
    provider = TracerProvider(sampler=_sampler_from(env), resource=Resource.create(attrs), id_generator=_ids)
    _sampler = provider.sampler
    _otel = (otel_context, otel_trace, otel_trace.SpanKind.SERVER)
    names = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",") if e.strip()]
    for name in names:
        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            if protocol.startswith("http"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpExporter,
                )
                exporter = HttpExporter()
            else:
                exporter = _fast_grpc_exporter()
        else:
            if name != "none":
                log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    _tracer = provider.get_tracer("meshserve")
    enabled = True
    log.info("tracing on: service %s, exporters %s, sampler %s", provider.resource.attributes.get("service.name"),
             names, provider.sampler.get_description())
    return True


def _fast_grpc_exporter() -> Any:
    """The SDK's OTLP/gRPC exporter (endpoint, TLS, headers, retries from OTEL_*) with our
    byte-level span encoder instead of its per-field protobuf building (~5x cheaper per span)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from meshserve.telemetry.otlp_encode import encode_spans

    class FastOTLPSpanExporter(OTLPSpanExporter):
        def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
            return ExportTraceServiceRequest.FromString(encode_spans(data))

    return FastOTLPSpanExporter()


def _sampler_from(env: Mapping[str, str]) -> Any:
    """OTEL_TRACES_SAMPLER[_ARG] as the SDK reads them (default parentbased_always_on)."""
    from opentelemetry.sdk.trace import sampling

    name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    try:
        ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
    except ValueError:
        ratio = 1.0
    roots = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF}
    base = name.removeprefix("parentbased_")
    root = roots.get(base) or (sampling.TraceIdRatioBased(ratio) if base == "traceidratio" else None)
    if root is None:
        log.warning("OTEL_TRACES_SAMPLER=%s is not supported; using parentbased_always_on", name)
        return sampling.ParentBased(sampling.ALWAYS_ON)
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


def shutdown() -> None:
    """Flush and stop the exporters (also runs at interpreter exit)."""
    global enabled
    if _provider is not None:
        enabled = False
        _provider.shutdown()


def tracer() -> Tracer:
    assert _tracer is not None, "tracing.configure() enabled no tracer"
    return _tracer


# ---- context propagation ---------------------------------------------------------------
def _parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) from a W3C traceparent, None if malformed."""
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, flags


def parent_context(traceparent: str | None, tracestate: str | None = None) -> tuple[Any, int]:
    """(OTel Context holding the remote parent, its trace id), or (None, 0): no/invalid traceparent."""
    if not traceparent:
        return None, 0
    parsed = _parse_traceparent(traceparent)
    if parsed is None:
        return None, 0
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    state = TraceState.from_header([tracestate]) if tracestate else None
    sc = SpanContext(parsed[0], parsed[1], is_remote=True, trace_flags=TraceFlags(parsed[2] & 1),
                     trace_state=state)
    return trace.set_span_in_context(NonRecordingSpan(sc)), parsed[0]


def start_server_span(name: str, parent: Any, parent_trace_id: int) -> Span | None:
    """A sampled SERVER span, or None when the sampler drops the request.

    The sampler is asked first, with a trace id chosen here, so a dropped request costs ~1 us
    instead of the SDK building a non-recording span (~9 us); a sampled root then gets that id.
    """
    tid = parent_trace_id or random.getrandbits(128)
    if not _sampler.should_sample(parent, tid, name, _otel[2]).decision.is_sampled():
        return None
    if not parent_trace_id:
        _ids.preset = tid
    return tracer().start_span(name, context=parent, kind=_otel[2])


def activate(span: Span) -> object:
    """Make ``span`` current (asyncio tasks started under it inherit it); returns a token."""
    return _otel[0].attach(_otel[1].set_span_in_context(span))


def deactivate(token: object) -> None:
    _otel[0].detach(token)


def traceparent(span: Span) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def trace_id(span: Span | None) -> str:
    if span is None:
        return ""
    sc = span.get_span_context()
    return f"{sc.trace_id:032x}" if sc.is_valid else ""


def current_span() -> Span | None:
    """The current span if it is being recorded (sampled), else None."""
    if not enabled:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None


def _string_param_entry(key: str, value: str) -> bytes:
    param = wire.length_delimited(b"\x1a", value.encode())  # InferParameter.string_param = 3
    entry = wire.length_delimited(b"\x0a", key.encode()) + wire.length_delimited(b"\x12", param)
    return wire.length_delimited(_PARAMETERS_TAG, entry)


def inject_parameters(raw_request: bytes, span: Span) -> bytes:
    """A serialized ModelInferRequest with traceparent/tracestate parameters appended (map: last wins)."""
    out = raw_request + _string_param_entry(TRACEPARENT, traceparent(span))
    state = span.get_span_context().trace_state
    if state:
        out += _string_param_entry(TRACESTATE, state.to_header())
    return out


# ---- spans -----------------------------------------------------------------------------
@contextmanager
def client_span(name: str, attributes: dict[str, Any]) -> Iterator[Span]:
    """A CLIENT span around one upstream call; an exception marks it failed."""
    from opentelemetry.trace import SpanKind

    with tracer().start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes,
                                        record_exception=False, set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            set_error(span, exc)
            raise


@contextmanager
def child_span(name: str, attributes: dict[str, Any]) -> Iterator[Span | None]:
    """An INTERNAL span under the current sampled span, made current (tasks started inside
    inherit it); yields None, at the cost of one check, when the request is not sampled."""
    if current_span() is None:
        yield None
        return
    with tracer().start_as_current_span(name, attributes=attributes, record_exception=False,
                                        set_status_on_exception=False) as span:
        try:
            yield span
        except BaseException as exc:
            set_error(span, exc)
            raise


def set_error(span: Span, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    code = getattr(exc, "code", None)
    span.set_status(Status(StatusCode.ERROR, f"{getattr(code, 'value', type(exc).__name__)}: {exc}"))
    if code is not None:
        span.set_attribute("meshserve.error_code", getattr(code, "value", str(code)))


def emit_span(name: str, parent: Span, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
              links: Sequence[SpanContext] = (), error: str | None = None) -> Span:
    """A span recorded after the fact (explicit epoch-ns times) under ``parent``."""
    from opentelemetry import trace
    from opentelemetry.trace import Link, Status, StatusCode

    span = tracer().start_span(name, context=trace.set_span_in_context(parent), attributes=attributes,
                               links=[Link(sc) for sc in links], start_time=start_ns)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=max(start_ns, end_ns))
    return span


def epoch_offset_ns() -> int:
    """Add to a time.monotonic_ns() reading to get epoch ns (span timestamps)."""
    return time.time_ns() - time.monotonic_ns()
