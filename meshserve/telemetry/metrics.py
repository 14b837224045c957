"""Prometheus text exposition with Triton's metric names.

Rendered at scrape time from counters the processes already keep (no per-request metric
calls on the hot path).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Histogram bucket bounds (upper, inclusive). Latencies in microseconds: 50 us .. 10 s.
LATENCY_BUCKETS_US: tuple[float, ...] = (50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000,
                                         100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000)
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    help: str


class Histogram:
    """Bucket counts kept by the process (one bisect + two adds per observation), rendered at scrape."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_US):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def lines(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out = []
        cumulative = 0
        for bound, c in zip(self.bounds, self.counts, strict=False):
            cumulative += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum:g}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


MODEL_FAMILIES = {
    "request_success": Family("nv_inference_request_success", "counter",
                              "Number of successful inference requests, all batch sizes"),
    "request_failure": Family("nv_inference_request_failure", "counter",
                              "Number of failed inference requests, all batch sizes"),
    "count": Family("nv_inference_count", "counter", "Number of inferences performed (batch rows)"),
    "exec_count": Family("nv_inference_exec_count", "counter", "Number of model executions performed"),
    "request_duration_us": Family("nv_inference_request_duration_us", "counter",
                                  "Cumulative inference request duration in microseconds"),
    "queue_duration_us": Family("nv_inference_queue_duration_us", "counter",
                                "Cumulative inference queuing duration in microseconds"),
    "compute_input_duration_us": Family("nv_inference_compute_input_duration_us", "counter",
                                        "Cumulative compute input duration in microseconds"),
    "compute_infer_duration_us": Family("nv_inference_compute_infer_duration_us", "counter",
                                        "Cumulative compute inference duration in microseconds"),
    "compute_output_duration_us": Family("nv_inference_compute_output_duration_us", "counter",
                                         "Cumulative inference compute output duration in microseconds"),
    "pending_request_count": Family("nv_inference_pending_request_count", "gauge",
                                    "Instantaneous number of pending requests awaiting execution"),
    # meshserve additions (Triton has no histograms under these names; the _us counters above
    # stay cumulative sums as Triton renders them)
    "request_duration_hist": Family("nv_inference_request_duration_histogram_us", "histogram",
                                    "Inference request duration (arrival to response, successes and "
                                    "failures) in microseconds"),
    "queue_duration_hist": Family("nv_inference_queue_duration_histogram_us", "histogram",
                                  "Time a successful request waited in the queue, in microseconds"),
    "compute_duration_hist": Family("nv_inference_compute_duration_histogram_us", "histogram",
                                    "Duration of one model execution (input + infer + output), in microseconds"),
    "batch_size_hist": Family("nv_inference_batch_size", "histogram",
                              "Rows (inferences) per model execution"),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: Iterable[tuple[str, dict[str, str], float | Histogram]], families: dict[str, Family]) -> bytes:
    """samples: (family key, labels, value or Histogram). Families with no sample still get HELP/TYPE."""
    by_family: dict[str, list[str]] = {k: [] for k in families}
    for key, labels, value in samples:
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        if isinstance(value, Histogram):
            by_family.setdefault(key, []).extend(value.lines(families[key].name, lab))
        else:
            by_family.setdefault(key, []).append(f"{families[key].name}{{{lab}}} {value:g}")
    lines: list[str] = []
    for key, fam in families.items():
        lines.append(f"# HELP {fam.name} {fam.help}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        lines.extend(by_family.get(key, []))
    return ("\n".join(lines) + "\n").encode()
