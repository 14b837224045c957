"""Redis quota store: one atomic Lua script per check, so limits hold across gateway replicas.

The script uses the Redis server's clock (TIME), so gateways with skewed clocks still share one
bucket correctly. Concurrency is a sorted set of tickets scored by lease expiry: a gateway that
dies mid-request leaks nothing past the lease.

A Redis that is down, or slow past ``QUOTA_TIMEOUT_S``, fails the check (the gateway answers
503 / UNAVAILABLE: fail closed) within that bound whatever the client library's defaults, and
for ``QUOTA_BACKOFF_S`` after a failure checks fail at once without asking it. A ticket whose
release failed is released once Redis answers again (not held until its lease ends: a tenant's
``max_concurrency`` would stay taken for up to ``DEFAULT_LEASE_S`` after a short outage).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from gateway.quotas import StoreUnavailable
from gateway.quotas.bucket import Decision, Limits

log = logging.getLogger("meshserve.gateway.quotas")

# Same arithmetic as bucket.take (a missing bucket starts full; refill, cap at burst, take 1).
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local maxc = tonumber(ARGV[3])
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= maxc then
    return {0, '1', 'concurrency'}
  end
end
local b = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(b[1])
local updated = tonumber(b[2])
if tokens == nil or updated == nil then
  tokens = burst
  updated = now
end
tokens = math.min(burst, tokens + math.max(0, now - updated) * rate)
updated = math.max(now, updated)
local ttl = math.ceil(burst / rate) + 2
local allowed = tokens >= 1
if allowed then
  tokens = tokens - 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'updated', tostring(updated))
redis.call('EXPIRE', KEYS[1], ttl)
if not allowed then
  return {0, tostring((1 - tokens) / rate), 'rate'}
end
if maxc > 0 then
  local lease = tonumber(ARGV[5])
  redis.call('ZADD', KEYS[2], now + lease, ARGV[4])
  redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 1)
end
return {1, '0', ''}
"""

DEFAULT_LEASE_S = 300.0
QUOTA_TIMEOUT_S = 1.0  # a check (or release) that Redis has not answered in this long fails
QUOTA_BACKOFF_S = 0.5  # after a failure, checks fail at once this long (Redis is not asked)
UNRELEASED_MAX = 10_000  # tickets kept for release once Redis answers again (older ones: their lease)


class RedisQuotaStore:
    """Quota state in Redis at `url` (redis://host:port/db), keys prefixed `prefix`. The socket
    timeouts default to ``timeout_s``; the URL's own ``?socket_timeout=`` /
    ``?socket_connect_timeout=`` win (redis-py reads them), and ``timeout_s`` bounds each call
    as a whole all the same."""

    def __init__(self, url: str, prefix: str = "meshserve:quota:", timeout_s: float = QUOTA_TIMEOUT_S):
        import redis.asyncio as aioredis  # only needed when this store is configured
        from redis.exceptions import RedisError

        self._client: Any = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self._client.register_script(ACQUIRE)
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._down_until = 0.0
        self._unreleased: dict[str, str] = {}  # ticket -> tenant: releases that failed, in order
        self._releasing: asyncio.Task[None] | None = None

    def _keys(self, tenant: str) -> list[str]:
        tag = "{" + tenant + "}"  # one hash slot per tenant (Redis Cluster)
        return [f"{self._prefix}{tag}:bucket", f"{self._prefix}{tag}:inflight"]

    def _failed(self, what: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + QUOTA_BACKOFF_S
        log.warning("quota store: %s failed (%s: %s); quota checks fail for %.1f s", what,
                    type(exc).__name__, exc, QUOTA_BACKOFF_S)

    async def acquire(self, tenant: str, limits: Limits, lease_s: float = 0.0) -> tuple[Decision, str]:
        if (wait := self._down_until - time.monotonic()) > 0:
            raise StoreUnavailable("quota store unavailable", wait)
        ticket = uuid.uuid4().hex if limits.max_concurrency else ""
        try:
            async with asyncio.timeout(self._timeout_s):
                allowed, retry, reason = await self._script(
                    keys=self._keys(tenant),
                    args=[limits.rate, limits.burst, limits.max_concurrency or 0, ticket,
                          lease_s or DEFAULT_LEASE_S])
        except self._errors as exc:
            self._failed("a check", exc)
            raise StoreUnavailable("quota store unavailable", QUOTA_BACKOFF_S) from None
        if self._unreleased and self._releasing is None:  # Redis answers again: what it missed
            self._releasing = asyncio.get_running_loop().create_task(self._release_missed())
        if int(allowed):
            return Decision(True), ticket
        return Decision(False, retry_after_s=float(retry), reason=_text(reason)), ""

    async def release(self, tenant: str, ticket: str) -> None:
        if not ticket:
            return
        if time.monotonic() < self._down_until:
            self._keep(tenant, ticket)
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._client.zrem(self._keys(tenant)[1], ticket)
        except self._errors as exc:
            self._failed("a release", exc)
            self._keep(tenant, ticket)

    def _keep(self, tenant: str, ticket: str) -> None:
        """A release Redis missed, kept for when it answers (the oldest dropped past
        UNRELEASED_MAX: its lease still ends it)."""
        self._unreleased[ticket] = tenant
        if len(self._unreleased) > UNRELEASED_MAX:
            del self._unreleased[next(iter(self._unreleased))]

    async def _release_missed(self) -> None:
        """The releases Redis missed, one ZREM per tenant, after a check it answered."""
        try:
            by_tenant: dict[str, list[str]] = {}
            for ticket, tenant in list(self._unreleased.items()):
                by_tenant.setdefault(tenant, []).append(ticket)
            for tenant, tickets in by_tenant.items():
                try:
                    async with asyncio.timeout(self._timeout_s):
                        await self._client.zrem(self._keys(tenant)[1], *tickets)
                except self._errors as exc:
                    self._failed("a late release", exc)
                    return
                for ticket in tickets:
                    self._unreleased.pop(ticket, None)
        finally:
            self._releasing = None

    async def close(self) -> None:
        if self._releasing is not None:
            self._releasing.cancel()
            await asyncio.gather(self._releasing, return_exceptions=True)
        await self._client.aclose()


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
