"""OpenTelemetry tracing, configured from the standard ``OTEL_*`` environment variables.

Off unless an exporter is configured (``OTEL_TRACES_EXPORTER=otlp|console``, or an
``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turn it off. While off, ``enabled`` is False and callers skip
every tracing call (one attribute check per request), and the SDK is never imported.

Spans are meshserve's own light records (spans.py), sampled by the ``OTEL_TRACES_SAMPLER``
rules and exported in batches (``OTEL_BSP_*``): to a plaintext OTLP/gRPC endpoint from the
event loop itself (otlp_loop.py; ``MESHSERVE_OTLP_EXPORTER=sdk`` opts out), otherwise by a
thread through the SDK's exporters (TLS, compression, OTLP/HTTP, console); the current span
lives in a ContextVar, so asyncio tasks started under a span inherit it. Resource attributes
come from the SDK's ``Resource.create`` (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``).

Context travels as W3C ``traceparent``/``tracestate``: HTTP headers and gRPC metadata from
clients, and request *parameters* (``string_param``) on the gateway -> service hop, whose
long-lived streams cannot carry per-request metadata. Only sampled requests get the
parameters; the gateway marks its streams (meshserve.protocol.hop.METADATA) so a service does not
start a fresh root trace for the gateway's unsampled requests.
"""
from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from meshserve.protocol import wire
from meshserve.telemetry import trace_settings
from meshserve.telemetry.spans import (
    DEFER_S,
    ERROR,
    INTERNAL,
    SERVER,
    UNSET,
    Attrs,
    ExportQueue,
    Record,
    Ref,
    Sampler,
    Scope,
    Span,
)
from meshserve.telemetry.text_lines import clip

if TYPE_CHECKING:
    from meshserve.telemetry.otlp_loop import LoopExportQueue, Transport

