"""otlp_loop.py: which endpoints it serves, and export from the event loop to a real OTLP/gRPC
receiver (grpcio's server with the collector's TraceService from opentelemetry-proto)."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from meshserve.server.process import OTLP_TRANSPORT
from meshserve.telemetry import otlp_loop
from meshserve.telemetry import spans as sp
from meshserve.telemetry.otlp_encode import encode_encoded, encode_record, encode_span
from tests.support import eventually_async


@pytest.mark.parametrize(("env", "want"), [
    ({}, ("localhost:4317", (), 10.0)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ("collector:4317", (), 10.0)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector"}, ("collector:4317", (), 10.0)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:2"},
     ("b:2", (), 10.0)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
     ("collector:4317", (), 10.0)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%20t,X-Tenant=a",
      "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5"}, ("c:4317", (("api-key", "s t"), ("x-tenant", "a")), 2.5)),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317"}, None),  # TLS: the SDK's exporter
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, None),  # bare host:port is TLS by default
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem"}, None),
])
def test_target_from_env(env: dict[str, str], want: tuple | None) -> None:
    target = otlp_loop.target_from_env(env)
    if want is None:
        assert target is None
    else:
        assert target is not None and (target.endpoint, target.headers, target.timeout_s) == want


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, fail_with: grpc.StatusCode | None = None) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.fail_with = fail_with
        self.calls = 0

    def Export(self, request, context):  # the collector's RPC name
        self.calls += 1
        if self.fail_with is not None:
            context.abort(self.fail_with, "not today")
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self) -> list[str]:
        return [s.name for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


@pytest.fixture
def receiver() -> Iterator[tuple[_Receiver, int]]:
    servicer = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


SCOPE = sp.Scope(Resource.create({"service.name": "t"}), InstrumentationScope("meshserve"))


def _queue(port: int, **env: str) -> otlp_loop.LoopExportQueue:
    target = otlp_loop.Target(f"127.0.0.1:{port}", (("x-key", "k"),), 5.0)
    return otlp_loop.LoopExportQueue(target, env, encode_span, encode_encoded, encode_record, OTLP_TRANSPORT)


def _end(queue: otlp_loop.LoopExportQueue, i: int) -> None:
    sp.Span(f"s{i}", 0x42, i, 0, False, sp.INTERNAL, time.time_ns(), {"i": i}, SCOPE, queue.on_end).end()


def test_full_batches_go_at_once_the_rest_after_the_delay(receiver: tuple[_Receiver, int]) -> None:
    servicer, port = receiver
    queue = _queue(port, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="4", OTEL_BSP_SCHEDULE_DELAY="300")

    async def main() -> float:
        for i in range(10):
            _end(queue, i)
        await eventually_async(lambda: len(servicer.names()) >= 8)  # two full batches, no waiting for the delay
        t0 = time.monotonic()
        await eventually_async(lambda: len(servicer.names()) == 10)  # the last two after the schedule delay
        waited = time.monotonic() - t0
        # the receiver records an export before its answer reaches the queue: wait for the answer
        # (or a drop) before the loop closes, then check which it was
        await eventually_async(lambda: queue.exported + queue.dropped >= 10)
        return waited

    waited = asyncio.run(main())
    assert 0.1 < waited < 3
    assert servicer.names() == [f"s{i}" for i in range(10)]
    assert [len(r.resource_spans[0].scope_spans[0].spans) for r in servicer.requests] == [4, 4, 2]
    assert servicer.metadata[0]["x-key"] == "k" and queue.exported == 10 and queue.dropped == 0


def test_spans_left_at_exit_are_sent_from_a_loop_of_their_own(receiver: tuple[_Receiver, int]) -> None:
    servicer, port = receiver
    queue = _queue(port, OTEL_BSP_SCHEDULE_DELAY="60000")

    async def main() -> None:
        for i in range(3):
            _end(queue, i)
        queue.defer(_end, queue, 3)  # recorded after the fact: still waiting when the loop ends

    asyncio.run(main())  # the serving loop is gone, the spans still queued
    assert servicer.names() == []
    queue.shutdown()
    assert sorted(servicer.names()) == ["s0", "s1", "s2", "s3"]
    _end(queue, 9)  # after shutdown: dropped, counted
    assert queue.dropped == 1


def test_a_rejecting_collector_drops_the_batch_without_retries(receiver: tuple[_Receiver, int]) -> None:
    servicer, port = receiver
    servicer.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    queue = _queue(port, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="2")

    async def main() -> None:
        _end(queue, 1)
        _end(queue, 2)
        await eventually_async(lambda: queue.dropped == 2)

    asyncio.run(main())
    assert servicer.calls == 1  # INVALID_ARGUMENT is not transient


def test_unreachable_collector_retries_then_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otlp_loop, "BACKOFF_S", (0.01, 0.01))
    with socket_bound() as port:  # a port nothing listens on
        queue = _queue(port, OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1", OTEL_BSP_MAX_QUEUE_SIZE="3")

        async def main() -> None:
            for i in range(5):
                _end(queue, i)  # queue of 3: the 4th and 5th may be dropped at once
            await eventually_async(lambda: queue.dropped == 5)

        asyncio.run(main())
        assert queue.exported == 0


def test_a_span_ended_off_the_loop_thread_is_still_sent(receiver: tuple[_Receiver, int]) -> None:
    servicer, port = receiver
    queue = _queue(port, OTEL_BSP_SCHEDULE_DELAY="50")

    async def main() -> None:
        _end(queue, 1)  # binds the queue to this loop
        worker = threading.Thread(target=_end, args=(queue, 2))
        worker.start()
        worker.join()
        await eventually_async(lambda: len(servicer.names()) == 2)

    asyncio.run(main())


def test_spans_ended_on_a_later_loop_are_sent_from_it(receiver: tuple[_Receiver, int]) -> None:
    """A process may run more than one event loop in turn (tests, a CLI): spans that end on the
    second loop, while an encode was still due on the first (now closed), go out from the second."""
    servicer, port = receiver
    queue = _queue(port, OTEL_BSP_SCHEDULE_DELAY="20")

    async def first() -> None:
        _end(queue, 1)  # schedules an encode on this loop, which closes before it is due

    async def second() -> None:
        _end(queue, 2)
        _end(queue, 3)
        await eventually_async(lambda: len(servicer.names()) == 3)
        # (the collector has them before its answer arrives: an export still awaiting it when the
        # loop ends is cancelled and counts its spans as dropped, so wait for the answer too)
        await eventually_async(lambda: queue.exported == 3)

    asyncio.run(first())
    asyncio.run(second())
    assert queue.dropped == 0


class socket_bound:  # a context manager named for what it holds
    """A bound, not listening, TCP port: connections to it are refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_a_loop_closed_with_its_export_timer_pending_does_not_hold_up_the_next(receiver: tuple[_Receiver, int]) -> None:
    """The first loop encodes span 1 and arms the schedule-delay timer, then closes before it is
    due: that timer never fires, and the second loop's spans must not wait on it (they did: the
    queue saw a timer and armed none, and nothing was sent again)."""
    servicer, port = receiver
    queue = _queue(port, OTEL_BSP_SCHEDULE_DELAY="300")

    async def first() -> None:
        _end(queue, 1)
        await eventually_async(lambda: queue.queued())  # encoded: the 300 ms timer is armed on this loop

    async def second() -> None:
        _end(queue, 2)
        _end(queue, 3)
        await eventually_async(lambda: sorted(servicer.names()) == ["s1", "s2", "s3"])
        await eventually_async(lambda: queue.exported == 3)

    asyncio.run(first())
    asyncio.run(second())
    assert queue.dropped == 0


