"""The traced variant of the gateway's upstream send (only for sampled requests).

Spans: ``gateway.route`` (the route decision: A/B route and arm when there is one, model,
version, replica; from the start of the send to the moment a replica is picked, per attempt)
and ``gateway.upstream`` (CLIENT, one per attempt), whose context travels to the service as
``traceparent``/``tracestate`` request parameters appended to the forwarded bytes. Both are
recorded after the call (``tracing.defer``, with the spans the export queue encodes next):
during it, the request path only draws the upstream span's id and captures times.

A request the coalescer merged from several clients' requests gets these spans once per traced
member, under that member's request span: ``gateway.route`` from the member's arrival in the
coalescer, and a ``gateway.upstream`` for the shared call; the members' contexts travel as
one ``meshserve_traceparents`` parameter (a line per member, empty for untraced ones).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.upstream.replica import Replica
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.telemetry import tracing
from meshserve.telemetry.spans import CLIENT, Ref, Span

if TYPE_CHECKING:
    from gateway.upstream.upstream import Upstream

_ROUTE_KEYS = ("meshserve.route", "meshserve.arm")  # set on the request span by an A/B route (gateway/routes.py)


@dataclass(slots=True)
class Member:
    """A sampled client request in a merged one."""

    index: int  # its place in the merged request
    span: Span  # its request span
    enqueued_ns: int  # when it joined the coalescer's queue (monotonic)


@dataclass(slots=True)
class _Call:
    """An upstream call of one traced client request."""

    parent: Span  # the client request's span
    span_id: int  # the upstream span's id (its traceparent already went with the request)
    started_ns: int  # when the route decision began
    attributes: dict[str, Any] | None  # the upstream span's own attributes


async def send(upstream: Upstream, request: pb.ModelInferRequest, body: bytes, timeout: float | None,
               affinity: str | None, parent: Span, client_stream: str | None = None) -> pb.ModelInferResponse:
    """Upstream.send for a sampled request: ``upstream.call`` chooses the replica (and retries);
    ``parent`` is the sampled gateway request span."""
    name, version = request.model_name, request.model_version
    started = time.time_ns()

    async def attempt(replica: Replica) -> pb.ModelInferResponse:
        nonlocal started
        decided = time.time_ns()
        upstream_span = _upstream_span(parent)
        calls = [_Call(parent, upstream_span.span_id, started, None)]
        started = decided  # a retry's route span starts where this attempt's decision ended
        return await _forward_under(calls, decided, request, replica, tracing.inject_parameters(body, upstream_span),
                                    timeout, affinity if affinity is not None else client_stream)

    return await upstream.call(name, version, attempt, affinity)


async def send_merged(upstream: Upstream, request: pb.ModelInferRequest, body: bytes, timeout: float | None,
                      members: Sequence[Member]) -> pb.ModelInferResponse:
    """Send a merged request (``body``) whose ``members`` are sampled client requests."""
    name, version = request.model_name, request.model_version
    count = hop.merged_count(request)
    off = tracing.epoch_offset_ns()
    starts = [m.enqueued_ns + off for m in members]

    async def attempt(replica: Replica) -> pb.ModelInferResponse:
        now = time.time_ns()
        calls: list[_Call] = []
        lines = [""] * count
        for k, m in enumerate(members):
            upstream_span = _upstream_span(m.span)
            calls.append(_Call(m.span, upstream_span.span_id, starts[k], {"meshserve.merged_requests": count,
                                                                         "meshserve.member": m.index}))
            lines[m.index] = tracing.member_line(upstream_span)
            starts[k] = now  # a retry's route span starts where this attempt's decision ended
        return await _forward_under(calls, now, request, replica, hop.with_traceparents(body, lines), timeout, None)

    return await upstream.call(name, version, attempt)


def _upstream_span(parent: Span) -> Ref:
    """The upstream call's CLIENT span under ``parent``, its id drawn now (the traceparent the
    call carries names it); recorded when the call is over (``_record``)."""
    return Ref(parent.trace_id, tracing.random_bits(64) or 1, parent.flags, parent.trace_state)


async def _forward_under(calls: list[_Call], decided_ns: int, request: pb.ModelInferRequest, replica: Replica,
                         body: bytes, timeout: float | None, affinity: str | None) -> pb.ModelInferResponse:
    """``body`` on the replica's streams, then its spans recorded (``_record``: after the
    response is on its way)."""
    error: BaseException | None = None
    try:
        return await replica.streams.infer(body, request.id, timeout, affinity)
    except BaseException as exc:
        error = exc
        raise
    finally:
        tracing.defer(_record, calls, decided_ns, time.time_ns(), error, request.model_name, request.model_version,
                      replica.endpoint)
        error = None  # (the raised error's traceback holds this frame and ``body``: docs/security.md, "Session 11: error cycles")


def _record(calls: list[_Call], decided_ns: int, end_ns: int, error: BaseException | None, name: str,
            version: str, endpoint: str) -> None:
    """Per traced client request: the route decision (to ``decided_ns``) and the upstream
    call's CLIENT span (whose id its traceparent already carried to the service)."""
    route, upstream = _fixed(name, version, endpoint)
    description, code = tracing.error_fields(error) if error is not None else (None, None)
    for call in calls:
        parent, own = call.parent, call.attributes
        attrs = parent.attributes
        decided = {key: v for key in _ROUTE_KEYS if (v := attrs.get(key)) is not None} if attrs else None
        tracing.emit_span("gateway.route", parent, call.started_ns, decided_ns, decided, fixed=route)
        if code is not None:
            own = {**own, "meshserve.error_code": code} if own else {"meshserve.error_code": code}
        tracing.emit_span("gateway.upstream", parent, decided_ns, end_ns, own, error=description, fixed=upstream,
                          kind=CLIENT, span_id=call.span_id)


@functools.lru_cache(maxsize=1024)
def _fixed(name: str, version: str, endpoint: str) -> tuple[tracing.Attrs, tracing.Attrs]:
    """The attributes the route and upstream spans of one (model, version, replica) share."""
    common = (("meshserve.model", name), ("meshserve.model_version", version), ("meshserve.replica", endpoint))
    return (tracing.fixed_attributes(*common),
            tracing.fixed_attributes(*common, ("rpc.system", "grpc"), ("server.address", endpoint)))
