"""Scrape-time cost of /metrics: meshserve's text renderer against prometheus_client, and the
gateway's text-level federation against prometheus_client's parser (meshserve/telemetry/metrics.py
cites the numbers). Run: python -m load.bench.metrics_render [MODEL_VERSIONS ...]"""
from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from meshserve.telemetry import metrics
from meshserve.telemetry.model_stats import ModelStats


def _stats(n: int) -> list[ModelStats]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        s = ModelStats(f"model_{i}", 1)
        for _ in range(200):
            s.record_batch(rng.randint(1, 8), 2, 1000, rng.randint(10_000, 5_000_000), 1000)
            s.record_success(rng.randint(10_000, 9_000_000), rng.randint(100, 100_000))
        s.record_failure(5000, "OTHER")
        s.load_duration_s = 0.5
        out.append(s)
    return out


class _Families:
    """The same samples as prometheus_client metric families, for generate_latest."""

    def __init__(self, samples: list[metrics.Sample]):
        self.samples = samples

    def collect(self) -> list[Metric]:
        fams = metrics.MODEL_FAMILIES
        out = {key: Metric(f.name, f.help, f.kind) for key, f in fams.items()}
        for key, labels, value in self.samples:
            m = out[key]
            if isinstance(value, metrics.Histogram):
                cumulative = 0
                for bound, c in zip(value.bounds, value.counts, strict=False):
                    cumulative += c
                    m.add_sample(m.name + "_bucket", {**labels, "le": f"{bound:g}"}, cumulative)
                m.add_sample(m.name + "_bucket", {**labels, "le": "+Inf"}, value.count)
                m.add_sample(m.name + "_sum", labels, value.sum)
                m.add_sample(m.name + "_count", labels, value.count)
            else:
                m.add_sample(m.name, labels, value)
        return list(out.values())


def _ms(fn: Callable[[], Any], reps: int = 10) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def _measure(n: int) -> str:
    stats = _stats(n)

    def samples() -> list[metrics.Sample]:
        return [x for s in stats for x in s.samples({"model": s.name, "version": "1"})]

    text = metrics.render(samples(), metrics.MODEL_FAMILIES).decode()
    ours = _ms(lambda: metrics.render(samples(), metrics.MODEL_FAMILIES))
    theirs = _ms(lambda: generate_latest(_Families(samples())))  # type: ignore[arg-type]
    fed = _ms(lambda: metrics.federate(text, {"replica": "127.0.0.1:8001"}))
    parse = _ms(lambda: list(text_string_to_metric_families(text)))
    return (f"{n} model versions ({text.count(chr(10))} lines): render {ours:.2f} ms, prometheus_client "
            f"generate_latest {theirs:.2f} ms; federate {fed:.2f} ms, prometheus_client parser {parse:.2f} ms")


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [20, 100]:
        print(_measure(n))


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main(sys.argv[1:])
