"""The traced variant of the gateway's upstream send (only for sampled requests).

Spans: ``gateway.route`` (the replica choice: model, version, replica; from the start of the
send to the moment a replica is picked, per attempt) and ``gateway.upstream`` (CLIENT, one
per attempt), whose context travels to the service as ``traceparent``/``tracestate``
request parameters appended to the forwarded bytes.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from gateway.upstream.replica import Replica
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.telemetry import tracing

Attempt = Callable[[Replica], Awaitable[pb.ModelInferResponse]]
Call = Callable[[str, str, Attempt], Awaitable[pb.ModelInferResponse]]
Forward = Callable[[Replica, bytes], Awaitable[pb.ModelInferResponse]]


async def send(call: Call, request: pb.ModelInferRequest, body: bytes, forward: Forward,
               parent: object) -> pb.ModelInferResponse:
    """``call`` is GatewayCore._call (replica choice, retries); ``forward(replica, body)`` sends
    the request bytes on the replica's streams; ``parent`` is the sampled gateway request span."""
    name, version = request.model_name, request.model_version
    started = time.time_ns()

    async def attempt(replica: Replica) -> pb.ModelInferResponse:
        nonlocal started
        attrs = {"meshserve.model": name, "meshserve.model_version": version, "meshserve.replica": replica.endpoint}
        tracing.emit_span("gateway.route", parent, started, time.time_ns(), attrs)  # type: ignore[arg-type]
        started = time.time_ns()
        with tracing.client_span("gateway.upstream", {**attrs, "rpc.system": "grpc",
                                                      "server.address": replica.endpoint}) as span:
            return await forward(replica, tracing.inject_parameters(body, span))

    return await call(name, version, attempt)
