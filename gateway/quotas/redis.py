"""Redis quota store: one atomic Lua script per check, so limits hold across gateway replicas.

The script uses the Redis server's clock (TIME), so gateways with skewed clocks still share one
bucket correctly. Concurrency is a sorted set of tickets scored by lease expiry: a gateway that
dies mid-request leaks nothing past the lease.
"""
from __future__ import annotations

import uuid
from typing import Any

from gateway.quotas.bucket import Decision, Limits

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


class RedisQuotaStore:
    """Quota state in Redis at `url` (redis://host:port/db), keys prefixed `prefix`."""

    def __init__(self, url: str, prefix: str = "meshserve:quota:"):
        import redis.asyncio as aioredis  # only needed when this store is configured

        self._client: Any = aioredis.Redis.from_url(url)
        self._script = self._client.register_script(ACQUIRE)
        self._prefix = prefix

    def _keys(self, tenant: str) -> list[str]:
        tag = "{" + tenant + "}"  # one hash slot per tenant (Redis Cluster)
        return [f"{self._prefix}{tag}:bucket", f"{self._prefix}{tag}:inflight"]

    async def acquire(self, tenant: str, limits: Limits, lease_s: float = 0.0) -> tuple[Decision, str]:
        ticket = uuid.uuid4().hex if limits.max_concurrency else ""
        allowed, retry, reason = await self._script(
            keys=self._keys(tenant),
            args=[limits.rate, limits.burst, limits.max_concurrency or 0, ticket, lease_s or DEFAULT_LEASE_S])
        if int(allowed):
            return Decision(True), ticket
        return Decision(False, retry_after_s=float(retry), reason=_text(reason)), ""

    async def release(self, tenant: str, ticket: str) -> None:
        if ticket:
            await self._client.zrem(self._keys(tenant)[1], ticket)

    async def close(self) -> None:
        await self._client.aclose()


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
