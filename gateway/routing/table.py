"""The routing table: model -> version -> replicas hosting it. Pure data, no I/O."""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from meshserve.protocol.errors import InferError, model_not_found


class Balanced(Protocol):
    outstanding: int
    healthy: bool


R = TypeVar("R", bound=Balanced)


@dataclass
class ModelRoutes(Generic[R]):
    name: str
    versions: dict[int, list[R]] = field(default_factory=dict)

    def replicas_for(self, version: str) -> list[R]:
        """Healthy replicas serving `version` ("" = the highest version any healthy replica has)."""
        if version:
            try:
                v = int(version)
            except ValueError:
                raise InferError.invalid(f"model '{self.name}': version '{version}' is not a number") from None
            if v not in self.versions:
                raise model_not_found(self.name, version)
            healthy = [r for r in self.versions[v] if r.healthy]
            if not healthy:
                raise InferError.unavailable(f"model '{self.name}' version {v}: no healthy replica")
            return healthy
        for v in sorted(self.versions, reverse=True):
            healthy = [r for r in self.versions[v] if r.healthy]
            if healthy:
                return healthy
        raise InferError.unavailable(f"model '{self.name}': no healthy replica")


def pick(replicas: Sequence[R], rng: random.Random | None = None) -> R:
    """Power of two choices on the gateway's own outstanding-request counts."""
    n = len(replicas)
    if n == 1:
        return replicas[0]
    r = rng or random
    a, b = r.sample(range(n), 2)
    ra, rb = replicas[a], replicas[b]
    return ra if ra.outstanding <= rb.outstanding else rb


class RoutingTable(Generic[R]):
    """Immutable-by-convention snapshot; the discovery loop swaps in a new one."""

    def __init__(self, entries: Iterable[tuple[str, int, R]] = ()):
        self.models: dict[str, ModelRoutes[R]] = {}
        for name, version, replica in entries:
            routes = self.models.setdefault(name, ModelRoutes(name))
            routes.versions.setdefault(version, []).append(replica)

    def lookup(self, name: str) -> ModelRoutes[R]:
        routes = self.models.get(name)
        if routes is None:
            raise model_not_found(name)
        return routes

    def __contains__(self, name: str) -> bool:
        return name in self.models
