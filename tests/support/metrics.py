"""Prometheus /metrics as the tests read it: every sample by (name, labels)."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def scrape(hostport: str) -> Samples:
    """GET http://HOSTPORT/metrics, parsed: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://{hostport}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
            if family.type == "counter" and s.name == family.name + "_total":
                # the parser appends _total to counters named without it (Triton's nv_* names)
                out[(family.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (asserted to exist)."""
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    assert found, f"no sample {name}{labels}"
    return sum(found)


def metric(hostport: str, name: str, **labels: str) -> float:
    """One scrape of HOSTPORT's /metrics: ``sample(scrape(hostport), name, **labels)``."""
    return sample(scrape(hostport), name, **labels)
