"""GatewayCore: the gateway's V2Core. The infer path is a pipeline of stages (gateway/pipeline.py,
assembled in ``__init__``); model control, statistics and metrics federation are
gateway/control.py, statistics.py and federation.py; every call to a service goes through the
Upstream (gateway/upstream/upstream.py)."""
from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from gateway import auth, pipeline
from gateway.auth import Admission
from gateway.cache import FAMILIES as CACHE_FAMILIES
from gateway.cache import CacheConfig, CacheStage, FrontDoor, LocalCache, RedisCache
from gateway.control import ModelControl
from gateway.ensemble.catalog import EnsembleCatalog
from gateway.federation import Federation
from gateway.placement import FAMILIES as PLACEMENT_FAMILIES
from gateway.placement import Placement, Policy
from gateway.routes import ABRouter
from gateway.routing.table import pick_pinned
from gateway.shared_cache import SharedCache
from gateway.statistics import statistics
from gateway.turns import SequenceTurns
from gateway.upstream.coalesce import Coalescer
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.replica import Replica, grpc_error
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import hop
from meshserve.protocol.errors import InferError
from meshserve.repository.config import instance_count
from meshserve.repository.names import check_model_name, check_version
from meshserve.server import connections, inflate, observe, shm
from meshserve.server.access import ALL, Grant, Op, Rule
from meshserve.server.core import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    InferResult,
    RequestContext,
    StreamAnswer,
)
from meshserve.server.limits import ServerLimits
from meshserve.server.repository_control import ControlPolicy
from meshserve.telemetry import log_settings, loop_lag, metrics

GATEWAY_FAMILIES = {
    "route_requests": metrics.Family("meshserve_gateway_route_requests_total", "counter",
                                     "Requests to an A/B route by the arm that answered and outcome"),
    "shadow_requests": metrics.Family("meshserve_gateway_shadow_requests_total", "counter",
                                      "Shadow copies of A/B route requests by target model and outcome"),
    "quota_rejections": metrics.Family("meshserve_gateway_quota_rejections_total", "counter",
                                       "Requests refused by a tenant's quota, by tenant and reason (rate, concurrency, "
                                       "share: its share of a process-wide cap, sequence: another "
                                       "tenant's sequence id)"),
    "requests": metrics.Family("meshserve_gateway_requests_total", "counter",
                               "Inference requests through the gateway by model and outcome"),
    "upstream_errors": metrics.Family("meshserve_gateway_upstream_errors_total", "counter",
                                      "Failed upstream calls by replica"),
    "replica_healthy": metrics.Family("meshserve_gateway_replica_healthy", "gauge",
                                      "1 if the replica is in the pool"),
    "replica_outstanding": metrics.Family("meshserve_gateway_replica_outstanding", "gauge",
                                          "Requests in flight to the replica"),
    "upstream_duration": metrics.Family("meshserve_gateway_upstream_duration_us", "histogram",
                                        "Upstream infer round trip (sent on the stream to response) by "
                                        "replica, in microseconds"),
    "federated_up": metrics.Family("meshserve_gateway_federated_up", "gauge",
                                   "--federate-metrics: 1 if the replica's metrics were in the last scrape"),
    "merged_sends": metrics.Family("meshserve_gateway_merged_sends_total", "counter",
                                   "Merged requests sent to the services, each carrying several client requests "
                                   "(coalescing, --coalesce-inflight)"),
    "merged_requests": metrics.Family("meshserve_gateway_merged_requests_total", "counter",
                                      "Client requests sent inside merged requests"),
    "coalesce_queued": metrics.Family("meshserve_gateway_coalesce_queued_total", "counter",
                                      "Client requests that joined a coalescing group's queue (the model was busy) "
                                      "instead of going out at once"),
    "coalesce_held": metrics.Family("meshserve_gateway_coalesce_held_total", "counter",
                                    "Queued client requests the in-flight bound held past their event-loop pass "
                                    "(--coalesce-inflight full batches were in flight)"),
    "coalesce_deadline_resends": metrics.Family(
        "meshserve_gateway_coalesce_deadline_resends_total", "counter",
        "Client requests sent again alone after the merged request they rode in missed another member's deadline"),
    "coalesce_wait": metrics.Family("meshserve_gateway_coalesce_wait_us_total", "counter",
                                    "Microseconds queued client requests spent in the coalescer, summed"),
}


