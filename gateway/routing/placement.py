"""The model mesh's placement arithmetic (gateway/placement.py does the I/O): which replicas a
model goes to, in which order, and when it gets a copy more or less. Pure: no I/O, no clock
(times are passed in), so every gateway that sees the same replicas computes the same answer.

Order: weighted rendezvous hashing (highest random weight). Each replica's score for a model is
``weight / -ln(u)``, ``u`` a stable hash of (model, replica) in (0, 1); the replicas ranked by
score. The weight is the replica's memory budget (what it announces, the same to every gateway),
not its free memory of the moment: two gateways that scraped the replicas a second apart see
different free memory and would pick different replicas (two copies where one was wanted), while
budgets only change when a replica restarts with another flag. Room is the service's business
(it evicts its least recently used idle models to make it, or refuses with RESOURCE_EXHAUSTED);
a refused load goes to the next replica in the same order, so gateways still agree.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_SPAN = float(1 << 64)


def _unit(key: str, endpoint: str) -> float:
    """A stable hash of (key, endpoint) in the open interval (0, 1)."""
    digest = hashlib.blake2b(f"{key}\x00{endpoint}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / _SPAN


def rank(key: str, weights: Mapping[str, float]) -> list[str]:
    """The endpoints of ``weights`` (endpoint -> weight > 0) best first for ``key``: weighted
    rendezvous hashing. A replica with twice the weight is first for about twice the models;
    removing a replica moves only the models it ranked first for; ties break by endpoint."""
    def score(endpoint: str) -> float:
        weight = weights[endpoint]
        return weight / -math.log(_unit(key, endpoint)) if weight > 0 else 0.0

    return sorted(weights, key=lambda e: (-score(e), e))


@dataclass
class Demand:
    """One model's load as the last refreshes saw it."""

    copies: int  # healthy replicas serving it
    pending: float  # requests queued for it, summed over those replicas
    busy_rounds: int = 0  # consecutive refreshes with pending per copy at or over the bound
    idle_since: float | None = None  # when its served count last stopped changing (None: in use)


def wanted_copies(demand: Demand, min_copies: int, max_copies: int, pending_per_copy: float,
                  busy_rounds_needed: int, idle_s: float, now: float) -> int:
    """How many copies the model should have after this refresh: one more while its pending
    count per copy has stayed at ``pending_per_copy`` or over for ``busy_rounds_needed``
    refreshes (0 turns growth off), one fewer (never under ``min_copies``) once nothing was
    served for ``idle_s``, else as many as it has (at least ``min_copies``)."""
    have = max(demand.copies, min_copies)
    if pending_per_copy > 0 and demand.copies and demand.busy_rounds >= busy_rounds_needed \
            and demand.pending / demand.copies >= pending_per_copy:
        return min(have + 1, max_copies)
    if demand.idle_since is not None and now - demand.idle_since >= idle_s and demand.copies > min_copies:
        return demand.copies - 1
    return min(have, max_copies)


def pick_copies(order: Sequence[str], hosts: Sequence[str], wanted: int) -> tuple[list[str], list[str]]:
    """(replicas to load on, replicas to unload from) to go from ``hosts`` to ``wanted`` copies:
    new copies on the best-ranked replicas that lack one, extra copies leave the worst-ranked."""
    have = [e for e in order if e in hosts]
    if len(have) < wanted:
        return [e for e in order if e not in hosts][:wanted - len(have)], []
    if len(have) > wanted:
        return [], have[wanted:]
    return [], []
