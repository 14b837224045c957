"""In-process quota store: one gateway process's view (the default)."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from gateway.quotas.bucket import Bucket, Decision, Limits, take


class MemoryQuotaStore:
    """Token buckets and in-flight counts per tenant, held in this process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._buckets: dict[str, Bucket] = {}
        self._inflight: dict[str, set[str]] = {}
        self._ids = itertools.count()

    async def acquire(self, tenant: str, limits: Limits, lease_s: float = 0.0) -> tuple[Decision, str]:
        """Admit one request of `tenant` or say why not; the ticket goes back to `release`."""
        inflight = self._inflight.setdefault(tenant, set())
        if limits.max_concurrency is not None and len(inflight) >= limits.max_concurrency:
            return Decision(False, retry_after_s=1.0, reason="concurrency"), ""
        bucket, decision = take(self._buckets.get(tenant), limits, self._clock())
        self._buckets[tenant] = bucket
        if not decision.allowed:
            return decision, ""
        ticket = str(next(self._ids))
        if limits.max_concurrency is not None:
            inflight.add(ticket)
        return decision, ticket

    async def release(self, tenant: str, ticket: str) -> None:
        self._inflight.get(tenant, set()).discard(ticket)

    async def close(self) -> None:
        pass
