"""A/B route choice, pure: weights over 10,000 requests, sticky keys, shadow share, validation."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.routing.ab import Route, Routes, parse_routes

ROUTES = """
routes:
  - name: scale-ab
    targets:
      - {model: scale, version: 1, weight: 70}
      - {model: scale, version: "2", weight: 20, arm: canary}
      - {model: other, weight: 10}
    sticky: X-User-Id
    shadow: {model: scale, version: 2, share: 0.25}
  - name: plain
    targets: [{model: a, weight: 1}, {model: b, weight: 3}, {model: c, weight: 0}]
"""


def route(name: str) -> Route:
    r = Routes(parse_routes(ROUTES)).get(name)
    assert r is not None
    return r


def test_weights_hold_within_2_percent_over_10000_requests() -> None:
    rng = random.Random(7)
    for name, expected in (("scale-ab", {"scale:1": 0.7, "canary": 0.2, "other": 0.1}),
                           ("plain", {"a": 0.25, "b": 0.75})):
        r = route(name)
        counts = Counter(r.choose({}, rng.random(), rng.random()).target.name for _ in range(10_000))
        assert set(counts) == set(expected)  # a weight-0 target never answers
        for arm, share in expected.items():
            assert abs(counts[arm] / 10_000 - share) <= 0.02, (arm, counts)


def test_sticky_keys_are_stable_and_still_split_by_weight() -> None:
    r = route("scale-ab")
    first = {f"user-{i}": r.choose({"x-user-id": f"user-{i}"}, 0.0, 0.0).target.name for i in range(10_000)}
    rng = random.Random(1)
    for i in range(0, 10_000, 97):  # the random numbers do not matter once a key is present
        key = f"user-{i}"
        assert r.choose({"x-user-id": key}, rng.random(), rng.random()).target.name == first[key]
    counts = Counter(first.values())
    assert abs(counts["scale:1"] / 10_000 - 0.7) <= 0.02
    assert abs(counts["canary"] / 10_000 - 0.2) <= 0.02
    # the same user also always is (or is not) mirrored
    shadowed = [r.choose({"x-user-id": f"user-{i}"}, 0.0, 0.0).shadow is not None for i in range(10_000)]
    assert abs(sum(shadowed) / 10_000 - 0.25) <= 0.02


def test_shadow_share() -> None:
    r = route("scale-ab")
    rng = random.Random(3)
    picks = [r.choose({}, rng.random(), rng.random()) for _ in range(10_000)]
    share = sum(p.shadow is not None for p in picks) / 10_000
    assert abs(share - 0.25) <= 0.02
    shadow = next(p.shadow for p in picks if p.shadow is not None)
    assert shadow is not None and (shadow.model, shadow.version) == ("scale", "2")
    assert route("plain").choose({}, 0.5, 0.0).shadow is None


@pytest.mark.parametrize("text,fragment", [
    ("routes: [{name: r, targets: []}]", "targets"),
    ("routes: [{name: r, targets: [{model: a, weight: 0}]}]", "add up to 0"),
    ("routes: [{name: r, targets: [{model: a, weight: -1}]}]", "weight"),
    ("routes: [{name: r, targets: [{model: a, version: x}]}]", "not a number"),
    ("routes: [{name: r, targets: [{model: a}, {model: a}]}]", "arm name"),
    ("routes: [{name: r, targets: [{model: a}]}, {name: r, targets: [{model: b}]}]", "twice"),
    ("routes: [{name: r, targets: [{model: a}], shadow: {model: b, share: 2}}]", "share"),
    ("routes: [{name: r, targets: [{model: a}], bogus: 1}]", "bogus"),
    ("routes: [{name: ../r, targets: [{model: a}]}]", "one path component"),
    ("routes: [{name: r, targets: [{model: /tmp/a}]}]", "one path component"),
    ("routes: [{name: r, targets: [{model: a}], shadow: {model: '..'}}]", "one path component"),
])
def test_invalid_routes_are_rejected_with_the_reason(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_routes(text)