def test_the_next_loop_exports_on_a_connection_of_its_own(receiver: tuple[_Receiver, int]) -> None:
    """An export on the first loop leaves its connection behind, bound to that (closed) loop: the
    second loop's export must open its own."""
    servicer, port = receiver
    queue = _queue(port, OTEL_BSP_SCHEDULE_DELAY="20", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1")

    async def run(i: int) -> None:
        _end(queue, i)
        await eventually_async(lambda: queue.exported == i, what=f"span {i} exported")

    asyncio.run(run(1))
    asyncio.run(run(2))
    assert servicer.names() == ["s1", "s2"] and queue.dropped == 0


def test_an_export_cut_short_by_its_loop_closing_counts_its_spans_as_dropped() -> None:
    """A collector that accepts and never answers: the loop closes (asyncio.run ends) with the
    export in flight; its span is counted once, as dropped, not lost from the counts."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # listening, never answering
        queue = _queue(silent.getsockname()[1], OTEL_BSP_SCHEDULE_DELAY="20", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="1")

        async def main() -> None:
            _end(queue, 1)
            await eventually_async(lambda: not queue.queued() and queue.deferred_jobs() == 0
                                   and queue._sending)  # taken for export, in flight

        asyncio.run(main())
        assert (queue.exported, queue.dropped) == (0, 1)
