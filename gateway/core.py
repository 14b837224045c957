"""GatewayCore: route each v2 operation to the service replicas that host the model."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import grpc

from gateway.routing.table import pick
from gateway.upstream.coalesce import Coalescer, ModelShape, merge_key
from gateway.upstream.discovery import Discovery
from gateway.upstream.replica import Replica
from gateway.upstream.stream import NotSent
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError, model_not_found
from meshserve.server.core import EXTENSIONS, InferResult, RequestContext
from meshserve.telemetry import metrics

log = logging.getLogger("meshserve.gateway")

T = TypeVar("T")
SERVER_NAME = "meshserve"
SERVER_VERSION = "0.1.0"

GATEWAY_FAMILIES = {
    "requests": metrics.Family("meshserve_gateway_requests_total", "counter",
                               "Inference requests through the gateway by model and outcome"),
    "upstream_errors": metrics.Family("meshserve_gateway_upstream_errors_total", "counter",
                                      "Failed upstream calls by replica"),
    "replica_healthy": metrics.Family("meshserve_gateway_replica_healthy", "gauge",
                                      "1 if the replica is in the pool"),
    "replica_outstanding": metrics.Family("meshserve_gateway_replica_outstanding", "gauge",
                                          "Requests in flight to the replica"),
}


class GatewayCore:
    def __init__(self, upstreams: list[str], discovery_interval_s: float = 2.0, coalesce_inflight: int = 2):
        if not upstreams:
            raise ValueError("the gateway needs at least one --upstream")
        self.replicas = [Replica(u) for u in upstreams]
        self.discovery = Discovery(self.replicas, discovery_interval_s)
        self._draining = False
        self.request_counts: Counter[tuple[str, str]] = Counter()
        # Merged requests in flight per model and healthy replica (0 disables coalescing).
        self.coalesce_inflight = coalesce_inflight
        self.coalescer = Coalescer(self._send, self._max_inflight)
        self._shapes: dict[int, tuple[mc.ModelConfig, ModelShape | None]] = {}

    async def start(self) -> None:
        await self.discovery.refresh()
        self.discovery.start()

    async def stop(self, drain: bool = True) -> None:
        self._draining = True
        await self.discovery.stop()

    # ---- helpers ----------------------------------------------------------------------
    async def _routes(self, name: str):  # noqa: ANN202
        table = self.discovery.table
        if name not in table:
            await self.discovery.refresh()  # a model loaded since the last probe
            table = self.discovery.table
        return table.lookup(name)

    async def _call(self, name: str, version: str, fn: Callable[[Replica], Awaitable[T]]) -> T:
        """Call one replica hosting (name, version); on a connection failure try the others."""
        routes = await self._routes(name)
        replicas = list(routes.replicas_for(version))
        while True:
            replica = pick(replicas)
            replica.outstanding += 1
            try:
                return await fn(replica)
            except (grpc.aio.AioRpcError, InferError, NotSent) as exc:
                if isinstance(exc, grpc.aio.AioRpcError):
                    err = InferError.from_grpc(exc.code(), exc.details(), hop=f"service {replica.endpoint}")
                elif isinstance(exc, NotSent):
                    err = InferError.unavailable(f"service {replica.endpoint}: stream unavailable")
                else:
                    err = exc
                if err.code in (Code.UNAVAILABLE, Code.INTERNAL, Code.UNKNOWN):
                    replica.errors += 1
                # Retry elsewhere only if the request never reached a model: it was never
                # written, or the channel could not connect at all.
                if isinstance(exc, NotSent) or (err.code == Code.UNAVAILABLE and _not_connected(replica)):
                    self.discovery.mark_unhealthy(replica)
                    replicas.remove(replica)
                    if replicas:
                        continue
                raise err from None
            finally:
                replica.outstanding -= 1

    # ---- V2Core -----------------------------------------------------------------------
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self._draining and any(r.healthy for r in self.replicas)

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            resp = await self._call(name, version, lambda r: r.model_ready(
                pb.ModelReadyRequest(name=name, version=version)))
        except InferError:
            return False
        return resp.ready

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        return await self._call(name, version, lambda r: r.model_metadata(
            pb.ModelMetadataRequest(name=name, version=version)))

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        return await self._call(name, version, lambda r: r.model_config(
            pb.ModelConfigRequest(name=name, version=version)))

    async def _send(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None
                    ) -> pb.ModelInferResponse:
        body = raw if raw is not None else request.SerializeToString()
        return await self._call(request.model_name, request.model_version,
                                lambda r: r.streams.infer(body, request.id, timeout))

    def _max_inflight(self) -> int:
        return self.coalesce_inflight * max(1, sum(1 for r in self.replicas if r.healthy))

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        name = request.model_name
        timeout = ctx.time_remaining()
        try:
            plan = self._merge_plan(request)
            if plan is None:
                response = await self._send(request, ctx.raw, timeout)
            else:
                key, rows, max_batch = plan
                response = await self.coalescer.submit(key, request, ctx.raw, rows, max_batch, timeout)
        except InferError as exc:
            self.request_counts[(name, exc.code.value)] += 1
            raise
        self.request_counts[(name, "OK")] += 1
        return InferResult(message=response)

    def _merge_plan(self, request: pb.ModelInferRequest) -> tuple[tuple, int, int] | None:
        if not self.coalesce_inflight:
            return None
        config = self.discovery.config_for(request.model_name, request.model_version)
        if config is None:
            return None
        shape = self._shapes.get(id(config))
        if shape is None or shape[0] is not config:
            shape = self._shapes[id(config)] = (config, ModelShape.of(config))
        if shape[1] is None:
            return None
        found = merge_key(request, shape[1])
        if found is None:
            return None
        return found[0], found[1], shape[1].max_batch_size

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        replicas: Iterable[Replica]
        if name:
            routes = await self._routes(name)
            replicas = list({id(r): r for rs in routes.versions.values() for r in rs}.values())
        else:
            replicas = [r for r in self.replicas if r.healthy]
        req = pb.ModelStatisticsRequest(name=name, version=version)
        results = await asyncio.gather(*(r.statistics(req, timeout=5) for r in replicas), return_exceptions=True)
        merged: dict[tuple[str, str], pb.ModelStatistics] = {}
        errors = []
        for res in results:
            if isinstance(res, BaseException):
                errors.append(res)
                continue
            for s in res.model_stats:
                key = (s.name, s.version)
                if key in merged:
                    _add_stats(merged[key], s)
                else:
                    merged[key] = s
        if not merged and errors and name:
            err = errors[0]
            if isinstance(err, grpc.aio.AioRpcError):
                raise InferError.from_grpc(err.code(), err.details())
            raise InferError.unavailable(f"statistics for model '{name}' unavailable: {err}")
        return pb.ModelStatisticsResponse(model_stats=[merged[k] for k in sorted(merged)])

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        healthy = [r for r in self.replicas if r.healthy]
        req = pb.RepositoryIndexRequest(ready=ready_only)
        results = await asyncio.gather(*(r.repository_index(req, timeout=5) for r in healthy),
                                       return_exceptions=True)
        seen: dict[tuple[str, str], pb.RepositoryIndexResponse.ModelIndex] = {}
        for res in results:
            if isinstance(res, BaseException):
                continue
            for m in res.models:
                key = (m.name, m.version)
                if key not in seen or m.state == "READY":
                    seen[key] = m
        ready_names = {n for (n, v), m in seen.items() if m.state == "READY"}
        out = pb.RepositoryIndexResponse()
        for key in sorted(seen):
            m = seen[key]
            if not key[1] and key[0] in ready_names:
                continue  # an unloaded entry from one replica while another serves it
            out.models.append(m)
        return out

    async def _owners(self, name: str) -> list[Replica]:
        healthy = [r for r in self.replicas if r.healthy]
        results = await asyncio.gather(*(r.repository_index(pb.RepositoryIndexRequest(), timeout=5)
                                         for r in healthy), return_exceptions=True)
        return [r for r, res in zip(healthy, results, strict=True)
                if not isinstance(res, BaseException) and any(m.name == name for m in res.models)]

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None:
        owners = await self._owners(name)
        if not owners:
            raise model_not_found(name)
        req = pb.RepositoryModelLoadRequest(model_name=name, parameters=parameters)
        await self._fan_out(owners, lambda r: r.load(req, timeout=600))
        await self.discovery.refresh()

    async def unload_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                           ctx: RequestContext) -> None:
        owners = await self._owners(name)
        req = pb.RepositoryModelUnloadRequest(model_name=name, parameters=parameters)
        await self._fan_out(owners, lambda r: r.unload(req, timeout=600))
        await self.discovery.refresh()

    async def _fan_out(self, replicas: list[Replica], fn: Callable[[Replica], Awaitable[object]]) -> None:
        results = await asyncio.gather(*(fn(r) for r in replicas), return_exceptions=True)
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, grpc.aio.AioRpcError):
                raise InferError.from_grpc(res.code(), res.details(), hop=f"service {r.endpoint}")
            if isinstance(res, BaseException):
                raise InferError.internal(f"service {r.endpoint}: {res}")

    def metrics_text(self) -> tuple[bytes, str]:
        samples: list[tuple[str, dict[str, str], float]] = []
        for (model, outcome), n in sorted(self.request_counts.items()):
            samples.append(("requests", {"model": model, "outcome": outcome}, n))
        for r in self.replicas:
            labels = {"replica": r.endpoint}
            samples.append(("upstream_errors", labels, r.errors))
            samples.append(("replica_healthy", labels, 1 if r.healthy else 0))
            samples.append(("replica_outstanding", labels, r.outstanding))
        return metrics.render(samples, GATEWAY_FAMILIES), metrics.CONTENT_TYPE


def _not_connected(replica: Replica) -> bool:
    return replica.channel.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY


def _add_duration(a: pb.StatisticDuration, b: pb.StatisticDuration) -> None:
    a.count += b.count
    a.ns += b.ns


def _add_stats(into: pb.ModelStatistics, other: pb.ModelStatistics) -> None:
    into.last_inference = max(into.last_inference, other.last_inference)
    into.inference_count += other.inference_count
    into.execution_count += other.execution_count
    for f in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
              "cache_hit", "cache_miss"):
        _add_duration(getattr(into.inference_stats, f), getattr(other.inference_stats, f))
    by_size = {b.batch_size: b for b in into.batch_stats}
    for b in other.batch_stats:
        if b.batch_size in by_size:
            mine = by_size[b.batch_size]
            for f in ("compute_input", "compute_infer", "compute_output"):
                _add_duration(getattr(mine, f), getattr(b, f))
        else:
            into.batch_stats.append(b)
