"""A/B routes, pure: a route name addressable like a model splits traffic among {model, version}
targets by integer weights, optionally sticky by a request header, optionally mirroring a share
to a shadow target. No I/O: callers pass the headers and a random number.

`routes.yaml` (pydantic-validated; the gateway re-reads it when it changes):

    routes:
      - name: scale-ab                 # clients call /v2/models/scale-ab/infer (gRPC model_name)
        targets:
          - {model: scale, version: "1", weight: 90}
          - {model: scale, version: "2", weight: 10, arm: canary}   # arm: default "model:version"
        sticky: x-user-id              # optional header / gRPC metadata name: same value, same arm
        shadow: {model: scale, version: "2", share: 0.05}   # optional: a copy of 5% of requests
"""
from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.routing.routes_file import RoutesFile, RouteSpec, Shadow, Target

HASH_SPACE = 2**64


def parse_routes(text: str, source: str = "routes.yaml") -> RoutesFile:
    from gateway.routing.routes_file import (
        parse,  # (pydantic and yaml only with such a file: docs/perf/suite-time.md)
    )

    return parse(text, source)


def stable_hash(*parts: str) -> int:
    """A hash that is the same in every process and run (Python's hash() is salted)."""
    h = hashlib.blake2b("\0".join(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


@dataclass(frozen=True)
class Choice:
    target: Target
    shadow: Shadow | None  # set when this request is also mirrored


class Route:
    """A compiled route: cumulative weights for O(log n) choice."""

    def __init__(self, spec: RouteSpec):
        self.spec = spec
        self.name = spec.name
        live = [t for t in spec.targets if t.weight > 0]
        self.targets = live
        self.total = sum(t.weight for t in live)
        self._cumulative: list[int] = []
        acc = 0
        for t in live:
            acc += t.weight
            self._cumulative.append(acc)

    def target_at(self, point: int) -> Target:
        """The target owning `point` in [0, total)."""
        return self.targets[bisect.bisect_right(self._cumulative, point % self.total)]

    def choose(self, headers: dict[str, str], u1: float, u2: float) -> Choice:
        """Pick the arm: by the sticky header's stable hash when present, else by `u1` in [0, 1).
        The shadow copy is taken for a `share` of requests (by `u2`, or the sticky hash)."""
        key = headers.get(self.spec.sticky) if self.spec.sticky else None
        if key is not None:
            h = stable_hash(self.name, key)
            target = self.target_at(h % self.total)
            u2 = stable_hash(self.name, "shadow", key) / HASH_SPACE
        else:
            target = self.target_at(int(u1 * self.total))
        shadow = self.spec.shadow
        return Choice(target, shadow if shadow is not None and u2 < shadow.share else None)


class Routes:
    """All routes by name (a snapshot; the gateway swaps in a new one on reload)."""

    def __init__(self, spec: RoutesFile):
        self.by_name = {r.name: Route(r) for r in spec.routes}

    def get(self, name: str) -> Route | None:
        return self.by_name.get(name)