log = logging.getLogger("meshserve.gateway")
LOG_PUSH_TIMEOUT_S = 5.0  # a /v2/logging change's call to each replica (log_settings_changed)
MAX_MODEL_LABELS = 4096  # (model, outcome) keys of the request counts before unknown names are folded
OTHER_MODELS = "(other)"  # the label they are folded into


class RequestCounts(Counter[tuple[str, str]]):
    """``meshserve_gateway_requests_total``'s counts by (model, outcome). Every name that passed
    the name check is counted, and a client can make names up (a model that does not exist, one
    its tenant may not call: 404 / 403), each a new key and a new /metrics line for ever. So once a
    new key would pass ``limit``, the names this gateway does not serve (``known``) are folded
    into the model label ``"(other)"`` (their counts kept, summed); were every name known the bound
    doubles. A key already counted costs what a Counter's does (the fold runs from
    ``__missing__``, on a new key past the bound only)."""

    def __init__(self, known: Callable[[str], bool], limit: int = MAX_MODEL_LABELS):
        super().__init__()
        self.known = known
        self.limit = limit

    def __missing__(self, key: tuple[str, str]) -> int:
        if len(self) >= self.limit:
            folded: Counter[tuple[str, str]] = Counter()
            kept = {}
            for (model, outcome), n in self.items():
                if model == OTHER_MODELS or not self.known(model):
                    folded[(OTHER_MODELS, outcome)] += n
                else:
                    kept[(model, outcome)] = n
            self.clear()
            dict.update(self, kept)
            dict.update(self, folded)
            if len(self) >= self.limit // 2:  # mostly names it serves: room for more
                self.limit = 2 * len(self)
        return 0


