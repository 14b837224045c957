"""Prometheus text exposition with Triton's metric names, rendered at scrape time.

The processes keep plain counters and Histogram bucket arrays (no per-request metric calls on
the hot path); a scrape writes them as text here. Written by hand rather than through
prometheus_client's families + generate_latest, on a measurement (`python -m
load.bench.metrics_render`, 2-core dev VM, load average ~6 from other work, 2026-11-25): 20 model
versions (1,992 lines) render in 1.9 ms here against 13.9 ms through prometheus_client, 100
versions (9,832 lines) in 5.4 ms against 51 ms (quieter runs: 1.0 vs 11 ms, 11 vs 117 ms): time
spent on the event loop that serves requests. (generate_latest would also name Triton's
counters `<name>_total` in their HELP/TYPE lines.) prometheus_client's parser reads what we
write (the tests parse every scrape with it).

``federate`` takes another meshserve process's exposition and adds a label to every sample by
string replacement (20 versions: 2.4 ms; 100: 4.4 ms), where prometheus_client's parser alone
takes 30 ms and 182 ms, so a gateway can serve its services' families, merged by name with its
own (``render(..., federated=...)``).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Histogram bucket bounds (upper, inclusive). Latencies in microseconds: 50 us .. 10 s; every bound
# of FIRST_RESPONSE_BUCKETS_MS (times 1000) is one of them, so that histogram is derived at scrape.
LATENCY_BUCKETS_US: tuple[float, ...] = (50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000,
                                         100_000, 250_000, 500_000, 1_000_000, 2_000_000, 2_500_000,
                                         5_000_000, 10_000_000)
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FIRST_RESPONSE_BUCKETS_MS: tuple[float, ...] = (100, 500, 2000, 5000)  # Triton's default buckets


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

    def rescaled(self, bounds: Sequence[float], scale: float) -> Histogram:
        """The same observations in another unit (value / ``scale``) over coarser ``bounds``;
        each bound times ``scale`` must be one of this histogram's bounds."""
        out = Histogram(bounds)
        start = 0
        for k, bound in enumerate(out.bounds):
            end = self.bounds.index(bound * scale) + 1
            out.counts[k] = sum(self.counts[start:end])
            start = end
        out.counts[-1] = sum(self.counts[start:])
        out.sum, out.count = self.sum / scale, self.count
        return out

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
    "first_response_hist": Family("nv_inference_first_response_histogram_ms", "histogram",
                                  "Duration from request to first response in milliseconds"),
    "load_duration": Family("nv_model_load_duration_secs", "gauge", "Model load time in seconds"),
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
Sample = tuple[str, dict[str, str], "float | Histogram"]  # (family key, labels, value or Histogram)
# another process's families: name -> (HELP/TYPE lines, sample lines), see federate()
Federated = dict[str, tuple[list[str], list[str]]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: Iterable[Sample], families: dict[str, Family], federated: Iterable[Federated] = ()) -> bytes:
    """samples: (family key, labels, value or Histogram). Families with no sample still get HELP/TYPE.
    ``federated`` families join the family of the same name (or follow, with their own header)."""
    by_family: dict[str, list[str]] = {k: [] for k in families}
    for key, labels, value in samples:
        lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        if isinstance(value, Histogram):
            by_family.setdefault(key, []).extend(value.lines(families[key].name, lab))
        else:
            shown = value if type(value) is int else format(value, "g")  # an int whole (bytes, counts past 1e6)
            by_family.setdefault(key, []).append(f"{families[key].name}{{{lab}}} {shown}")
    blocks: dict[str, tuple[list[str], list[str]]] = {
        fam.name: ([f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} {fam.kind}"], by_family[key])
        for key, fam in families.items()}
    for group in federated:
        for name, (header, lines) in group.items():
            block = blocks.get(name)
            if block is None:
                blocks[name] = (header, list(lines))  # a copy: ``federated`` is reused across scrapes
            else:
                block[1].extend(lines)
    out: list[str] = []
    for header, lines in blocks.values():
        out += header
        out += lines
    return ("\n".join(out) + "\n").encode()


def family_names(text: str) -> list[str]:
    """The family names of an exposition as ``render`` writes it (one HELP line each)."""
    return [block.split(" ", 1)[0] for block in ("\n" + text).split("\n# HELP ")[1:]]


def is_model_defined(name: str) -> bool:
    """A family a model made (a python model's pb_utils.MetricFamily), not Triton's or meshserve's."""
    return not name.startswith(("nv_", "meshserve_"))


def federate(text: str, labels: dict[str, str], bare: frozenset[str] = frozenset()) -> Federated:
    """The families of another meshserve process's exposition (as ``render`` writes it: a HELP
    and a TYPE line, then samples named after the family, or its _bucket/_sum/_count), each
    sample with ``labels`` added first, but the samples of the families named in ``bare``, which
    keep their own labels. Plain string replacement, no parsing (see the module docstring for
    what that saves)."""
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    out: Federated = {}
    for block in ("\n" + text).split("\n# HELP ")[1:]:
        help_line, _, body = block.partition("\n")
        name = help_line.split(" ", 1)[0]
        header = ["# HELP " + help_line]
        if body.startswith("# TYPE "):
            type_line, _, body = body.partition("\n")
            header.append(type_line)
        body = "\n" + body
        for prefix in (name, name + "_bucket", name + "_sum", name + "_count") if name not in bare else ():
            at = "\n" + prefix
            body = body.replace(at + "{", at + "{" + extra + ",").replace(at + "{" + extra + ",}", at + "{" + extra + "}") \
                       .replace(at + " ", at + "{" + extra + "} ")
        lines = [line for line in body.split("\n") if line and not line.startswith("#")]
        if name in out:
            out[name][1].extend(lines)
        else:
            out[name] = (header, lines)
    return out
