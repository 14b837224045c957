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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway.upstream.replica import Replica
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import wire
from meshserve.telemetry import tracing
from meshserve.telemetry.spans import CLIENT, Ref, Span

Attempt = Callable[[Replica], Awaitable[pb.ModelInferResponse]]
Call = Callable[[str, str, Attempt], Awaitable[pb.ModelInferResponse]]
Forward = Callable[[Replica, bytes], Awaitable[pb.ModelInferResponse]]
Member = tuple[int, Span, int]  # (index in a merged request, the member's request span, enqueued monotonic ns)
_ROUTE_KEYS = ("meshserve.route", "meshserve.arm")  # set on the request span by an A/B route (gateway/routes.py)


async def send(call: Call, request: pb.ModelInferRequest, body: bytes, forward: Forward,
               parent: Span) -> pb.ModelInferResponse:
    """``call`` is GatewayCore._call (replica choice, retries); ``forward(replica, body)`` sends
    the request bytes on the replica's streams; ``parent`` is the sampled gateway request span."""
    name, version = request.model_name, request.model_version
    started = time.time_ns()

    async def attempt(replica: Replica) -> pb.ModelInferResponse:
        nonlocal started
        decided = time.time_ns()
        upstream = _upstream_span(parent)
        calls: list[_Call] = [(parent, upstream.span_id, started, None)]
        started = decided  # a retry's route span starts where this attempt's decision ended
        return await _forward_under(calls, decided, name, version, forward, replica,
                                    tracing.inject_parameters(body, upstream))

    return await call(name, version, attempt)


async def send_merged(call: Call, request: pb.ModelInferRequest, body: bytes, forward: Forward,
                      members: Sequence[Member]) -> pb.ModelInferResponse:
    """Send a merged request (``body``) whose ``members`` are sampled client requests."""
    name, version = request.model_name, request.model_version
    count = request.parameters[wire.MERGED_PARAMETER].int64_param
    off = tracing.epoch_offset_ns()
    starts = [enqueued + off for _, _, enqueued in members]

    async def attempt(replica: Replica) -> pb.ModelInferResponse:
        now = time.time_ns()
        calls: list[_Call] = []
        lines = [""] * count
        for k, (index, parent, _) in enumerate(members):
            upstream = _upstream_span(parent)
            calls.append((parent, upstream.span_id, starts[k], {"meshserve.merged_requests": count,
                                                               "meshserve.member": index}))
            lines[index] = tracing.member_line(upstream)
            starts[k] = now  # a retry's route span starts where this attempt's decision ended
        return await _forward_under(calls, now, name, version, forward, replica, wire.with_string_parameter(
            body, wire.TRACEPARENTS_PARAMETER, "\n".join(lines)))

    return await call(name, version, attempt)


def _upstream_span(parent: Span) -> Ref:
    """The upstream call's CLIENT span under ``parent``, its id drawn now (the traceparent the
    call carries names it); recorded when the call is over (``_record``)."""
    return Ref(parent.trace_id, tracing.random_bits(64) or 1, parent.flags, parent.trace_state)


# an upstream call of one traced client request: (its request span, the upstream span's id,
# when the route decision began, the upstream span's own attributes)
_Call = tuple[Span, int, int, dict[str, Any] | None]


async def _forward_under(calls: list[_Call], decided_ns: int, name: str, version: str, forward: Forward,
                         replica: Replica, body: bytes) -> pb.ModelInferResponse:
    """``forward``, then its spans recorded (``_record``: after the response is on its way)."""
    error: BaseException | None = None
    try:
        return await forward(replica, body)
    except BaseException as exc:
        error = exc
        raise
    finally:
        tracing.defer(_record, calls, decided_ns, time.time_ns(), error, name, version, replica.endpoint)


def _record(calls: list[_Call], decided_ns: int, end_ns: int, error: BaseException | None, name: str,
            version: str, endpoint: str) -> None:
    """Per traced client request: the route decision (to ``decided_ns``) and the upstream
    call's CLIENT span (whose id its traceparent already carried to the service)."""
    route, upstream = _fixed(name, version, endpoint)
    description, code = tracing.error_fields(error) if error is not None else (None, None)
    for parent, span_id, started_ns, own in calls:
        attrs = parent.attributes
        decided = {key: v for key in _ROUTE_KEYS if (v := attrs.get(key)) is not None} if attrs else None
        tracing.emit_span("gateway.route", parent, started_ns, decided_ns, decided, fixed=route)
        if code is not None:
            own = {**own, "meshserve.error_code": code} if own else {"meshserve.error_code": code}
        tracing.emit_span("gateway.upstream", parent, decided_ns, end_ns, own, error=description, fixed=upstream,
                          kind=CLIENT, span_id=span_id)


@functools.lru_cache(maxsize=1024)
def _fixed(name: str, version: str, endpoint: str) -> tuple[tracing.Attrs, tracing.Attrs]:
    """The attributes the route and upstream spans of one (model, version, replica) share."""
    common = (("meshserve.model", name), ("meshserve.model_version", version), ("meshserve.replica", endpoint))
    return (tracing.fixed_attributes(*common),
            tracing.fixed_attributes(*common, ("rpc.system", "grpc"), ("server.address", endpoint)))