class GatewayCore:
    def __init__(self, upstreams: list[str], discovery_interval_s: float = 2.0, coalesce_inflight: int = 2,
                 admission: Admission | None = None, pool: ReplicaPool | None = None,
                 routes: ABRouter | None = None, ensembles: EnsembleCatalog | None = None,
                 max_request_bytes: int = ServerLimits().max_request_bytes, metrics_auth: bool = False,
                 federate_metrics: bool = False, server_name: str = SERVER_NAME,
                 control: ControlPolicy = ControlPolicy(), cache: CacheConfig | None = None,
                 cache_share: tuple[str, int] | None = None, placement: Policy | None = None):
        # The pool resolves --upstream / --discovery endpoints (DNS names: every address a replica);
        # every call to a service goes through the Upstream.
        self.upstream = Upstream(pool if pool is not None else ReplicaPool(upstreams), discovery_interval_s)
        self.pool = self.upstream.pool
        self.replicas = self.upstream.replicas  # one list, updated in place as replicas come and go
        self.discovery = self.upstream.discovery
        self.discovery.on_join = self._replica_joined
        self._background: set[asyncio.Task[None]] = set()  # (log settings pushed to a replica that joined)
        self._draining = False
        # (model, outcome): pipeline.Outcomes; names this gateway does not serve folded past a bound
        self.request_counts: Counter[tuple[str, str]] = RequestCounts(self._known)
        # Full batches (max_batch_size rows per instance) in flight per model and healthy replica
        # before requests wait in the gateway (coalesce.py; 0 disables coalescing).
        # A merge stays within the services' message limit (assumed the same as ours: --max-request-bytes).
        self.coalescer = Coalescer(self.upstream, coalesce_inflight, max_request_bytes)
        self.turns = SequenceTurns()
        # Tenants and quotas (--tenants); None keeps the infer path free of any auth work.
        self.admission = admission
        # with tenants: each tenant's share of a model's queue and sequence slots at its services
        self._rooms: dict[tuple[str, str], tuple[mc.ModelConfig, int, auth.QueueRooms | None, int]] = {}
        if admission is not None:
            admission.queue_room = self.queue_room
            admission.sequence_room = self.sequence_room
            admission.sequence_replica = self.sequence_replica
        # --metrics-auth: /metrics (model and tenant names, every tenant's counts) for admins only
        self.metrics_auth = metrics_auth
        self.serves_metrics = True  # --allow-metrics (false: /metrics is 404 on the HTTP port)
        # --federate-metrics: /metrics carries the services' nv_* families too (label replica)
        self.federate_metrics = federate_metrics
        self.federation = Federation(self.upstream)
        self.server_name = server_name
        # --allow-model-uploads / --allow-remote-model-control (meshserve.server.repository_control)
        self.control = ModelControl(self.upstream, ensembles, control, admission is not None)
        # A/B routes (--routes): route names addressable like models.
        self.routes = routes
        if routes is not None:
            routes.bind(self.upstream, self._target_decoupled)
        # Ensembles of --repository, run here as DAGs over the services.
        self.ensembles = ensembles
        if ensembles is not None:
            ensembles.bind(self.upstream, self.discovery.config_for)
        # The infer path: the stages, their order and why are in pipeline.assemble.
        self.forward = pipeline.Forward(self.upstream, self.coalescer)
        # Triton's response cache (--cache-config): None keeps the stage out of the chain. With
        # --workers N (``cache_share``: the workers' directory, this worker's index) the local
        # cache and its counts are one file the workers share (gateway/shared_cache.py).
        self.cache = None
        # a hit answered in the gRPC and HTTP front doors (gateway/cache.py:FrontDoor; None: the pipeline's path)
        self.grpc_hit = self.http_hit = None
        self.grpc_front: FrontDoor | None = None
        if cache is not None:
            store: LocalCache | SharedCache | RedisCache
            if cache.kind == "redis":
                store = RedisCache(cache.settings)
            elif cache_share is not None:
                store = SharedCache(os.path.join(cache_share[0], "response-cache"), cache.size, cache_share[1])
            else:
                store = LocalCache(cache.size)
            # (no ensembles: the cache's config look-up is Discovery.config_for itself, one call fewer)
            self.cache = CacheStage(store, self._cache_config_for if ensembles is not None else self.discovery.config_for,
                                    self._served_version,
                                    None if routes is None else lambda name: routes.lookup(name) is not None,
                                    store.counts if isinstance(store, SharedCache) else None)
            # with tenants a tenant's keys are its own, and it holds at most its share of a LocalCache
            self.cache.scoped = admission is not None
            if isinstance(store, LocalCache):
                store.scoped = self.cache.scoped
                self.cache.front = FrontDoor(self.cache, store, self.request_counts, admission)
                self.grpc_hit, self.http_hit = self.cache.front.grpc, self.cache.front.http
                if self.cache.front.at_once:  # its gRPC hits answered before the call's Task (grpc_frontend.register)
                    self.grpc_front = self.cache.front
        if ensembles is not None and ensembles.executor is not None:
            ensembles.executor.step_cache = self.cache  # a step whose model enables the cache uses it
        # The model mesh (lazy loading, placement: gateway/placement.py); None: no stage, no loop.
        self.placement = None if placement is None else Placement(
            self.upstream, placement, ensembles.repository if ensembles is not None else None)
        if ensembles is not None and self.placement is not None:
            ensembles.place(self.placement)  # an ensemble's lazy steps are placed as direct requests are
        self.pipeline = pipeline.assemble(self.request_counts, self.turns, self.forward, self.is_decoupled,
                                          self._target_decoupled, admission, routes, ensembles, self.cache,
                                          self.placement)
        # The HTTP front door may hand the pipeline a request whose message is made only if read
        # (http_codec.ForwardedRequest) where the request goes Names -> Outcomes -> Forward: no
        # policy stage reads, copies or rewrites it, and Forward sends its bytes (an ensemble's
        # name excepted: http_frontend.HttpFrontend.forwarded).
        outcomes = self.pipeline.next
        self.forwards_bytes = outcomes.forward is not None
        if admission is None:  # (the front doors ask nothing before they parse: nobody has a share)
            self.grpc_door = self.http_door = None  # type: ignore[assignment]
        self.forward_ensembles = outcomes.ensembles

    async def start(self) -> None:
        # This process is a front door: a client's hop marker means nothing here (read_hop).
        # With tenants, each holds at most its share of the shared-memory caps and of the inflated bytes.
        hop.trust_marker(False)
        shm.share_of = self.admission.share_of if self.admission is not None else None
        inflate.tenant_of = self.admission.caller if self.admission is not None else None
        await self.discovery.resolve()
        await self.discovery.refresh()
        self.discovery.start()
        if self.placement is not None:
            self.placement.start()

    async def stop(self, drain: bool = True) -> None:
        self._draining = True
        if self.placement is not None:
            await self.placement.stop()
        await self.discovery.stop()
        if self.admission is not None:
            await self.admission.store.close()
        if self.routes is not None:
            await self.routes.stop()
        if self.cache is not None:
            await self.cache.close()

    # ---- V2Core -----------------------------------------------------------------------
    def _known(self, name: str) -> bool:
        """A model name this gateway serves or can serve (its services', an ensemble's, a route's,
        the model mesh's catalog): its request counts keep their own label."""
        if name in self.discovery.table.models:
            return True
        if self.ensembles is not None and name in self.ensembles:
            return True
        if self.routes is not None and self.routes.lookup(name) is not None:
            return True
        return self.placement is not None and name in self.placement.catalog

    def queue_room(self, name: str, version: str) -> auth.QueueRooms | None:
        """The requests for (name, version) its replicas queue and run at once at each priority
        level before refusing (gateway/auth.py:queue_room; None: its config bounds no queue, or it
        is not served here: an ensemble, a route)."""
        kept = self._kept(name, version)
        return None if kept is None else kept[2]

    def sequence_room(self, name: str, version: str) -> int:
        """The live sequences of (name, version) its replicas hold at once
        (gateway/auth.py:sequence_room; 0: unbounded, or not served here)."""
        kept = self._kept(name, version)
        return 0 if kept is None else kept[3]

    def sequence_replica(self, name: str, version: str, key: str) -> tuple[str, int] | None:
        """With several healthy replicas serving (name, version): the one a sequence key is pinned
        to (gateway/routing/table.py:pick_pinned, as gateway/upstream/upstream.py:Upstream.call
        picks it) and how many there are; None with one, or none known."""
        routes = self.discovery.table.models.get(name)
        if routes is None:
            return None
        try:
            replicas = routes.replicas_for(version)
        except InferError:  # (no such version, none healthy: the call refuses it)
            return None
        if len(replicas) < 2:
            return None
        return pick_pinned(replicas, key).endpoint, len(replicas)

    def _kept(self, name: str, version: str) -> tuple[mc.ModelConfig, int, auth.QueueRooms | None, int] | None:
        """(config, replicas, ``queue_room``, ``sequence_room``), kept per config and replica count."""
        config = self.discovery.config_for(name, version)
        if config is None:
            return None
        routes = self.discovery.table.models.get(name)
        served = int(version) if version else self.discovery.served_version(name)
        replicas = len(routes.versions.get(served, ())) if routes is not None and served is not None else 1
        kept = self._rooms.get((name, version))
        if kept is None or kept[0] is not config or kept[1] != replicas:
            if len(self._rooms) >= 4096:  # (names of models served here; a new config replaces its entry)
                self._rooms.clear()
            kept = self._rooms[(name, version)] = (config, replicas, auth.queue_room(config, replicas),
                                                   auth.sequence_room(config, instance_count(config), replicas))
        return kept

    def authorize(self, op: Op, model: str, ctx: RequestContext) -> Grant:
        """The access table (meshserve.server.access) applied to the caller's key; without
        --tenants every call is allowed."""
        if self.admission is None:
            return ALL
        if op is Op.METRICS:
            return self.admission.authorize(op, model, ctx, Rule.ADMIN if self.metrics_auth else Rule.OPEN)
        return self.admission.authorize(op, model, ctx)

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return not self._draining and any(r.healthy for r in self.replicas)

    async def log_settings_changed(self, changes: dict[str, Any]) -> None:
        """/v2/logging changed the gateway's settings: the same changes go to every healthy
        replica (its own lines and, in a python service, its models'), as Triton's one process
        applies them to its models' log lines too. Best effort, each within LOG_PUSH_TIMEOUT_S: a
        replica that does not take them keeps its own and is named in the gateway's log. A replica
        that joins later (or again, restarted) gets every setting /v2/logging gave
        (``_replica_joined``)."""
        await self._push_log_settings(self.upstream.healthy(), changes)

    async def _push_log_settings(self, replicas: list[Replica], settings: dict[str, Any]) -> None:
        request = pb.LogSettingsRequest()
        observe.fill_log_settings(request.settings, settings)
        results = await self.upstream.each(replicas, lambda r: r.log_settings(request, timeout=LOG_PUSH_TIMEOUT_S))
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("log settings not applied at %s: %s", replica.endpoint,
                            grpc_error(result) or type(result).__name__)

    def _replica_joined(self, replica: Replica) -> None:
        """A replica joined the pool: the log settings /v2/logging gave this gateway, if any."""
        settings = log_settings.active
        if settings is not None and settings.explicit:
            task = asyncio.ensure_future(self._push_log_settings([replica], dict(settings.explicit)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=self.server_name, version=SERVER_VERSION, extensions=EXTENSIONS)

    def _route_target(self, name: str) -> tuple[str, str] | None:
        """An A/B route answers metadata/config/ready as its heaviest target."""
        route = self.routes.lookup(name) if self.routes is not None else None
        if route is None:
            return None
        target = max(route.targets, key=lambda t: t.weight)
        return target.model, target.version

    async def model_ready(self, name: str, version: str) -> bool:
        check_version(version, check_model_name(name))
        if (target := self._route_target(name)) is not None:
            return not version and await self.model_ready(*target)
        if self.ensembles is not None and name in self.ensembles:
            return self.ensembles.ready(name, version)
        try:
            resp = await self.upstream.call(name, version, lambda r: r.model_ready(
                pb.ModelReadyRequest(name=name, version=version)))
        except InferError:
            return False
        return resp.ready

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        check_version(version, check_model_name(name))
        if (target := self._route_target(name)) is not None and not version:
            md = await self.model_metadata(*target)
            md.name = name
            return md
        if self.ensembles is not None and name in self.ensembles:
            return self.ensembles.model_metadata(name, version)
        if self.placement is not None and not self.placement.serving(name, version) \
                and (described := await self.placement.model_metadata(name, version)) is not None:
            return described  # a lazy model no replica serves: described from the repository, not loaded
        return await self.upstream.call(name, version, lambda r: r.model_metadata(
            pb.ModelMetadataRequest(name=name, version=version)))

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        check_version(version, check_model_name(name))
        if (target := self._route_target(name)) is not None and not version:
            resp = await self.model_config(*target)
            resp.config.name = name
            return resp
        if self.ensembles is not None and name in self.ensembles:
            return self.ensembles.model_config(name, version)
        if self.placement is not None and not self.placement.serving(name, version) \
                and (config := await self.placement.model_config(name, version)) is not None:
            return config
        return await self.upstream.call(name, version, lambda r: r.model_config(
            pb.ModelConfigRequest(name=name, version=version)))

    def grpc_door(self, raw: bytes, ctx: RequestContext) -> InferError | None:
        """What the gRPC front door asks before it parses a ModelInfer request: ``http_door``'s
        answer for the model its bytes name first (field 1, as protobuf writers put it; any other
        layout, or a name of 128 bytes or more, is parsed and admitted the usual way)."""
        admission = self.admission
        if admission is None or not admission.crowded():
            return None
        n = len(raw)
        if n < 2 or raw[0] != 0x0A or (length := raw[1]) >= 0x80 or length + 2 > n:
            return None
        try:
            model = raw[2:2 + length].decode()
        except UnicodeDecodeError:
            return None
        return self._at_door(admission, model, ctx)

    def http_door(self, model: str, ctx: RequestContext) -> InferError | None:
        """What the HTTP front door asks before it reads an infer request's body (``model`` from
        its path): the refusal of a caller that already holds its whole share of --max-inflight
        (``Admission.at_door``), counted in meshserve_gateway_requests_total as the pipeline counts
        a refused request (``pipeline.Outcomes``), or None: the request goes the pipeline's way.
        Never with tracing or DEBUG logs on (the pipeline's refusal has a span and a log line)."""
        admission = self.admission
        if admission is None or not admission.crowded():
            return None
        return self._at_door(admission, model, ctx)

    def _at_door(self, admission: Admission, model: str, ctx: RequestContext) -> InferError | None:
        if not observe.plain():
            return None
        refused = admission.at_door(model, ctx.headers)
        if refused is not None:
            self.request_counts[(model, refused.code.value)] += 1
        return refused

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> Coroutine[Any, Any, InferResult]:
        """A unary call: the pipeline's stages, from the name check to the service."""
        return self.pipeline.infer(request, ctx)

    def infer_stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncGenerator[StreamAnswer, None]:
        """A client's streaming call (gRPC ModelStreamInfer, HTTP generate[_stream]). A request
        that is not decoupled (``is_decoupled``) answers once, by the unary path (coalescing
        included); any other goes through the same stages to its service marked as streamed,
        never merged, and every answer comes back as it arrives (an ensemble with decoupled
        steps runs here and answers each of its rounds; an A/B route streams from the arm it
        picks). A sequence's next request waits for this one's last answer; the tenant's
        admission holds until then."""
        return self.pipeline.stream(request, ctx)

    def is_decoupled(self, name: str, version: str) -> bool:
        """Whether a streaming call for ``name`` takes the streamed path (zero or many answers;
        ``infer_stream``): a decoupled model, one whose config the gateway has not seen, an
        A/B route with such a target, an ensemble with a decoupled step (a name that is both a
        route and an ensemble is the route, as in the pipeline). The gRPC front end keeps the
        other requests' answers in request order."""
        route = self.routes.lookup(name) if self.routes is not None else None
        if route is not None:
            return any(self._target_decoupled(t.model, t.version) for t in route.targets)
        if self.ensembles is not None and name in self.ensembles:
            return self.ensembles.decoupled(name, version)
        return self._target_decoupled(name, version)

    def _target_decoupled(self, name: str, version: str) -> bool:
        config = self.discovery.config_for(name, version)
        return config is None or config.model_transaction_policy.decoupled

    def _cache_config_for(self, name: str, version: str) -> mc.ModelConfig | None:
        """The config that says whether a request is cached: an ensemble's own (cached as a whole
        when it enables the cache and has no decoupled step), else the served model's."""
        ensembles = self.ensembles
        if ensembles is not None and name in ensembles:
            config = ensembles.configs.get(name)
            if config is None or not config.response_cache.enable or name in ensembles.unloaded \
                    or version not in ("", "1") or ensembles.decoupled(name, version):
                return None
            return config
        return self.discovery.config_for(name, version)

    def _invalidate(self, name: str) -> Coroutine[Any, Any, None]:
        """Drop a model's cached answers and those of every ensemble with it as a step."""
        assert self.cache is not None
        names = [name]
        if self.ensembles is not None:
            names += [e for e, config in self.ensembles.configs.items()
                      if any(s.model_name == name for s in config.ensemble_scheduling.step)]
        return self.cache.invalidate(*names)

    def _served_version(self, name: str) -> str | None:
        """The version a request for ``name`` without one is routed to (as Discovery.config_for;
        an ensemble's is 1)."""
        if self.ensembles is not None and name in self.ensembles:
            return "1"
        best = self.discovery.served_version(name)
        return None if best is None else str(best)

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        stats = await statistics(self.upstream, self.ensembles, name, version)
        if self.cache is not None:  # the gateway's own hits and misses (Triton's cache_hit / cache_miss)
            for s in stats.model_stats:
                self.cache.counts.add_to(s)
        return stats

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        return await self.control.repository_index(ready_only)

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None:
        if self.cache is None:
            await self.control.load_model(name, parameters, ctx)
            return
        await self._invalidate(name)  # a reload drops the model's answers, before and after
        try:
            await self.control.load_model(name, parameters, ctx)
        finally:
            await self._invalidate(name)

    async def unload_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                           ctx: RequestContext) -> None:
        try:
            await self.control.unload_model(name, parameters, ctx)
        finally:
            if self.cache is not None:
                await self._invalidate(name)

    async def metrics_text(self) -> tuple[bytes, str]:
        federated = await self.federation.families() if self.federate_metrics else []  # first: it sets up
        samples, families = self.own_metrics()
        return metrics.render(samples, families, federated), metrics.CONTENT_TYPE

    def own_metrics(self, cache: bool = True) -> tuple[list[metrics.Sample], dict[str, metrics.Family]]:
        """This process's samples, and the families they and the services' belong to (``cache``
        False: without the response cache's samples, which --workers share)."""
        samples = self._metric_samples() + connections.samples() + loop_lag.samples()
        families = {**GATEWAY_FAMILIES, **connections.FAMILIES, **loop_lag.FAMILIES}
        if self.ensembles is not None or self.federate_metrics:  # Triton's families: ensembles, services
            families = {**families, **metrics.MODEL_FAMILIES}
            if self.ensembles is not None:
                samples += self.ensembles.metric_samples()
        if self.cache is not None:
            families = {**families, **CACHE_FAMILIES}
            if cache:
                samples += self.cache.counts.samples()
        if self.placement is not None:
            families = {**families, **PLACEMENT_FAMILIES}
            samples += self.placement.metric_samples()
        return samples, families

    async def placement_view(self) -> dict[str, object] | None:
        """GET /v2/placement: where each model lives (None: no placement policy on this gateway)."""
        return None if self.placement is None else self.placement.view()

    def _metric_samples(self) -> list[metrics.Sample]:
        samples: list[metrics.Sample] = []
        for (model, outcome), n in sorted(self.request_counts.items()):
            samples.append(("requests", {"model": model, "outcome": outcome}, n))
        if self.admission is not None:
            for (tenant, reason), n in sorted(self.admission.rejections.items()):
                samples.append(("quota_rejections", {"tenant": tenant, "reason": reason}, n))
        for r in self.replicas:
            labels = {"replica": r.endpoint}
            samples.append(("upstream_errors", labels, r.errors))
            samples.append(("replica_healthy", labels, 1 if r.healthy else 0))
            samples.append(("replica_outstanding", labels, r.outstanding))
            samples.append(("upstream_duration", labels, r.streams.latency))
        samples.append(("merged_sends", {}, self.coalescer.merged_sends))
        samples.append(("merged_requests", {}, self.coalescer.merged_requests))
        samples.append(("coalesce_queued", {}, self.coalescer.queued))
        samples.append(("coalesce_held", {}, self.coalescer.held))
        samples.append(("coalesce_wait", {}, self.coalescer.wait_ns // 1000))
        samples.append(("coalesce_deadline_resends", {}, self.coalescer.deadline_resends))
        for endpoint, up in sorted(self.federation.up.items()):
            samples.append(("federated_up", {"replica": endpoint}, up))
        if self.routes is not None:
            for (route, arm, outcome), n in sorted(self.routes.arm_counts.items()):
                samples.append(("route_requests", {"route": route, "arm": arm, "outcome": outcome}, n))
            for (route, model, outcome), n in sorted(self.routes.shadow_counts.items()):
                samples.append(("shadow_requests", {"route": route, "model": model, "outcome": outcome}, n))
        return samples
