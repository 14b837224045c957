"""Per model-version statistics in Triton's shape (statistics extension + nv_* metrics), kept by
the services for their models and by the gateway for the ensembles it runs.

Updated only on the event loop (after a batch returns from its worker thread), so no locks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.telemetry.metrics import BATCH_SIZE_BUCKETS, FIRST_RESPONSE_BUCKETS_MS, Histogram, Sample

# Triton's nv_inference_request_failure reasons, always rendered (0 until one happens). We use
# OTHER for invalid requests (and every failed ensemble request, as Triton does), REJECTED for a
# full queue, BACKEND for failed executions, and also TIMEOUT (queue deadline) when it occurs.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns

    def to_pb(self) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=self.count, ns=self.ns)


@dataclass(slots=True)
class BatchDurations:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStats:
    """Counters for one (model, version)."""

    name: str
    version: int
    last_inference_ms: int = 0
    inference_count: int = 0  # batch rows
    execution_count: int = 0  # model executions
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchDurations] = field(default_factory=dict)
    fail_reasons: dict[str, int] = field(default_factory=dict)
    pending: int = 0
    load_duration_s: float = 0.0  # nv_model_load_duration_secs (0: not measured)
    # /metrics histograms (microseconds; batch size in rows), updated with the counters above
    request_hist: Histogram = field(default_factory=Histogram)
    queue_hist: Histogram = field(default_factory=Histogram)
    compute_hist: Histogram = field(default_factory=Histogram)
    batch_hist: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))

    def record_batch(self, batch_rows: int, n_requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.execution_count += 1
        self.inference_count += batch_rows
        self.compute_input.add(input_ns * n_requests, n_requests)
        self.compute_infer.add(infer_ns * n_requests, n_requests)
        self.compute_output.add(output_ns * n_requests, n_requests)
        b = self.batches.get(batch_rows)
        if b is None:
            b = self.batches[batch_rows] = BatchDurations()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        self.compute_hist.observe((input_ns + infer_ns + output_ns) / 1000)
        self.batch_hist.observe(batch_rows)
        self.last_inference_ms = int(time.time() * 1000)

    def record_success(self, request_ns: int, queue_ns: int, requests: int = 1) -> None:
        self.success.add(request_ns * requests, requests)
        self.queue.add(queue_ns * requests, requests)
        self.request_hist.observe(request_ns / 1000, requests)
        self.queue_hist.observe(queue_ns / 1000, requests)

    def record_successes(self, end_ns: int, start_ns: int, members: list[tuple[int, int]]) -> None:
        """record_success for each (arrival ns, client requests) of ``members``: one batch's
        answered requests, its run started at ``start_ns`` and done at ``end_ns`` (one call per
        batch on the service's event loop instead of one per request)."""
        success, queue = self.success, self.queue
        observe_request, observe_queue = self.request_hist.observe, self.queue_hist.observe
        for arrival_ns, n in members:
            request_ns, queue_ns = end_ns - arrival_ns, start_ns - arrival_ns
            success.count += n
            success.ns += request_ns * n
            queue.count += n
            queue.ns += queue_ns * n
            observe_request(request_ns / 1000, n)
            observe_queue(queue_ns / 1000, n)

    def record_failure(self, request_ns: int, reason: str, requests: int = 1) -> None:
        self.fail.add(request_ns * requests, requests)
        self.fail_reasons[reason] = self.fail_reasons.get(reason, 0) + requests
        self.request_hist.observe(request_ns / 1000, requests)

    def to_pb(self) -> pb.ModelStatistics:
        return pb.ModelStatistics(
            name=self.name,
            version=str(self.version),
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
            inference_stats=pb.InferStatistics(
                success=self.success.to_pb(), fail=self.fail.to_pb(), queue=self.queue.to_pb(),
                compute_input=self.compute_input.to_pb(), compute_infer=self.compute_infer.to_pb(),
                compute_output=self.compute_output.to_pb(),
                cache_hit=pb.StatisticDuration(), cache_miss=pb.StatisticDuration()),
            batch_stats=[
                pb.InferBatchStatistics(batch_size=size, compute_input=b.compute_input.to_pb(),
                                        compute_infer=b.compute_infer.to_pb(),
                                        compute_output=b.compute_output.to_pb())
                for size, b in sorted(self.batches.items())],
        )

    def samples(self, labels: dict[str, str]) -> list[Sample]:
        """This version's nv_* metric samples (metrics.MODEL_FAMILIES keys), built at scrape."""
        out: list[Sample] = [
            ("request_success", labels, self.success.count),
            ("count", labels, self.inference_count),
            ("exec_count", labels, self.execution_count),
            ("request_duration_us", labels, (self.success.ns + self.fail.ns) // 1000),
            ("queue_duration_us", labels, self.queue.ns // 1000),
            ("compute_input_duration_us", labels, self.compute_input.ns // 1000),
            ("compute_infer_duration_us", labels, self.compute_infer.ns // 1000),
            ("compute_output_duration_us", labels, self.compute_output.ns // 1000),
            ("pending_request_count", labels, self.pending),
            # a request's first (and only) response is its end: the request histogram in Triton's
            # unit and buckets, derived here so that a request pays for one histogram, not two
            ("first_response_hist", labels, self.request_hist.rescaled(FIRST_RESPONSE_BUCKETS_MS, 1000)),
            ("request_duration_hist", labels, self.request_hist),
            ("queue_duration_hist", labels, self.queue_hist),
            ("compute_duration_hist", labels, self.compute_hist),
            ("batch_size_hist", labels, self.batch_hist),
        ]
        if self.load_duration_s:
            out.append(("load_duration", labels, self.load_duration_s))
        reasons = self.fail_reasons
        for reason in (*FAILURE_REASONS, *(r for r in reasons if r not in FAILURE_REASONS)):
            # (labels in name order, as Triton's prometheus-cpp writes them: model, reason, version)
            out.append(("request_failure", dict(sorted({**labels, "reason": reason}.items())), reasons.get(reason, 0)))
        return out
