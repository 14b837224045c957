"""Discovery: ask every replica what it hosts and whether it is ready; rebuild the table."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Literal

import grpc

from gateway.routing.table import RoutingTable
from gateway.upstream.health import HealthWatch
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.replica import Replica
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc

log = logging.getLogger("meshserve.gateway.discovery")

PROBE_TIMEOUT_S = 2.0


# A replica whose probe only timed out stays in the pool until this many probes in a row did: a
# service busy on a loaded machine answers its requests but may miss one probe's 2 s (measured: one
# such miss ejected the only replica and failed every request until the next probe, 2026-11-29,
# docs/perf/side-by-side-round-3.md). Refused connections and the health watch eject at once.
SLOW_PROBES = 2
SLOW: Literal["slow"] = "slow"  # probe(): the replica did not answer within PROBE_TIMEOUT_S


async def probe(replica: Replica) -> list[tuple[str, int]] | None | Literal["slow"]:
    """(model, version) pairs READY on the replica, None when it is unreachable/not ready, SLOW
    when it did not answer in time."""
    try:
        ready = await replica.server_ready(pb.ServerReadyRequest(), timeout=PROBE_TIMEOUT_S)
        if not ready.ready:
            return None
        index = await replica.index(True, PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.debug("replica %s probe failed: %s", replica.endpoint, exc.code().name)
        return SLOW if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else None
    return [(m.name, int(m.version)) for m in index.models
            if m.state == "READY" and m.version.isdigit()]


class Discovery:
    """Keeps the routing table current: periodic probes (model lists), refresh-on-demand, DNS
    re-resolution of the pool, and a grpc.health.v1 Watch per replica (ejects at once)."""

    def __init__(self, pool: ReplicaPool, interval_s: float = 2.0):
        self.pool = pool
        self.replicas = pool.replicas  # updated in place by the pool
        self.interval_s = interval_s
        self.watches: dict[str, HealthWatch] = {}
        self._resolved_at = float("-inf")
        self._pending_refresh: asyncio.Task[None] | None = None
        self.table: RoutingTable[Replica] = RoutingTable()
        self.configs: dict[tuple[str, int], mc.ModelConfig] = {}
        self.first_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()
        # What each replica hosted when last reachable: a down replica's versions stay in the
        # table (with no healthy replica) so requests for them get 503 naming the version, not 404.
        self._last_hosted: dict[str, list[tuple[str, int]]] = {}
        self._slow: dict[str, int] = {}  # endpoint -> probes in a row that timed out
        # called with a replica each time it joins the pool (the gateway hands it the log settings
        # /v2/logging gave: GatewayCore._replica_joined)
        self.on_join: Callable[[Replica], None] | None = None

    async def resolve(self) -> None:
        """Re-resolve the pool's names; start a health watch on each new replica."""
        self._resolved_at = time.monotonic()
        added, removed = await self.pool.resolve()
        for r in removed:
            watch = self.watches.pop(r.endpoint, None)
            if watch is not None:
                await watch.stop()
            self._last_hosted.pop(r.endpoint, None)
            self._slow.pop(r.endpoint, None)
            r.healthy = False
            await r.close()
        for r in added:
            self.watches[r.endpoint] = HealthWatch(r.channel, r.endpoint, functools.partial(self._on_health, r))

    def _on_health(self, replica: Replica, serving: bool) -> None:
        if not serving:
            if replica.set_healthy(False):
                log.warning("replica %s left the pool: health watch says not serving", replica.endpoint)
            return
        # Serving again: probe now (its models may have changed) rather than at the next interval.
        if self._pending_refresh is None or self._pending_refresh.done():
            self._pending_refresh = asyncio.ensure_future(self.refresh())

    async def refresh(self) -> None:
        async with self._refresh_lock:
            replicas = list(self.replicas)
            results = await asyncio.gather(*(probe(r) for r in replicas))
            entries: list[tuple[str, int, Replica]] = []
            for replica, result in zip(replicas, results, strict=True):
                hosted = self._tolerate(replica, result)
                watch = self.watches.get(replica.endpoint)  # NOT_SERVING beats a probe that raced it
                if replica.set_healthy(hosted is not None and (watch is None or watch.serving is not False)):
                    log.info("replica %s is %s", replica.endpoint, "healthy" if replica.healthy else "unhealthy")
                    if replica.healthy and self.on_join is not None:
                        self.on_join(replica)
                if hosted is None:
                    hosted = self._last_hosted.get(replica.endpoint, [])
                else:
                    self._last_hosted[replica.endpoint] = hosted
                for name, version in hosted:
                    entries.append((name, version, replica))
            self.table = RoutingTable(entries)
            await self._fetch_configs(entries)
            self.first_done.set()

    def _tolerate(self, replica: Replica, result: list[tuple[str, int]] | None | Literal["slow"]
                  ) -> list[tuple[str, int]] | None:
        """What a probe says the replica hosts (None: out of the pool). A timed-out probe of a
        replica in the pool keeps what it last hosted, up to SLOW_PROBES - 1 times in a row."""
        if not isinstance(result, str):
            self._slow.pop(replica.endpoint, None)
            return result
        slow = self._slow[replica.endpoint] = self._slow.get(replica.endpoint, 0) + 1
        if replica.healthy and slow < SLOW_PROBES and replica.endpoint in self._last_hosted:
            log.info("replica %s did not answer a probe in %.0f s; kept (%d of %d)", replica.endpoint,
                     PROBE_TIMEOUT_S, slow, SLOW_PROBES)
            return self._last_hosted[replica.endpoint]
        return None

    async def _fetch_configs(self, entries: list[tuple[str, int, Replica]]) -> None:
        """Keep each served (model, version)'s config (the coalescer validates against it)."""
        wanted: dict[tuple[str, int], Replica] = {}
        for name, version, replica in entries:
            if replica.healthy:
                wanted.setdefault((name, version), replica)
        for key in [k for k in self.configs if k not in wanted]:
            del self.configs[key]
        missing = [(k, r) for k, r in wanted.items() if k not in self.configs]
        results = await asyncio.gather(*(r.model_config(pb.ModelConfigRequest(name=k[0], version=str(k[1])),
                                                        timeout=PROBE_TIMEOUT_S) for k, r in missing),
                                       return_exceptions=True)
        for (key, _), res in zip(missing, results, strict=True):
            if isinstance(res, pb.ModelConfigResponse):
                self.configs[key] = res.config

    def forget(self, name: str) -> None:
        """Drop the configs held for a model (it is being loaded again: the next refresh fetches
        the new ones)."""
        for key in [k for k in self.configs if k[0] == name]:
            del self.configs[key]

    def config_for(self, name: str, version: str) -> mc.ModelConfig | None:
        """Config of the version a request for (name, version) is routed to, if known."""
        routes = self.table.models.get(name)
        if routes is None:
            return None
        if version:
            return self.configs.get((name, int(version))) if version.isdigit() else None
        best = _served(routes.versions)
        return self.configs.get((name, best)) if best is not None else None

    def served_version(self, name: str) -> int | None:
        """The highest version of ``name`` with a healthy replica: where a request without a
        version goes."""
        routes = self.table.models.get(name)
        return None if routes is None else _served(routes.versions)

    def mark_unhealthy(self, replica: Replica, reason: BaseException | str = "") -> None:
        if replica.set_healthy(False):
            log.warning("replica %s ejected after a connection failure: %s", replica.endpoint, reason)

    async def _loop(self) -> None:
        while True:
            try:
                if time.monotonic() - self._resolved_at >= self.pool.resolve_interval_s:
                    await self.resolve()
                await self.refresh()
            except Exception:  # keep discovering whatever happens
                log.exception("discovery refresh failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for watch in self.watches.values():
            await watch.stop()
        for r in self.replicas:
            await r.close()


def _served(versions: dict[int, list[Replica]]) -> int | None:
    """``Discovery.served_version`` of a model's routes (plain loops, not a list and a generator
    per version: every request's path, by ``config_for``)."""
    best: int | None = None
    for v, rs in versions.items():
        if best is None or v > best:
            for r in rs:
                if r.healthy:
                    best = v
                    break
    return best
