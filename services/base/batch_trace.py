"""Spans for one executed batch, recorded after the fact from timestamps the batch already takes.

Only called when tracing is on and at least one member request is sampled. Per sampled
request (a gateway-merged request brings one span per traced client request):
``service.queue`` (arrival to batch start, child of the request span). Per batch:
``service.batch`` (child of the first sampled member, *linked* to every sampled member's
request span; attributes batch size in rows, request count, instance index). Per executed
group: ``service.compute`` (the runtime's run call, child of the batch span).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshserve.telemetry import tracing
from services.base.scheduling.request import QueuedRequest

Timing = tuple[int, int, int]  # (input, infer, output) ns


def traced(batch: Sequence[QueuedRequest]) -> bool:
    """Whether any request of ``batch`` is sampled (the batch then gets its spans)."""
    for q in batch:  # a loop, not any(<generator>): this runs for every batch while tracing is on
        if getattr(q.payload, "spans", None):
            return True
    return False


def record(model: str, version: str, instance: int, batch: Sequence[QueuedRequest],
           results: Sequence[tuple[Sequence[QueuedRequest], Any, Timing]], start_ns: int, end_ns: int) -> None:
    """``start_ns``/``end_ns``: monotonic ns around the batch; results: (group, bodies or exception, timing)."""
    members = [(q, span) for q in batch for span in getattr(q.payload, "spans", ())]
    if not members:
        return
    off = tracing.epoch_offset_ns()
    base = tracing.fixed_attributes(("meshserve.model", model), ("meshserve.model_version", version))
    queued_at = start_ns + off
    for q, span in members:
        tracing.emit_span("service.queue", span, q.arrival_ns + off, queued_at, fixed=base)
    failures = [out for _, out, _ in results if isinstance(out, BaseException)]
    error = f"{type(failures[0]).__name__}: {failures[0]}" if failures else None
    batch_span = tracing.emit_span(
        "service.batch", members[0][1], start_ns + off, end_ns + off,
        {"meshserve.batch.size": sum(q.rows for q in batch),
         "meshserve.batch.requests": sum(getattr(q.payload, "requests", 1) for q in batch),  # client requests
         "meshserve.instance": instance},
        links=[span for _, span in members], error=error, fixed=base)
    cursor = end_ns  # groups ran one after another; walk back from the end of the batch
    for group, out, (t_in, t_infer, t_out) in reversed(results):
        compute_end = cursor - t_out
        tracing.emit_span("service.compute", batch_span, compute_end - t_infer + off, compute_end + off,
                          {"meshserve.batch.size": sum(q.rows for q in group)},
                          error=f"{type(out).__name__}: {out}" if isinstance(out, BaseException) else None,
                          fixed=base)
        cursor -= t_in + t_infer + t_out
