"""Spans without the SDK on the hot path: a slotted record, a sampler and an export queue.

The OpenTelemetry SDK's ``Tracer.start_span`` costs ~20 µs per span in this process (bounded
attribute dicts, value cleaning, ABC instance checks, a second sampler call, lock-taking
processors), so a sampled request with its seven spans spent more CPU on tracing than on the
inference. Here a span is a plain record (~2 µs to start and end); ended spans go on a
queue that a daemon thread hands in batches to ordinary SDK exporters. The record carries the
attributes the SDK's exporters read (``context``, ``parent``, ``kind``, ``status``, ``links``,
``resource``, ...) as properties built on demand, so any SDK exporter (OTLP/HTTP, console,
in-memory) accepts it; meshserve's own OTLP encoder reads the slots directly.

What the SDK would do and this does not: span limits (our spans carry a handful of
attributes; those a client's request fills, its id and an error's text, are cut at
``text_lines.ARG_MAX`` characters where they are set, and a ``tracestate`` keeps W3C's
lengths), events, and span processors other than the batching one (``OTEL_BSP_*`` are
honoured: schedule delay, queue size, batch size, export timeout).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from meshserve.telemetry.text_lines import clip

log = logging.getLogger("meshserve.tracing")

# Work that clients do not wait for waits this long, so the responses are written first: encoding
# ended spans (otlp_loop.py) and recording spans from the times a request or batch already took
# (tracing.defer: a batch's spans, a forwarded request's LateSpans, the gateway's upstream calls).
DEFER_S = 0.002
INTERNAL, SERVER, CLIENT = 0, 1, 2  # the SDK's SpanKind values
UNSET, OK, ERROR = 0, 1, 2  # StatusCode values
_MASK64 = (1 << 64) - 1


class Scope:
    """What a span shares with every other span of this process: resource and scope."""

    __slots__ = ("resource", "instrumentation_scope")

    def __init__(self, resource: Any, instrumentation_scope: Any):
        self.resource = resource
        self.instrumentation_scope = instrumentation_scope


class Attrs:
    """Span attributes that many spans share (model, version, replica, ...). Where spans are
    encoded to OTLP as they end, these are encoded once (``encoded``, filled in by the encoder)
    instead of once per span; a span's own ``attributes`` hold only what varies per span."""

    __slots__ = ("items", "encoded")

    def __init__(self, items: Mapping[str, Any]):
        self.items = dict(items)
        self.encoded: bytes | None = None

    def __repr__(self) -> str:
        return f"Attrs({self.items!r})"


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    # bytes.hex: about twice as fast as formatting the 128-bit int with :032x
    flag = "01" if flags == 1 else f"{flags & 0xFF:02x}"
    return f"00-{trace_id.to_bytes(16, 'big').hex()}-{span_id.to_bytes(8, 'big').hex()}-{flag}"


class Ref(NamedTuple):
    """A span recorded after the fact without a Span object (``tracing.emit_span`` where
    meshserve encodes), or one still to be recorded: what a child span, a link or a
    traceparent needs of it."""

    trace_id: int
    span_id: int
    flags: int
    trace_state: str

    def traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, self.flags)


# (scope, the arguments of otlp_encode.encode_fields): an ended span waiting to be encoded
Record = tuple[Scope, tuple[Any, ...]]