log = logging.getLogger("meshserve.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

enabled = False  # read on the hot path: `if tracing.enabled:`
role = "service"  # "gateway" | "service": prefixes span names
root_bound = 0  # state.sampler.root_bound: a root is sampled when the low 64 bits of its trace id are below
request_span_name = "service.request"  # role + ".request": every request's SERVER span
# a service's request spans parent only its batches' spans, so those of requests the gateway
# forwarded can be recorded late (LateSpans); a gateway's parent the spans it makes as it goes
late_spans = True


@dataclass(slots=True)
class TracingState:
    """What ``configure`` set up to sample and export spans: one object (a fresh one per
    ``configure``), so a test can read the queue its spans went to and put back the state
    it found. The hot-path flags above stay module attributes (``tracing.enabled``)."""

    sampler: Sampler | None = None
    queue: ExportQueue | LoopExportQueue | None = None
    scope: Scope | None = None
    encoded: bool = False  # spans are encoded by meshserve as they end: shared Attrs stay apart from a span's own
    # where the event-loop OTLP queue exports, emit_span hands it a Record (no Span object) here
    on_record: Callable[[Record], None] | None = None


state = TracingState()
# the current sampled span; hot paths that already checked `enabled` read it as `tracing.current_var.get()`
current_var: contextvars.ContextVar[Span | None] = contextvars.ContextVar("meshserve_span", default=None)
# the request being served is one the gateway forwarded: its SERVER span(s) are recorded late
_late: contextvars.ContextVar[LateSpans | None] = contextvars.ContextVar("meshserve_late_spans", default=None)

random_bits = random.getrandbits  # trace and span ids: random bits, never 0


class Remote(NamedTuple):
    """A parent span in another process, from a W3C traceparent (+ tracestate)."""

    trace_id: int
    span_id: int
    flags: int
    state: str


def exporter_configured(env: Mapping[str, str] = os.environ) -> bool:
    """True when the environment asks for spans to be exported somewhere."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return any(e.strip() not in ("", "none") for e in exporters.split(","))
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(service_name: str, process_role: str, env: Mapping[str, str] = os.environ,
              exporters: Sequence[Any] | None = None, transport: Transport | None = None) -> bool:
    """Set up tracing for this process if the environment configures an exporter.

    ``service_name`` (e.g. ``meshserve-gateway``) applies unless OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES names the service. ``exporters`` replaces the ones the
    environment names (tests). ``transport`` is the gRPC client that exports plaintext
    OTLP/gRPC from the event loop (``meshserve.server.process.configure_tracing`` gives
    meshserve's own); without one, the SDK's exporter sends. Returns whether tracing is on.
    """
    global enabled, role, request_span_name, late_spans, root_bound, state
    role = process_role
    trace_settings.active = None  # the OTEL_* sampler rules until a trace/setting update
    request_span_name = f"{process_role}.request"
    late_spans = process_role == "service"
    if not exporter_configured(env):
        enabled = False
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from meshserve.telemetry import otlp_loop
    from meshserve.telemetry.otlp_encode import encode_encoded, encode_record, encode_span

    attrs: dict[str, str] = {}
    if not env.get("OTEL_SERVICE_NAME") and "service.name=" not in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs["service.name"] = service_name
    resource = Resource.create(attrs)
    names = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",") if e.strip()]
    if state.queue is not None:
        state.queue.shutdown()
    else:
        atexit.register(shutdown)
    queue: ExportQueue | LoopExportQueue
    target = None
    if exporters is None and transport is not None and names == ["otlp"] and _otlp_protocol(env) == "grpc" \
            and env.get("MESHSERVE_OTLP_EXPORTER", "loop").strip().lower() != "sdk":
        target = otlp_loop.target_from_env(env)
    if target is not None and transport is not None:  # plaintext OTLP/gRPC: from the event loop, no exporter thread
        queue = otlp_loop.LoopExportQueue(target, env, encode_span, encode_encoded, encode_record, transport)
        described = [f"otlp/grpc {target.endpoint} (event loop)"]
    else:
        chosen = list(exporters) if exporters is not None else _exporters(names, env)
        fast = bool(chosen) and all(getattr(e, "meshserve_encoded", False) for e in chosen)
        queue = ExportQueue(chosen, env, encode=encode_span if fast else None)
        described = [type(e).__name__ for e in chosen]
    sampler = Sampler.from_env(env)
    state = TracingState(sampler, queue, Scope(resource, InstrumentationScope("meshserve")), queue.encode is not None,
                         queue.on_record if isinstance(queue, otlp_loop.LoopExportQueue) else None)
    root_bound = sampler.root_bound
    enabled = True
    log.info("tracing on: service %s, exporters %s, sampler %s", resource.attributes.get("service.name"),
             described, sampler.description())
    return True


def _otlp_protocol(env: Mapping[str, str]) -> str:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    return "http" if protocol.strip().lower().startswith("http") else "grpc"


def _exporters(names: list[str], env: Mapping[str, str]) -> list[Any]:
    out: list[Any] = []
    for name in names:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())  # its formatter calls Span.to_json()
        elif name == "otlp":
            if _otlp_protocol(env) == "http":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpExporter,
                )
                out.append(HttpExporter())  # reads our spans through their SDK-shaped properties
            else:
                out.append(_fast_grpc_exporter())
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", name)
    return out


def _fast_grpc_exporter() -> Any:
    """The SDK's OTLP/gRPC exporter (endpoint, TLS, headers, retries from OTEL_*) with our
    byte-level span encoder instead of its per-field protobuf building (~5x cheaper per span)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from meshserve.telemetry.otlp_encode import encode_spans

    class FastOTLPSpanExporter(OTLPSpanExporter):
        meshserve_encoded = True  # spans may arrive already encoded (ExportQueue.encode)

        def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
            return ExportTraceServiceRequest.FromString(encode_spans(data))

    return FastOTLPSpanExporter()


def shutdown() -> None:
    """Flush and stop the exporters (also runs at interpreter exit)."""
    global enabled
    enabled = False
    if state.queue is not None:
        state.queue.shutdown()
        state.queue = None


def force_flush(timeout_s: float = 30.0) -> bool:
    return state.queue.force_flush(timeout_s) if state.queue is not None else True


def trace_setting(model: str = "", changes: Mapping[str, Sequence[str] | None] | None = None
                  ) -> dict[str, list[str]]:
    """Triton's trace extension: this process's settings for ``model`` ("" for the global ones)
    after applying ``changes`` (none: a read); raises trace_settings.SettingError."""
    settings = _settings()
    if changes:
        settings.update(model, changes)
        trace_settings.active = settings  # from now on root sampling follows the settings
    return settings.effective(model)


def _settings() -> trace_settings.TraceSettings:
    """The settings in force, or those the OTEL_* sampler amounts to before the first update."""
    settings = trace_settings.active
    if settings is None:
        sampler = state.sampler
        ratio = None if sampler is None or sampler.root == "on" else \
            0.0 if sampler.root == "off" else float(sampler.root)
        settings = trace_settings.TraceSettings(enabled, ratio)
    return settings


def trace_settings_state() -> dict[str, Any]:
    """This process's trace settings as JSON (a gateway worker shares them with its siblings)."""
    return _settings().state()


def restore_trace_settings(value: dict[str, Any]) -> None:
    """Put settings that ``trace_settings_state`` wrote (another worker's) in force here."""
    settings = _settings()
    settings.restore(value)
    trace_settings.active = settings


# ---- context propagation ---------------------------------------------------------------
def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) from a W3C traceparent, None if malformed."""
    if len(value) == 55 and value[:3] == "00-" and value[35] == "-" and value[52] == "-":  # the usual form
        try:
            trace_id, span_id, flags = int(value[3:35], 16), int(value[36:52], 16), int(value[53:], 16)
        except ValueError:
            return None
        return (trace_id, span_id, flags) if trace_id > 0 and span_id > 0 and flags >= 0 else None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    if parts[0] == "00" and len(parts) != 4:
        return None
    try:
        int(parts[0], 16)
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id or len(parts[3]) < 2:
        return None
    return trace_id, span_id, flags


# W3C Trace Context: a tracestate member's key is at most 256 characters, its value at most 256.
# A client's header is copied into every span of its request and onto the hop, so a header of
# longer members (up to a header list: 64 KiB) is dropped as the spec lets a vendor drop an
# invalid one, and what is kept is at most 32 members of 513 characters.
STATE_KEY_MAX = 256
STATE_VALUE_MAX = 256


def _clean_state(value: str | None) -> str:
    """A tracestate header as list members (W3C: at most 32, empty members dropped, a key and a
    value of at most 256 characters each); "" when it breaks those rules."""
    if not value:
        return ""
    members = [m.strip() for m in value.split(",") if "=" in m]
    if len(members) > 32 or not all(members):
        return ""
    for m in members:
        key, _, v = m.partition("=")
        if len(key) > STATE_KEY_MAX or len(v) > STATE_VALUE_MAX:
            return ""
    return ",".join(members)


def parent_context(traceparent: str | None, tracestate: str | None = None) -> Remote | None:
    """The remote parent a traceparent names, or None: no/invalid traceparent."""
    if not traceparent:
        return None
    parsed = parse_traceparent(traceparent)
    if parsed is None:
        return None
    return Remote(parsed[0], parsed[1], parsed[2], _clean_state(tracestate))


def start_server_span(name: str, parent: Remote | None, fixed: Attrs | None = None, low: int | None = None
                      ) -> Span | None:
    """A sampled SERVER span, or None when the sampler drops the request. For a root, ``low``
    may be the low 64 bits of its trace id, drawn (``random_bits(64)``) and judged against
    the bound in force by a caller that wanted to know before calling (and then is not judged again)."""
    sampler, scope, queue = state.sampler, state.scope, state.queue
    assert sampler is not None and scope is not None and queue is not None, "tracing.configure() not run"
    if parent is None:
        # a root: the sampler judges the low 64 bits of the trace id (TraceIdRatioBased), so
        # they are drawn first and an unsampled request costs one draw and one comparison
        if low is None:
            low = random_bits(64)
            if low >= root_bound:
                return None
        tid = (random_bits(64) << 64 | low) or 1
        parent_id, remote, flags, trace_state = 0, False, 1, ""
    else:
        if not sampler.sample(parent.trace_id, parent.flags):
            return None
        tid, parent_id, remote, flags, trace_state = parent.trace_id, parent.span_id, True, \
            (parent.flags & 0xFF) | 1, parent.state
    attributes, fixed = _unshared(None, fixed)
    return Span(name, tid, random_bits(64) or 1, parent_id, remote, SERVER, time.time_ns(), attributes, scope,
                queue.on_end, flags=flags, trace_state=trace_state, fixed=fixed)


def _unshared(attributes: dict[str, Any] | None, fixed: Attrs | None) -> tuple[dict[str, Any] | None, Attrs | None]:
    """(attributes, fixed) as the span keeps them: apart where meshserve encodes the spans,
    folded into one dict where SDK exporters read them."""
    if fixed is None or state.encoded:
        return attributes, fixed
    return ({**fixed.items, **attributes} if attributes else dict(fixed.items)), None


def share(span: Span, fixed: Attrs) -> None:
    """Give a span (that has none yet) the shared attribute set ``fixed``, as ``start_span``'s
    ``fixed`` does: for spans whose sampling is decided before their attributes are known."""
    attributes, span.fixed = _unshared(span.attributes, fixed)
    span.attributes = attributes if attributes is not None else {}


@functools.lru_cache(maxsize=1024)
def fixed_attributes(*pairs: tuple[str, Any]) -> Attrs:
    """The shared attribute set of ``(key, value)`` pairs (one object per distinct set, so its
    OTLP encoding is made once); pass it as ``fixed`` to the span functions."""
    return Attrs(dict(pairs))


def start_span(name: str, parent: Span | Ref, kind: int = INTERNAL, attributes: dict[str, Any] | None = None,
               start_ns: int | None = None, links: Sequence[Span | Ref] = (), fixed: Attrs | None = None,
               span_id: int = 0, remote_parent: bool = False) -> Span:
    """A child of ``parent`` (a sampled span of this process, or one in another process:
    ``remote_parent``); its attributes are ``fixed``'s and then ``attributes`` (the two must
    not share keys). ``span_id``: one drawn before (0: draw)."""
    scope, queue = state.scope, state.queue
    assert queue is not None and scope is not None
    attributes, fixed = _unshared(attributes, fixed)
    return Span(name, parent.trace_id, span_id or random_bits(64) or 1, parent.span_id, remote_parent, kind,
                time.time_ns() if start_ns is None else start_ns, attributes, scope, queue.on_end,
                flags=parent.flags, trace_state=parent.trace_state,
                links=[(s.trace_id, s.span_id) for s in links] if links else None, fixed=fixed)


def activate(span: Span) -> contextvars.Token[Span | None]:
    """Make ``span`` current (asyncio tasks started under it inherit it); returns a token."""
    return current_var.set(span)


def deactivate(token: contextvars.Token[Span | None]) -> None:
    current_var.reset(token)


def end(span: Span) -> None:
    span.end(time.time_ns())


def traceparent(span: Span) -> str:
    return span.traceparent()


def trace_id(span: Span | None) -> str:
    return span.trace_id.to_bytes(16, "big").hex() if span is not None else ""


def current_span() -> Span | None:
    """The current span if the request is sampled, else None."""
    return current_var.get() if enabled else None


def request_spans() -> tuple[Span, ...] | LateSpans:
    """The sampled spans of the request being served, to parent and link its batch's spans:
    its own, or the LateSpans of a request the gateway forwarded (empty when nothing is sampled)."""
    if not enabled:
        return ()
    late = _late.get()
    if late is not None:
        return late
    span = current_var.get()
    return (span,) if span is not None else ()


def activate_late(late: LateSpans) -> contextvars.Token[LateSpans | None]:
    return _late.set(late)


def deactivate_late(token: contextvars.Token[LateSpans | None]) -> None:
    _late.reset(token)


class LateSpans:
    """The SERVER span(s) of a request the gateway forwarded with its context in request
    parameters: one per traced member of a merged request (``merged`` > 0), or the one of a
    request sent alone. They are recorded after the fact (``finish``), in the deferred pass
    that encodes ended spans: the request path pays for this small object only, and the
    contexts are parsed and the span ids drawn when first needed (iterating gives the spans as
    ``Ref``s, to parent and link a batch's spans) or when the request's end is recorded."""

    __slots__ = ("lines", "merged", "fixed", "request_id", "start_ns", "_members")

    def __init__(self, lines: str, merged: int, fixed: Attrs, request_id: str = ""):
        self.lines = lines  # traceparent[\ttracestate] per member, "\n"-separated; "" for an untraced one
        self.merged = merged  # members of a merged request; 0: a request sent alone
        self.fixed = fixed
        self.request_id = clip(request_id)
        self.start_ns = time.time_ns()
        self._members: list[tuple[int, Remote, Ref]] | None = None

    def members(self) -> list[tuple[int, Remote, Ref]]:
        """(member index, remote parent, this process's span) per sampled member."""
        if self._members is None:
            sampler = state.sampler
            assert sampler is not None
            out = []
            for i, parent in enumerate(parse_member_lines(self.lines, max(1, self.merged))):
                if parent is not None and sampler.sample(parent.trace_id, parent.flags):
                    out.append((i, parent, Ref(parent.trace_id, random_bits(64) or 1, (parent.flags & 0xFF) | 1,
                                               parent.state)))
            self._members = out
        return self._members

    def __iter__(self) -> Iterator[Ref]:
        return iter([ref for _, _, ref in self.members()])

    def trace_id(self) -> str:
        """The first sampled member's trace id as hex (log lines), "" when none is sampled."""
        members = self.members()
        return members[0][2].trace_id.to_bytes(16, "big").hex() if members else ""

    def finish(self, error: BaseException | None = None) -> None:
        """The request has ended (``error``: how it failed): its spans are recorded soon."""
        end_ns = time.time_ns()
        try:
            defer(self._record, end_ns, error)
        except RuntimeError:  # no running loop (a request served outside asyncio): record now
            self._record(end_ns, error)

    def _record(self, end_ns: int, error: BaseException | None) -> None:
        description, code = error_fields(error) if error is not None else (None, None)
        for i, parent, ref in self.members():
            attributes: dict[str, Any] = {"meshserve.merged_requests": self.merged, "meshserve.member": i} \
                if self.merged else ({"meshserve.request_id": self.request_id} if self.request_id else {})
            if code is not None:
                attributes["meshserve.error_code"] = code
            # the remote parent, in the trace as this process continues it (sampled flag, tracestate)
            remote = Ref(parent.trace_id, parent.span_id, ref.flags, ref.trace_state)
            emit_span(request_span_name, remote, self.start_ns, end_ns, attributes, error=description,
                      fixed=self.fixed, kind=SERVER, span_id=ref.span_id, remote_parent=True)


def member_line(span: Span | Ref) -> str:
    """One member's entry in the merged-request TRACEPARENTS parameter."""
    return f"{span.traceparent()}\t{span.trace_state}" if span.trace_state else span.traceparent()


def parse_member_lines(value: str, members: int) -> list[Remote | None]:
    """The TRACEPARENTS parameter of a merged request of ``members`` requests: a remote parent
    per member (None: that member is not traced or its entry is malformed)."""
    out: list[Remote | None] = []
    for line in value.split("\n")[:members]:
        tp, _, ts = line.partition("\t")
        out.append(parent_context(tp, ts) if tp else None)
    return out


def inject_parameters(raw_request: bytes, span: Span | Ref) -> bytes:
    """A serialized ModelInferRequest with traceparent/tracestate parameters appended (map: last wins)."""
    out = wire.with_string_parameter(raw_request, TRACEPARENT, span.traceparent())
    if span.trace_state:
        out = wire.with_string_parameter(out, TRACESTATE, span.trace_state)
    return out


# ---- spans -----------------------------------------------------------------------------
@contextmanager
def child_span(name: str, attributes: dict[str, Any]) -> Iterator[Span | None]:
    """An INTERNAL span under the current sampled span, made current (tasks started inside
    inherit it); yields None, at the cost of one check, when the request is not sampled."""
    parent = current_span()
    if parent is None:
        yield None
        return
    span = start_span(name, parent, INTERNAL, attributes)
    token = current_var.set(span)
    try:
        yield span
    except BaseException as exc:
        set_error(span, exc)
        raise
    finally:
        current_var.reset(token)
        span.end(time.time_ns())


def error_fields(exc: BaseException) -> tuple[str, str | None]:
    """A failed span's status description and ``meshserve.error_code`` (None: the exception has no code)."""
    code = getattr(exc, "code", None)
    return f"{getattr(code, 'value', type(exc).__name__)}: {exc}", \
        (getattr(code, "value", str(code)) if code is not None else None)


def set_error(span: Span, exc: BaseException) -> None:
    description, code = error_fields(exc)
    span.set_error(description)
    if code is not None:
        span.set_attribute("meshserve.error_code", code)


def emit_span(name: str, parent: Span | Ref, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
              links: Sequence[Span | Ref] = (), error: str | None = None, fixed: Attrs | None = None,
              kind: int = INTERNAL, span_id: int = 0, remote_parent: bool = False) -> Span | Ref:
    """A span recorded after the fact (explicit epoch-ns times) under ``parent`` (``span_id``:
    one drawn before, 0: draw; ``remote_parent``: the parent is in another process). Where the
    event-loop OTLP queue exports, it is queued as a Record and no Span object is made: the
    returned Ref can parent further spans and be linked to."""
    on_record = state.on_record
    if on_record is not None:
        span_id = span_id or random_bits(64) or 1
        assert state.scope is not None
        on_record((state.scope, (parent.trace_id, span_id, parent.trace_state, parent.span_id, name, kind,
                                   start_ns, end_ns if end_ns > start_ns else start_ns, fixed, attributes,
                                   [(s.trace_id, s.span_id) for s in links] if links else None,
                                   ERROR if error is not None else UNSET, clip(error) if error else "",
                                   remote_parent)))
        return Ref(parent.trace_id, span_id, parent.flags, parent.trace_state)
    span = start_span(name, parent, kind, attributes, start_ns, links, fixed, span_id, remote_parent)
    if error is not None:
        span.set_error(error)
    span.end(end_ns)
    return span


def defer(job: Callable[..., None], *args: Any) -> None:
    """Run ``job(*args)`` on the running loop soon (``DEFER_S``), after the responses being
    written now: for spans recorded after the fact, which clients do not wait for. Where the
    event-loop OTLP queue exports, it runs with that queue's encoding pass (no timer of its own)."""
    if state.on_record is not None:
        state.queue.defer(job, *args)  # type: ignore[union-attr]  # on_record set: a LoopExportQueue
    else:
        asyncio.get_running_loop().call_later(DEFER_S, job, *args)


def epoch_offset_ns() -> int:
    """Add to a time.monotonic_ns() reading to get epoch ns (span timestamps)."""
    return time.time_ns() - time.monotonic_ns()
