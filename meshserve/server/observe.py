"""Per-request observability around V2Core.infer, shared by the gRPC and HTTP front ends.

This is the front door every inference request passes: it reads the request's Hop record (the
gateway's private ``meshserve_*`` parameters and hop marker, ``read_hop``: meshserve.protocol.hop) into
``RequestContext.hop`` once, for admission, tracing and the core.

The common case (tracing off, DEBUG off, success) costs two flag checks; the front doors run it
in their own coroutine (``admitted``, ``release``, ``failed``: one coroutine fewer per request)
and everything else by ``infer``. When tracing is on,
the request gets a SERVER span whose parent comes from the ``traceparent`` request parameter
(the gateway -> service hop) or header/metadata (direct clients); a request the gateway merged
from several clients' requests gets one per traced member (``meshserve_traceparents``). In a
service, the spans of requests the gateway forwarded are recorded when the request ends
(``tracing.LateSpans``): nothing is parsed or built for them while the request runs. Every
error is logged once at WARNING with the request id and trace id (a stack trace only for
internal errors) and is turned into an InferError, so the front ends do not log it again.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop as _hop
from meshserve.protocol.errors import Code, InferError, internal_error
from meshserve.protocol.hop import NO_HOP, decode
from meshserve.server import admission, inflate
from meshserve.server.core import (
    InferResult,
    RequestContext,
    StreamAnswer,
    V2Core,
    single_answer,
)
from meshserve.server.workers import LOG, TRACE, SettingsShare
from meshserve.telemetry import log_settings, trace_settings, tracing
from meshserve.telemetry.spans import Span
from meshserve.telemetry.text_lines import clip

log = logging.getLogger("meshserve.request")
_levels: dict[int, bool] = log._cache  # type: ignore[attr-defined]  # (cleared in place by setLevel, never replaced)
_gate = admission.gate  # configured in place by process.serve
# The request's Hop record, read once at the front door (meshserve/protocol/hop.py: the gateway's
# private parameters, believed only on a gateway's stream; a request without parameters costs one
# header lookup).
read_hop = decode


def _admit(request: pb.ModelInferRequest, ctx: RequestContext) -> tuple[int, int]:
    """Read the request's Hop record and admit it (admission.py: a few integer operations, then
    the request runs or is refused at once); returns (weight, size) to give back when it ends.
    A request the gateway merged counts as the client requests it holds."""
    raw = ctx.raw
    size = len(raw) if raw is not None else ctx.nbytes
    # (decode's own first test, made before reading request.parameters: a upb map read costs
    # ~3k instructions, and a gateway, or a client's call to a service, never has a hop record)
    headers = ctx.headers
    hop = ctx.hop = read_hop(request.parameters, headers) \
        if _hop.trusted and headers.get(_hop.HEADER) is _hop.VERIFIED else NO_HOP
    weight = hop.merged or 1
    if weight != 1:
        weight = _weight(request, weight)
    gate = _gate
    if gate.requests >= gate.max_requests or (gate.bytes + size > gate.max_bytes and gate.requests):
        raise _log_error(request, ctx, gate.refuse(request.model_name, weight, size), "", 0)
    gate.requests += weight
    gate.bytes += size
    return weight, size


def admitted(request: pb.ModelInferRequest, ctx: RequestContext) -> tuple[int, int] | None:
    """``infer``'s common path (tracing off, DEBUG off) for a front door that awaits the core in
    its own coroutine (one coroutine fewer per request): the request admitted (``_admit``'s
    (weight, size), handed back to ``release`` when it ends; a refusal raised), its errors
    mapped and logged by ``failed``. None (nothing admitted): the request goes by ``infer``."""
    # (the logger's own cache of isEnabledFor(DEBUG), read without the call: a level not cached
    # yet, or DEBUG on, takes ``infer``, which asks the logger and so fills the cache)
    if tracing.enabled or _levels.get(logging.DEBUG) is not False:
        return None
    return _admit(request, ctx)


def plain() -> bool:
    """Whether a request takes the common path (tracing off, DEBUG off: ``admitted``'s test), where
    an error needs neither a span nor a log line (a gateway's refusal at the door)."""
    return not tracing.enabled and _levels.get(logging.DEBUG) is False


def release(admitted: tuple[int, int]) -> None:
    """A request ``admitted`` admitted has ended (answered, failed or cancelled)."""
    gate = _gate
    gate.requests -= admitted[0]
    gate.bytes -= admitted[1]


def failed(request: pb.ModelInferRequest, ctx: RequestContext, exc: Exception) -> InferError:
    """The error of a request ``admitted`` admitted, logged once (as ``infer`` logs it)."""
    return _log_error(request, ctx, exc, "", 0)


def _weight(request: pb.ModelInferRequest, merged: int) -> int:
    """A merged request's weight in admission: its member count, at least 1 and at most its rows
    (each member brings at least one row, and the model refuses more rows than its max batch),
    so a forged count (the marker is believed from whoever reaches a service's port) cannot
    weigh more than the batch it carries."""
    inputs = request.inputs
    rows = inputs[0].shape[0] if inputs and inputs[0].shape else 1
    return max(1, min(merged, rows))


async def infer(core: V2Core, request: pb.ModelInferRequest, ctx: RequestContext) -> tuple[InferResult, Span | None]:
    """core.infer with admission, span, logs and error mapping; returns (result, the request's
    sampled SERVER span, whose traceparent a unary response echoes, or None)."""
    weight, size = _admit(request, ctx)
    gate = _gate
    try:  # the body is inline, not a second coroutine: this is every request's path
        if tracing.enabled and (sampled := _sampled_spans(request, ctx)) is not None:
            if isinstance(sampled, tracing.LateSpans):
                return await _infer_late(core, request, ctx, sampled), None
            return await _infer_traced(core, request, ctx, sampled)
        # not sampled (most requests at a low ratio): exactly the path of tracing off
        if not log.isEnabledFor(logging.DEBUG):
            try:
                return await core.infer(request, ctx), None
            except Exception as exc:
                raise _log_error(request, ctx, exc, "", 0) from None
        t0 = time.perf_counter_ns()
        try:
            result = await core.infer(request, ctx)
        except Exception as exc:
            raise _log_error(request, ctx, exc, "", t0) from None
        _log_ok(request, ctx, "", t0)
        return result, None
    finally:
        gate.requests -= weight
        gate.bytes -= size


async def infer_stream(core: V2Core, request: pb.ModelInferRequest, ctx: RequestContext
                       ) -> AsyncGenerator[StreamAnswer, None]:
    """core.infer_stream with what ``infer`` gives a request: admission (held until its last
    response), its span (ended after the last response) and one log line for its outcome."""
    weight, size = _admit(request, ctx)
    gate = _gate
    span: Span | None = None
    late: tracing.LateSpans | None = None
    token: Any = None
    trace_id = ""
    error: InferError | None = None
    try:
        if tracing.enabled and (sampled := _sampled_spans(request, ctx)) is not None:
            if isinstance(sampled, tracing.LateSpans):
                late, token = sampled, tracing.activate_late(sampled)
                trace_id = sampled.trace_id()
            else:
                span, token = sampled, tracing.activate(sampled)
                trace_id = tracing.trace_id(sampled)
        t0 = time.perf_counter_ns() if log.isEnabledFor(logging.DEBUG) else 0
        try:
            # (a core built before infer_stream was part of V2Core answers once, by infer)
            stream = core.infer_stream if hasattr(core, "infer_stream") else functools.partial(single_answer, core)
            async for answer in stream(request, ctx):
                yield answer
        except Exception as exc:
            error = _log_error(request, ctx, exc, trace_id, t0)
            if span is not None:
                tracing.set_error(span, error)
            raise error from None
        if t0:
            _log_ok(request, ctx, trace_id, t0)
    finally:
        gate.requests -= weight
        gate.bytes -= size
        if token is not None:
            try:
                (tracing.deactivate_late if late is not None else tracing.deactivate)(token)
            except ValueError:  # closed from another context (a generator collected unfinished)
                pass
        if span is not None:
            tracing.end(span)
        if late is not None:
            late.finish(error)
        error = None  # (the raised error's traceback holds this frame: no cycle through it, which only the GC would free)


def _sampled_spans(request: pb.ModelInferRequest, ctx: RequestContext) -> Span | tracing.LateSpans | None:
    """The request's sampled SERVER span, the LateSpans of a request the gateway forwarded
    with its context in the parameters, or None. An unsampled request costs a few map and
    header lookups and (for a root) one random draw: the sampler judges a root before anything
    else is built."""
    settings = trace_settings.active
    if settings is not None and settings.off(request.model_name):
        return None  # trace_level OFF (the trace extension): no spans here, whatever the context says
    params = request.parameters
    hop = ctx.hop
    if params:  # a context in the parameters wins over one in the headers
        if hop.traceparents is not None and tracing.late_spans:  # merged by the gateway
            return tracing.LateSpans(hop.traceparents, max(1, hop.merged or 1), _fixed_attributes(request, ctx))
        if tracing.TRACEPARENT in params:
            tp = params[tracing.TRACEPARENT].string_param
            ts = params[tracing.TRACESTATE].string_param if tracing.TRACESTATE in params else ""
            if tracing.late_spans and hop.gateway:  # no echo
                return tracing.LateSpans(f"{tp}\t{ts}" if ts else tp, 0, _fixed_attributes(request, ctx),
                                         request.id)
            return _server_span(request, ctx, tracing.parent_context(tp, ts))
    headers = ctx.headers
    tp = headers.get(tracing.TRACEPARENT)
    if tp is None:
        if hop.gateway:
            return None  # the gateway did not sample this request: no root trace of our own
        low = tracing.random_bits(64)  # the sampler's verdict on a root, before any call
        if settings is None:
            return None if low >= tracing.root_bound else _server_span(request, ctx, None, low)
        if low >= settings.root_bound(request.model_name) or not settings.take_root(request.model_name):
            return None  # trace_rate / trace_count of the trace extension
        return _server_span(request, ctx, None, low)
    return _server_span(request, ctx, tracing.parent_context(tp, headers.get(tracing.TRACESTATE)))


def _server_span(request: pb.ModelInferRequest, ctx: RequestContext, parent: tracing.Remote | None,
                 low: int | None = None) -> Span | None:
    span = tracing.start_server_span(tracing.request_span_name, parent, low=low)
    if span is None:
        return None
    tracing.share(span, _fixed_attributes(request, ctx))
    if request.id:
        span.attributes["meshserve.request_id"] = clip(request.id)  # (the client's: up to a message)
    return span


async def _infer_traced(core: V2Core, request: pb.ModelInferRequest, ctx: RequestContext,
                        span: Span) -> tuple[InferResult, Span | None]:
    token = tracing.activate(span)
    t0 = time.perf_counter_ns() if log.isEnabledFor(logging.DEBUG) else 0
    try:
        result = await core.infer(request, ctx)
    except Exception as exc:
        # (no local holds the raised error: its traceback holds this frame; see infer_stream)
        raise _spanned(span, _log_error(request, ctx, exc, tracing.trace_id(span), t0)) from None
    finally:
        tracing.deactivate(token)
        tracing.end(span)
    if t0:
        _log_ok(request, ctx, tracing.trace_id(span), t0)
    return result, span


def _spanned(span: Span, err: InferError) -> InferError:
    """``err``, recorded on ``span``."""
    tracing.set_error(span, err)
    return err


async def _infer_late(core: V2Core, request: pb.ModelInferRequest, ctx: RequestContext,
                      late: tracing.LateSpans) -> InferResult:
    """A request the gateway forwarded: its span(s) are recorded when it ends (LateSpans)."""
    token = tracing.activate_late(late)
    t0 = time.perf_counter_ns() if log.isEnabledFor(logging.DEBUG) else 0
    error: InferError | None = None
    try:
        result = await core.infer(request, ctx)
    except Exception as exc:
        error = _log_error(request, ctx, exc, late.trace_id(), t0)
        raise error from None
    finally:
        tracing.deactivate_late(token)
        late.finish(error)
        error = None  # (as in infer_stream: no frame -> error -> traceback -> frame cycle)
    if t0:
        _log_ok(request, ctx, late.trace_id(), t0)
    return result


async def trace_setting(core: V2Core, model: str, changes: Mapping[str, Sequence[str] | None] | None
                        ) -> dict[str, list[str]]:
    """The trace extension for both front ends: read (``changes`` empty) or update this process's
    trace settings, global (``model`` "") or one model's (which must exist here: NOT_FOUND)."""
    if model:
        await core.model_metadata(model, "")  # an unknown model is NOT_FOUND, as for any other route
    try:
        if shared_settings is not None:  # a gateway worker: the settings are its siblings' too
            return shared_settings.run(TRACE, lambda: tracing.trace_setting(model, changes), bool(changes))
        return tracing.trace_setting(model, changes)
    except trace_settings.SettingError as exc:
        raise InferError.invalid(f"trace setting{f' of model {model!r}' if model else ''}: {exc}") from None


async def log_setting(core: V2Core, changes: Mapping[str, Any] | None) -> dict[str, Any]:
    """The logging extension for both front ends: this process's log settings after ``changes``,
    which then go where this process's models log (``core.log_settings_changed``: a gateway's
    services, a python service's workers), as Triton's one process applies them to its models'
    log lines too."""
    settings = log_settings.active
    if settings is None:
        raise InferError.unavailable("log settings: this process's logging was not set up by meshserve")
    try:
        if shared_settings is not None:  # a gateway worker: the settings are its siblings' too
            now = shared_settings.run(LOG, lambda: settings.update(changes) if changes else settings.current(),
                                      bool(changes))
        else:
            now = settings.update(changes) if changes else settings.current()
    except log_settings.SettingError as exc:
        raise InferError.invalid(str(exc)) from None
    changed = getattr(core, "log_settings_changed", None)
    if changes and changed is not None:
        await changed(dict(changes))
    return now


def fill_log_settings(entries: Any, settings: Mapping[str, Any]) -> None:
    """``settings`` into a LogSettingsRequest's or LogSettingsResponse's ``settings`` map, each
    value in the field Triton uses for it (bool, uint32 for the verbose level, string)."""
    for key, value in settings.items():
        entry = entries[key]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            entry.uint32_param = value
        else:
            entry.string_param = str(value)


# a gateway worker's (meshserve/server/workers.py): trace and log updates through any worker apply to all
shared_settings: SettingsShare | None = None


def _fixed_attributes(request: pb.ModelInferRequest, ctx: RequestContext) -> tracing.Attrs:
    return tracing.fixed_attributes(("meshserve.model", request.model_name),
                                    ("meshserve.model_version", request.model_version), ("rpc.system", ctx.protocol))


def _log_ok(request: pb.ModelInferRequest, ctx: RequestContext, trace_id: str, t0: int) -> None:
    ms = (time.perf_counter_ns() - t0) / 1e6
    log.debug("infer %s/%s id=%s trace=%s %s OK %.3fms", request.model_name, request.model_version or "-",
              request.id or "-", trace_id or "-", ctx.protocol, ms,
              extra={"model": request.model_name, "version": request.model_version, "request_id": request.id,
                     "trace_id": trace_id, "protocol": ctx.protocol, "status": "OK", "duration_ms": round(ms, 3)})


# Failed requests' log lines, per caller (a tenant; with no tenants, every caller is one):
# a token bucket of this many lines a second and this burst. A client's flood of bad requests
# wrote one line each (~23% of a service's CPU under a ModelStreamInfer flood of unknown models,
# and the log's disk); past the budget they are counted and the caller's next line says how many
# were left out. Every failure is still counted in the metrics (nv_inference_request_failure).
ERROR_LINES_PER_S = 10.0
ERROR_LINES_BURST = 100.0
ERROR_LINE_CALLERS = 4096  # callers with a bucket (tenants come from the tenants file: far fewer)


class LineBudget:
    """One caller's budget of failed requests' log lines (``take``)."""

    __slots__ = ("tokens", "at", "left_out")

    def __init__(self, now: float) -> None:
        self.tokens, self.at, self.left_out = ERROR_LINES_BURST, now, 0

    def take(self, now: float) -> int | None:
        """None: over the budget (counted as left out); else how many lines were left out
        before this one (then reset)."""
        self.tokens = min(ERROR_LINES_BURST, self.tokens + (now - self.at) * ERROR_LINES_PER_S)
        self.at = now
        if self.tokens < 1.0:
            self.left_out += 1
            return None
        self.tokens -= 1.0
        left_out, self.left_out = self.left_out, 0
        return left_out


_line_budgets: dict[str, LineBudget] = {}


def _line_budget(ctx: RequestContext) -> LineBudget:
    """The budget of the request's caller: its tenant (a gateway with --tenants), else one for all."""
    name = ""
    if (find := inflate.tenant_of) is not None:
        try:
            name = find(ctx.headers)[0]
        except Exception:  # (no tenant: a refused key's lines share one budget)
            name = "\0unknown"
    budget = _line_budgets.get(name)
    if budget is None:
        if len(_line_budgets) >= ERROR_LINE_CALLERS:
            _line_budgets.clear()
        budget = _line_budgets[name] = LineBudget(time.monotonic())
    return budget


def _log_error(request: pb.ModelInferRequest, ctx: RequestContext, exc: Exception, trace_id: str,
               t0: int) -> InferError:
    """Log one line for a failed request, within its caller's budget of lines
    (ERROR_LINES_PER_S); returns the InferError the front end reports."""
    internal = not isinstance(exc, InferError)
    err = internal_error(exc) if internal else exc
    assert isinstance(err, InferError)
    if not log.isEnabledFor(logging.WARNING):
        return err
    # Quota rejections come by the thousand under a flood: DEBUG (the gateway counts them per
    # tenant in meshserve_gateway_quota_rejections_total); every other error at WARNING.
    level = logging.DEBUG if err.code is Code.RESOURCE_EXHAUSTED else logging.WARNING
    if level == logging.DEBUG and not log.isEnabledFor(logging.DEBUG):
        return err
    left_out = _line_budget(ctx).take(time.monotonic())
    if left_out is None:
        return err
    if not trace_id and tracing.enabled:
        span = tracing.current_span()
        trace_id = tracing.trace_id(span)
    ms = (time.perf_counter_ns() - t0) / 1e6 if t0 else None
    stack = internal  # client mistakes and mapped statuses: one line, no stack trace
    log.log(level, "infer %s/%s id=%s trace=%s %s %s: %s%s", request.model_name, request.model_version or "-",
            request.id or "-", trace_id or "-", ctx.protocol, err.code.value, err.message,
            f" ({left_out} failed requests of this caller not logged before this one: over "
            f"{ERROR_LINES_PER_S:g} lines a second)" if left_out else "",
            exc_info=exc if stack else None,
            extra={"model": request.model_name, "version": request.model_version, "request_id": request.id,
                   "trace_id": trace_id, "protocol": ctx.protocol, "status": err.code.value,
                   **({"duration_ms": round(ms, 3)} if ms is not None else {})})
    return err