class Span:
    """One span. ``start``/``end`` times are epoch nanoseconds; links hold member spans'
    (trace id, span id). Ends once: ``end()`` hands it to ``on_end`` (the export queue)."""

    __slots__ = ("name", "trace_id", "span_id", "flags", "trace_state", "parent_id", "parent_remote", "_kind",
                 "start_time", "end_time", "attributes", "_links", "status_code", "status_description",
                 "_scope", "_on_end", "encoded", "fixed")

    def __init__(self, name: str, trace_id: int, span_id: int, parent_id: int, parent_remote: bool, kind: int,
                 start_time: int, attributes: dict[str, Any] | None, scope: Scope,
                 on_end: Callable[[Span], None] | None, flags: int = 1, trace_state: str = "",
                 links: list[tuple[int, int]] | None = None, fixed: Attrs | None = None):
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.flags = flags
        self.trace_state = trace_state
        self.parent_id = parent_id  # 0: a root span
        self.parent_remote = parent_remote
        self._kind = kind
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes = attributes if attributes is not None else {}
        self._links = links or []
        self.status_code = UNSET
        self.status_description = ""
        self._scope = scope
        self._on_end = on_end
        self.encoded: bytes | None = None
        self.fixed = fixed  # shared attributes, encoded before the span's own (see Attrs)

    # ---- what meshserve calls ----------------------------------------------------------
    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def set_error(self, description: str) -> None:
        self.status_code = ERROR
        self.status_description = clip(description)  # (an error's text may quote a client's input)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        if end_time is None:
            end_time = time.time_ns()
        self.end_time = end_time if end_time > self.start_time else self.start_time
        if self._on_end is not None:
            self._on_end(self)

    def is_recording(self) -> bool:
        return self.end_time is None

    def traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, self.flags)

    # ---- what the SDK's exporters read (built on demand, off the hot path) -----------------
    @property
    def context(self) -> Any:
        from opentelemetry.trace import SpanContext, TraceFlags, TraceState

        state = TraceState.from_header([self.trace_state]) if self.trace_state else None
        return SpanContext(self.trace_id, self.span_id, is_remote=False, trace_flags=TraceFlags(self.flags),
                           trace_state=state)

    def get_span_context(self) -> Any:
        return self.context

    @property
    def parent(self) -> Any:
        if not self.parent_id:
            return None
        from opentelemetry.trace import SpanContext, TraceFlags

        return SpanContext(self.trace_id, self.parent_id, is_remote=self.parent_remote,
                           trace_flags=TraceFlags(self.flags))

    @property
    def kind(self) -> Any:
        from opentelemetry.trace import SpanKind

        return SpanKind(self._kind)

    @property
    def status(self) -> Any:
        from opentelemetry.trace import Status, StatusCode

        return Status(StatusCode(self.status_code), self.status_description or None)

    @property
    def links(self) -> Sequence[Any]:
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        return [Link(SpanContext(t, s, is_remote=False, trace_flags=TraceFlags(1))) for t, s in self._links]

    @property
    def events(self) -> Sequence[Any]:
        return ()

    dropped_attributes = dropped_events = dropped_links = 0

    @property
    def resource(self) -> Any:
        return self._scope.resource

    @property
    def instrumentation_scope(self) -> Any:
        return self._scope.instrumentation_scope

    @property
    def instrumentation_info(self) -> Any:
        return self._scope.instrumentation_scope

    def to_readable(self) -> Any:
        """The SDK's ReadableSpan with the same content (console output)."""
        from opentelemetry.sdk.trace import ReadableSpan

        attributes = {**self.fixed.items, **self.attributes} if self.fixed is not None else self.attributes
        return ReadableSpan(name=self.name, context=self.context, parent=self.parent, resource=self.resource,
                            attributes=attributes, events=(), links=self.links, kind=self.kind,
                            status=self.status, start_time=self.start_time, end_time=self.end_time,
                            instrumentation_scope=self.instrumentation_scope)

    def to_json(self, indent: int | None = 4) -> str:
        return str(self.to_readable().to_json(indent=indent))

    def __repr__(self) -> str:
        return f"Span({self.name!r}, trace={self.trace_id:032x}, span={self.span_id:016x})"


