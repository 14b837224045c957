"""A client's streamed request forwarded to a service (``Upstream.stream``), as an async generator.

mypyc does not compile async generators, so this body lives here, always interpreted, and
``gateway/upstream/upstream.py:Upstream.stream`` (a plain method) returns it: upstream.py can
then be compiled (docs/perf/native.md) with the same behaviour in pure Python.
"""
from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.telemetry import tracing

if TYPE_CHECKING:
    from gateway.upstream.upstream import Upstream


async def answers(upstream: Upstream, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                  affinity: str | None = None, client_stream: str | None = None
                  ) -> AsyncGenerator[tuple[pb.ModelInferResponse | None, bool], None]:
    """Every answer of the service as it arrives, (response or None for an empty final one,
    final); leaving early (the client went away) tells the service to stop the request.

    The requests of one client stream (``client_stream``) go over one hop stream of the replica,
    written in the order they came (the hop stream never lets a later request overtake an
    earlier one, even while it opens), so a decoupled model's batch holds them in the client's
    order, as Triton's scheduler gets them; round robin over the hop streams put two requests
    on two streams, one still opening, and the second ran first. A sequence keeps its own key."""
    hop_key = affinity if affinity is not None else client_stream
    body = hop.with_stream(raw if raw is not None else request.SerializeToString())
    if tracing.enabled and (span := tracing.current_var.get()) is not None:
        body = tracing.inject_parameters(body, span)  # the service's span is this request's child
    answers = await upstream.call(request.model_name, request.model_version,
                                  lambda r: r.streams.open(body, request.id, timeout, hop_key), affinity)
    try:
        while True:
            response, final = await answers.next()
            yield response, final
            if final:
                return
    finally:
        answers.close()
