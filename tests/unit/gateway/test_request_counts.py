"""gateway/core.py:RequestCounts: the request counts by (model, outcome) stay bounded whatever
names clients make up, and keep every request counted."""
from __future__ import annotations

from gateway.core import OTHER_MODELS, RequestCounts


def test_names_not_served_are_folded_past_the_bound_and_every_request_stays_counted() -> None:
    counts = RequestCounts(lambda name: name in ("m1", "m2"), limit=8)
    for name in ("m1", "m2"):
        counts[(name, "OK")] += 3
    for i in range(100):
        counts[(f"made-up-{i}", "403")] += 1
        assert len(counts) <= 8 + 1
    assert counts[("m1", "OK")] == 3 and counts[("m2", "OK")] == 3  # names it serves keep their label
    assert sum(counts.values()) == 106
    assert counts[(OTHER_MODELS, "403")] + sum(n for (m, _), n in counts.items() if m.startswith("made-up")) == 100
    counts[("m1", "OK")] += 1  # a key already counted: a Counter's own operations
    assert counts[("m1", "OK")] == 4


def test_the_bound_grows_when_every_name_is_served() -> None:
    counts = RequestCounts(lambda name: True, limit=4)
    for i in range(50):
        counts[(f"m{i}", "OK")] += 1
    assert len(counts) == 50 and OTHER_MODELS not in {m for m, _ in counts} and counts.limit >= 50
