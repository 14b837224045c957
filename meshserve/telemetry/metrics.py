"""Prometheus text exposition with Triton's metric names.

Rendered at scrape time from counters the processes already keep (no per-request metric
calls on the hot path).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge
    help: str


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
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: Iterable[tuple[str, dict[str, str], float]], families: dict[str, Family]) -> bytes:
    """samples: (family key, labels, value). Families with no sample still get HELP/TYPE."""
    by_family: dict[str, list[str]] = {k: [] for k in families}
    for key, labels, value in samples:
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        by_family.setdefault(key, []).append(f"{families[key].name}{{{lab}}} {value:g}")
    lines: list[str] = []
    for key, fam in families.items():
        lines.append(f"# HELP {fam.name} {fam.help}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        lines.extend(by_family.get(key, []))
    return ("\n".join(lines) + "\n").encode()
