"""Discovery: ask every replica what it hosts and whether it is ready; rebuild the table."""
from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.routing.table import RoutingTable
from gateway.upstream.replica import Replica
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc

log = logging.getLogger("meshserve.gateway.discovery")

PROBE_TIMEOUT_S = 2.0


async def probe(replica: Replica) -> list[tuple[str, int]] | None:
    """(model, version) pairs READY on the replica, or None when it is unreachable/not ready."""
    try:
        ready = await replica.server_ready(pb.ServerReadyRequest(), timeout=PROBE_TIMEOUT_S)
        if not ready.ready:
            return None
        index = await replica.repository_index(pb.RepositoryIndexRequest(ready=True), timeout=PROBE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.debug("replica %s probe failed: %s", replica.endpoint, exc.code().name)
        return None
    return [(m.name, int(m.version)) for m in index.models
            if m.state == "READY" and m.version.isdigit()]


class Discovery:
    """Keeps the routing table current: periodic probes plus refresh-on-demand."""

    def __init__(self, replicas: list[Replica], interval_s: float = 2.0):
        self.replicas = replicas
        self.interval_s = interval_s
        self.table: RoutingTable[Replica] = RoutingTable()
        self.configs: dict[tuple[str, int], mc.ModelConfig] = {}
        self.first_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._refresh_lock:
            results = await asyncio.gather(*(probe(r) for r in self.replicas))
            entries: list[tuple[str, int, Replica]] = []
            for replica, hosted in zip(self.replicas, results, strict=True):
                was = replica.healthy
                replica.healthy = hosted is not None
                if was != replica.healthy:
                    log.info("replica %s is %s", replica.endpoint, "healthy" if replica.healthy else "unhealthy")
                for name, version in hosted or ():
                    entries.append((name, version, replica))
            self.table = RoutingTable(entries)
            await self._fetch_configs(entries)
            self.first_done.set()

    async def _fetch_configs(self, entries: list[tuple[str, int, Replica]]) -> None:
        """Keep each served (model, version)'s config (the coalescer validates against it)."""
        wanted: dict[tuple[str, int], Replica] = {}
        for name, version, replica in entries:
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

    def config_for(self, name: str, version: str) -> mc.ModelConfig | None:
        """Config of the version a request for (name, version) is routed to, if known."""
        routes = self.table.models.get(name)
        if routes is None:
            return None
        if version:
            return self.configs.get((name, int(version))) if version.isdigit() else None
        healthy = [v for v, rs in routes.versions.items() if any(r.healthy for r in rs)]
        return self.configs.get((name, max(healthy))) if healthy else None

    def mark_unhealthy(self, replica: Replica) -> None:
        if replica.healthy:
            log.warning("replica %s ejected after a connection failure", replica.endpoint)
        replica.healthy = False

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep discovering whatever happens
                log.exception("discovery refresh failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for r in self.replicas:
            await r.close()
