"""Token-bucket maths, pure: no clock, no I/O (the caller passes `now`).

The Redis store's Lua script implements the same arithmetic; tests check both agree.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """A tenant's limits: `rate` tokens per second, up to `burst` tokens saved, concurrency cap."""

    rate: float
    burst: float
    max_concurrency: int | None = None


@dataclass(frozen=True)
class Bucket:
    tokens: float
    updated: float  # the `now` the tokens were computed at


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float = 0.0  # when not allowed: how long until a token is available
    reason: str = ""  # "rate" | "concurrency" when refused


def full(limits: Limits, now: float) -> Bucket:
    return Bucket(tokens=limits.burst, updated=now)


def take(bucket: Bucket | None, limits: Limits, now: float, cost: float = 1.0) -> tuple[Bucket, Decision]:
    """Refill `bucket` to `now`, then take `cost` tokens if there are enough.

    A missing bucket starts full. Time running backwards (clock skew) never refills.
    """
    if bucket is None:
        bucket = full(limits, now)
    elapsed = max(0.0, now - bucket.updated)
    tokens = min(limits.burst, bucket.tokens + elapsed * limits.rate)
    if tokens >= cost:
        return Bucket(tokens - cost, max(now, bucket.updated)), Decision(True)
    wait = (cost - tokens) / limits.rate if limits.rate > 0 else float("inf")
    return Bucket(tokens, max(now, bucket.updated)), Decision(False, retry_after_s=wait, reason="rate")
