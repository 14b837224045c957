"""spans.py without sockets: the sampler's rules, the export queue's batching and limits, and the
SDK-shaped view of a span that the SDK's exporters read."""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

from meshserve.telemetry import spans as sp
from meshserve.telemetry import tracing
from tests.support import eventually

HALF = 1 << 63  # low 64 bits of a trace id right at ratio 0.5's bound


@pytest.mark.parametrize(("env", "root", "parent_based"), [
    ({}, "on", True),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, "off", False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, "off", True),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}, 0.25, False),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}, 0.1, True),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"}, 1.0, True),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "7"}, 1.0, False),
    ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "on", True),  # unsupported: the SDK's default
])
def test_sampler_from_env(env: dict[str, str], root: Any, parent_based: bool) -> None:
    sampler = sp.Sampler.from_env(env)
    assert sampler.root == root and sampler.parent_based is parent_based


def test_ratio_rule_is_the_sdks() -> None:
    sampler = sp.Sampler(0.5, parent_based=False)
    assert sampler.sample((0xABC << 64) | (HALF - 1), None)
    assert not sampler.sample((0xABC << 64) | HALF, None)  # only the low 64 bits count
    assert sp.Sampler(0.0, False).sample(1, None) is False
    assert sp.Sampler(1.0, False).sample((1 << 128) - 1, None) is True


def test_parent_decides_only_when_parent_based() -> None:
    based = sp.Sampler("off", parent_based=True)
    assert based.sample(1, 0x01) and not based.sample(1, 0x00) and not based.sample(1, None)
    plain = sp.Sampler("on", parent_based=False)
    assert plain.sample(1, 0x00)  # a plain sampler ignores the parent's flag
    assert "ParentBased" in sp.Sampler(0.1, True).description()


class _Keep:
    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[sp.Span]] = []
        self.fail = fail
        self.shut = False

    def export(self, batch: list[sp.Span]) -> SpanExportResult:
        if self.fail:
            raise RuntimeError("collector down")
        self.batches.append(list(batch))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.shut = True


def _span(queue: sp.ExportQueue, i: int = 1) -> sp.Span:
    return sp.Span(f"s{i}", 7, i, 0, False, sp.INTERNAL, time.time_ns(), None, sp.Scope(None, None), queue.on_end)


def test_full_batches_go_out_before_the_delay() -> None:
    keep = _Keep()
    queue = sp.ExportQueue([keep], {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "3"})
    for i in range(7):
        _span(queue, i + 1).end()
    eventually(lambda: sum(map(len, keep.batches)) >= 6, 5)
    assert [len(b) for b in keep.batches][:2] == [3, 3]  # the 7th waits for the delay or a flush
    assert queue.force_flush(5)
    assert [s.span_id for b in keep.batches for s in b] == list(range(1, 8))
    queue.shutdown()
    assert keep.shut


def test_a_full_queue_drops_and_counts_never_blocks() -> None:
    keep = _Keep()
    queue = sp.ExportQueue([keep], {"OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BSP_MAX_QUEUE_SIZE": "4",
                                    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100"})
    with queue._idle:  # (the export thread, woken by the full batch, waits here: the queue stays full)
        for i in range(10):
            _span(queue, i + 1).end()
        assert queue.dropped == 6
    queue.shutdown()  # exports what is queued
    assert [s.span_id for b in keep.batches for s in b] == [1, 2, 3, 4]
    _span(queue, 99).end()  # after shutdown: dropped, not queued
    assert queue.dropped == 7


def test_a_failing_exporter_loses_its_batch_not_the_others() -> None:
    bad, good = _Keep(fail=True), _Keep()
    queue = sp.ExportQueue([bad, good], {"OTEL_BSP_SCHEDULE_DELAY": "10"})
    _span(queue).end()
    assert queue.force_flush(5)
    assert len(good.batches) == 1
    queue.shutdown()


def test_encode_at_end_runs_on_the_ending_thread() -> None:
    seen: list[str] = []

    def encode(span: sp.Span) -> bytes:
        seen.append(threading.current_thread().name)
        return b"x"

    queue = sp.ExportQueue([_Keep()], {}, encode=encode)
    span = _span(queue)
    span.end()
    span.end()  # a second end is ignored
    assert span.encoded == b"x" and seen == [threading.current_thread().name]
    queue.shutdown()


def test_sdk_shaped_view() -> None:
    ended: list[sp.Span] = []
    span = sp.Span("gateway.request", 0xAB, 0xCD, 0xEF, True, sp.SERVER, 100, {"k": "v"}, sp.Scope(None, None),
                   ended.append, flags=1, trace_state="a=b")
    span.set_error("UNAVAILABLE: gone")
    span.end(50)  # before the start: clamped
    assert ended == [span] and span.end_time == 100
    assert span.kind is SpanKind.SERVER and span.status.status_code is StatusCode.ERROR
    assert span.context.trace_id == 0xAB and span.context.trace_state.to_header() == "a=b"
    assert span.parent.span_id == 0xEF and span.parent.is_remote
    assert span.traceparent() == f"00-{0xAB:032x}-{0xCD:016x}-01"
    assert '"name": "gateway.request"' in ConsoleSpanExporter().formatter(span)


@pytest.mark.parametrize(("value", "ok"), [
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", True),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra", False),  # version 00 has 4 parts
    ("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra", True),  # a later version may add
    ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),
    ("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", False),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01", False),
    ("00-zzf7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1", False),
])
def test_parse_traceparent(value: str, ok: bool) -> None:
    assert (tracing.parse_traceparent(value) is not None) is ok


def test_member_lines_round_trip() -> None:
    a = sp.Span("x", 0x1, 0x2, 0, False, sp.CLIENT, 0, None, sp.Scope(None, None), None, trace_state="k=v")
    b = sp.Span("x", 0x3, 0x4, 0, False, sp.CLIENT, 0, None, sp.Scope(None, None), None)
    value = "\n".join([tracing.member_line(a), "", tracing.member_line(b), "garbage"])
    parsed = tracing.parse_member_lines(value, 4)
    assert parsed[0] == tracing.Remote(0x1, 0x2, 1, "k=v") and parsed[1] is None
    assert parsed[2] == tracing.Remote(0x3, 0x4, 1, "") and parsed[3] is None
    assert len(tracing.parse_member_lines(value, 2)) == 2  # never more members than the merge holds
