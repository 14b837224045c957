"""The routing table: model -> version -> replicas hosting it. Pure data, no I/O."""
from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError, model_not_found
from meshserve.protocol.infer_checks import check_sequence_id


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
        versions = self.versions  # (one version, the common case: no sorted list per request)
        for v in versions if len(versions) == 1 else sorted(versions, reverse=True):
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


# ---- sequence pinning -------------------------------------------------------------------

class Endpoint(Protocol):
    endpoint: str


E = TypeVar("E", bound=Endpoint)
SEQUENCE_ID = "sequence_id"


def sequence_affinity(parameters: Mapping[str, pb.InferParameter]) -> str | None:
    """The pinning key of a request that belongs to a sequence, else None.

    Integer ids arrive as int64 (tritonclient, perf_analyzer), uint64 (HTTP JSON above
    2**63) or, rarely, an integral double; all map to the same unsigned key. 0 / "" = no
    sequence. A string id past ``infer_checks.SEQUENCE_ID_MAX`` is refused (InferError)."""
    p = parameters.get(SEQUENCE_ID)
    if p is None:
        return None
    which = p.WhichOneof("parameter_choice")
    if which == "string_param":  # (kept while the sequence lives: its length bounded, 400 past it)
        return f"s:{check_sequence_id(p.string_param)}" if p.string_param else None
    if which in ("int64_param", "uint64_param"):
        value = int(getattr(p, which)) % (1 << 64)
    elif which == "double_param" and float(p.double_param).is_integer():
        value = int(p.double_param) % (1 << 64)
    else:
        return None
    return f"i:{value}" if value else None


def rendezvous_score(key: str, endpoint: str) -> int:
    """Stable across processes (every gateway replica agrees), unlike hash()."""
    digest = hashlib.blake2b(f"{key}\x00{endpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_pinned(replicas: Sequence[E], key: str) -> E:
    """Rendezvous (highest random weight) hashing: the replica with the highest score for
    ``key``. Removing a replica moves only the sequences it held; adding one takes ~1/n."""
    if not replicas:
        raise ValueError("pick_pinned needs at least one replica")
    return max(replicas, key=lambda r: rendezvous_score(key, r.endpoint))