class Sampler:
    """OTEL_TRACES_SAMPLER's built-in samplers, judged the way the SDK judges them.

    ``root``: "on", "off" or a ratio (TraceIdRatioBased: sampled when the low 64 bits of the
    trace id are below ratio * 2^64). ``parent_based``: a request with a parent follows the
    parent's sampled flag; only roots meet the root rule.
    """

    def __init__(self, root: str | float, parent_based: bool):
        self.root = root
        self.parent_based = parent_based
        if isinstance(root, float):
            self.ratio = min(1.0, max(0.0, root))
            self.bound = round(self.ratio * (1 << 64))
        # a root is sampled when the low 64 bits of its trace id are below this (0: never)
        self.root_bound = (1 << 64) if root == "on" else 0 if root == "off" else self.bound

    def sample(self, trace_id: int, parent_flags: int | None) -> bool:
        """``parent_flags``: the parent's trace flags, None for a root."""
        if self.parent_based and parent_flags is not None:
            return bool(parent_flags & 1)
        return trace_id & _MASK64 < self.root_bound

    def description(self) -> str:
        root = {"on": "AlwaysOnSampler", "off": "AlwaysOffSampler"}.get(self.root) if isinstance(self.root, str) \
            else f"TraceIdRatioBased{{{self.ratio}}}"
        return f"ParentBased{{root:{root}}}" if self.parent_based else str(root)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Sampler:
        """OTEL_TRACES_SAMPLER[_ARG] (default parentbased_always_on); unknown names warn."""
        name = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        base = name.removeprefix("parentbased_")
        root: str | float
        if base in ("always_on", "always_off"):
            root = base.removeprefix("always_")
        elif base == "traceidratio":
            try:
                root = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
            except ValueError:
                log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a number; using 1.0",
                            env.get("OTEL_TRACES_SAMPLER_ARG"))
                root = 1.0
            if not 0.0 <= root <= 1.0:
                log.warning("OTEL_TRACES_SAMPLER_ARG=%s is outside 0..1; using 1.0", root)
                root = 1.0
        else:
            log.warning("OTEL_TRACES_SAMPLER=%s is not supported; using parentbased_always_on", name)
            return cls("on", True)
        return cls(root, name.startswith("parentbased_"))


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        log.warning("%s=%s is not an integer; using %d", name, raw, default)
        return default
    return value if value > 0 else default


class ExportQueue:
    """The batching span processor: ``on_end`` appends (a deque append, no lock); a daemon
    thread exports every ``OTEL_BSP_SCHEDULE_DELAY`` ms, or at once when a batch is full, to
    each exporter. A full queue drops the span and counts it (never blocks a request)."""

    def __init__(self, exporters: Sequence[Any], env: Mapping[str, str],
                 encode: Callable[[Span], bytes] | None = None):
        self.exporters = list(exporters)
        self.delay_s = env_int(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_batch = min(env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self.max_queue)
        self.timeout_ms = env_int(env, "OTEL_BSP_EXPORT_TIMEOUT", 30000)
        # encode at end (on the thread that ends the span): the export thread then only joins
        # bytes and sends, instead of taking the GIL from the event loop for milliseconds
        self.encode = encode
        self.dropped = 0
        self._queue: collections.deque[Span] = collections.deque()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._exporting = False
        self._stopped = False
        self._thread = threading.Thread(target=self._worker, name="meshserve-span-export", daemon=True)
        self._thread.start()

    def on_end(self, span: Span) -> None:
        queue = self._queue
        if len(queue) >= self.max_queue or self._stopped:
            self.dropped += 1
            return
        if self.encode is not None:
            span.encoded = self.encode(span)
        queue.append(span)
        if len(queue) >= self.max_batch:
            self._wake.set()

    def _worker(self) -> None:
        while True:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            stopping = self._stopped
            self._export_all()
            if stopping:
                return

    def _export_all(self) -> None:
        with self._idle:
            self._exporting = True
        try:
            while self._queue:
                batch: list[Span] = []
                queue = self._queue
                while queue and len(batch) < self.max_batch:
                    batch.append(queue.popleft())
                for exporter in self.exporters:
                    try:
                        exporter.export(batch)
                    except Exception:  # an exporter's failure loses its batch, never the process
                        log.exception("span exporter %s failed", type(exporter).__name__)
        finally:
            with self._idle:
                self._exporting = False
                self._idle.notify_all()

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export everything queued so far; True when done within the timeout."""
        self._wake.set()
        with self._idle:
            return self._idle.wait_for(lambda: not self._queue and not self._exporting, timeout_s)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        self._thread.join(self.timeout_ms / 1000)
        for exporter in self.exporters:
            try:
                exporter.shutdown()
            except Exception:  # shutting down anyway
                log.debug("span exporter %s failed to shut down", type(exporter).__name__, exc_info=True)
        if self.dropped:
            log.warning("%d spans were dropped: the export queue (OTEL_BSP_MAX_QUEUE_SIZE=%d) was full",
                        self.dropped, self.max_queue)
