"""The traced variant of the gateway's upstream send (only for sampled requests).

Spans: ``gateway.route`` (the route decision: A/B route and arm when there is one, model,
version, replica; from the start of the send to the moment a replica is picked, per attempt)
and ``gateway.upstream`` (CLIENT, one per attempt), whose context travels to the service as
``traceparent``/``tracestate`` request parameters appended to the forwarded bytes.

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
from meshserve.telemetry.spans import CLIENT, Span

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
        span = _route_and_upstream(parent, started, decided, name, version, replica.endpoint, None)
        started = decided  # a retry's route span starts where this attempt's decision ended
        return await _forward_under([span], forward, replica, tracing.inject_parameters(body, span))

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
        spans = []
        lines = [""] * count
        for k, (index, parent, _) in enumerate(members):
            span = _route_and_upstream(parent, starts[k], now, name, version, replica.endpoint,
                                       {"meshserve.merged_requests": count, "meshserve.member": index})
            spans.append(span)
            lines[index] = tracing.member_line(span)
            starts[k] = now  # a retry's route span starts where this attempt's decision ended
        return await _forward_under(spans, forward, replica, wire.with_string_parameter(
            body, wire.TRACEPARENTS_PARAMETER, "\n".join(lines)))

    return await call(name, version, attempt)


def _route_and_upstream(parent: Span, started_ns: int, decided_ns: int, name: str, version: str, endpoint: str,
                        upstream_only: dict[str, Any] | None) -> Span:
    """Record the route decision (``started_ns`` to ``decided_ns``) under ``parent`` and start the
    CLIENT span of the upstream call that follows it."""
    attrs = parent.attributes
    decided = {key: v for key in _ROUTE_KEYS if (v := attrs.get(key)) is not None} if attrs else None
    route, upstream = _fixed(name, version, endpoint)
    tracing.emit_span("gateway.route", parent, started_ns, decided_ns, decided, fixed=route)
    return tracing.start_span("gateway.upstream", parent, CLIENT, upstream_only, decided_ns, fixed=upstream)


@functools.lru_cache(maxsize=1024)
def _fixed(name: str, version: str, endpoint: str) -> tuple[tracing.Attrs, tracing.Attrs]:
    """The attributes the route and upstream spans of one (model, version, replica) share."""
    common = (("meshserve.model", name), ("meshserve.model_version", version), ("meshserve.replica", endpoint))
    return (tracing.fixed_attributes(*common),
            tracing.fixed_attributes(*common, ("rpc.system", "grpc"), ("server.address", endpoint)))


async def _forward_under(spans: Sequence[Span], forward: Forward, replica: Replica,
                         body: bytes) -> pb.ModelInferResponse:
    """``forward`` with the upstream spans open around it; an exception marks them failed."""
    try:
        return await forward(replica, body)
    except BaseException as exc:
        for span in spans:
            tracing.set_error(span, exc)
        raise
    finally:
        for span in spans:
            tracing.end(span)
