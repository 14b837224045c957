"""GatewayCore: route each v2 operation to the service replicas that host the model."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, nullcontext

from gateway.auth import Admission
from gateway.ensemble.catalog import EnsembleCatalog
from gateway.routes import ABRouter
from gateway.routing.table import SEQUENCE_ID, sequence_affinity
from gateway.turns import SequenceTurns
from gateway.upstream.coalesce import Coalescer, ModelShape, merge_key
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.replica import Replica, grpc_error
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import hop
from meshserve.protocol.errors import Code, InferError
from meshserve.repository import layout
from meshserve.repository.errors import ConfigError
from meshserve.repository.names import check_file_path, check_model_name, check_version
from meshserve.server import shm
from meshserve.server.access import ALL, Grant, Op, Rule
from meshserve.server.core import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    UNARY_DECOUPLED_GRPC,
    InferResult,
    RequestContext,
    StreamAnswer,
    unary_decoupled_error,
)
from meshserve.server.limits import ServerLimits
from meshserve.server.repository_control import FILES_NEED_CONFIG, ControlPolicy, poll_failed
from meshserve.telemetry import metrics, tracing

log = logging.getLogger("meshserve.gateway")
_VALID_NAMES_KEPT = 4096  # bounded: a client sending random valid names cannot grow it further
# --federate-metrics: one scrape of the services serves every /metrics request of this long
# (and concurrent requests share one), so /metrics callers cannot multiply calls to the services.
FEDERATION_REUSE_S = 0.5
FEDERATION_TIMEOUT_S = 5.0

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


class GatewayCore:
    def __init__(self, upstreams: list[str], discovery_interval_s: float = 2.0, coalesce_inflight: int = 2,
                 admission: Admission | None = None, pool: ReplicaPool | None = None,
                 routes: ABRouter | None = None, ensembles: EnsembleCatalog | None = None,
                 max_request_bytes: int = ServerLimits().max_request_bytes, metrics_auth: bool = False,
                 federate_metrics: bool = False, server_name: str = SERVER_NAME,
                 control: ControlPolicy = ControlPolicy()):
        # The pool resolves --upstream / --discovery endpoints (DNS names: every address a replica);
        # every call to a service goes through the Upstream.
        self.upstream = Upstream(pool if pool is not None else ReplicaPool(upstreams), discovery_interval_s)
        self.pool = self.upstream.pool
        self.replicas = self.upstream.replicas  # one list, updated in place as replicas come and go
        self.discovery = self.upstream.discovery
        self._draining = False
        self.request_counts: Counter[tuple[str, str]] = Counter()
        # Full batches (max_batch_size rows per instance) in flight per model and healthy replica
        # before requests wait in the gateway (coalesce.py; 0 disables coalescing).
        self.coalesce_inflight = coalesce_inflight
        # A merge stays within the services' message limit (assumed the same as ours: --max-request-bytes).
        self.coalescer = Coalescer(self.upstream, coalesce_inflight, max_request_bytes)
        self.turns = SequenceTurns()
        # Names that passed the names rule (a set lookup instead of its regex on every request)
        self._valid_names: set[str] = set()
        self._shapes: dict[int, tuple[mc.ModelConfig, ModelShape | None, bool]] = {}  # _facts
        # Tenants and quotas (--tenants); None keeps the infer path free of any auth work.
        self.admission = admission
        # --metrics-auth: /metrics (model and tenant names, every tenant's counts) for admins only
        self.metrics_auth = metrics_auth
        # --federate-metrics: /metrics carries the services' nv_* families too (label replica)
        self.federate_metrics = federate_metrics
        self._federation: asyncio.Future[list[metrics.Federated]] | None = None
        self._federated_at = 0.0
        self._federated_up: dict[str, int] = {}
        self.server_name = server_name
        # --allow-model-uploads / --allow-remote-model-control (meshserve.server.repository_control)
        self.control = control
        # A/B routes (--routes): route names addressable like models.
        self.routes = routes
        if routes is not None:
            routes.bind(self.upstream, self._target_decoupled)
        # Ensembles of --repository, run here as DAGs over the services.
        self.ensembles = ensembles
        if ensembles is not None:
            ensembles.bind(self.upstream, self.discovery.config_for)

    async def start(self) -> None:
        # This process is a front door: a client's hop marker means nothing here (read_hop).
        # With tenants, each holds at most its share of the shared-memory caps.
        hop.trust_marker(False)
        shm.share_of = self.admission.share_of if self.admission is not None else None
        await self.discovery.resolve()
        await self.discovery.refresh()
        self.discovery.start()

    async def stop(self, drain: bool = True) -> None:
        self._draining = True
        await self.discovery.stop()
        if self.admission is not None:
            await self.admission.store.close()
        if self.routes is not None:
            await self.routes.stop()

    # ---- V2Core -----------------------------------------------------------------------
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
        return await self.upstream.call(name, version, lambda r: r.model_config(
            pb.ModelConfigRequest(name=name, version=version)))

    def _check_names(self, request: pb.ModelInferRequest) -> None:
        """A client request's model name, version and parameter names, before anything routes it."""
        name = request.model_name
        if name not in self._valid_names:  # an invalid name is never routed or forwarded
            check_model_name(name)
            if len(self._valid_names) < _VALID_NAMES_KEPT:
                self._valid_names.add(name)
        if request.model_version:
            check_version(request.model_version, request.model_name)
        params = request.parameters
        if params:
            for key in params:  # (a client's request carries none of the hop's private parameters)
                if key.startswith(hop.PRIVATE_PREFIX):
                    raise InferError.invalid(f"request parameter '{key}' is reserved for meshserve's own hops; "
                                             f"parameters starting with '{hop.PRIVATE_PREFIX}' may not be sent")

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        self._check_names(request)
        params = request.parameters
        if SEQUENCE_ID in params and (sequence := sequence_affinity(params)) is not None:
            # a sequence's requests reach the service in the order they arrived (gateway/turns.py),
            # all on one replica (the key is parsed here once and travels with the request)
            return await self.turns.run((request.model_name, sequence),
                                        lambda: self._infer_admitted(request, ctx, sequence))
        return await self._infer_admitted(request, ctx, None)

    def is_decoupled(self, name: str, version: str) -> bool:
        """Whether a streaming call for ``name`` takes the streamed path (zero or many answers;
        ``infer_stream``): a decoupled model, one whose config the gateway has not seen, an
        ensemble with a decoupled step, an A/B route with such a target. The gRPC front end
        keeps the other requests' answers in request order."""
        if self.ensembles is not None and name in self.ensembles:
            return self.ensembles.decoupled(name, version)
        route = self.routes.lookup(name) if self.routes is not None else None
        if route is not None:
            return any(self._target_decoupled(t.model, t.version) for t in route.targets)
        return self._target_decoupled(name, version)

    def _target_decoupled(self, name: str, version: str) -> bool:
        config = self.discovery.config_for(name, version)
        return config is None or config.model_transaction_policy.decoupled

    async def infer_stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncIterator[StreamAnswer]:
        """A client's streaming call (gRPC ModelStreamInfer, HTTP generate[_stream]). A request
        that is not decoupled (``is_decoupled``) answers once, by ``infer`` (coalescing
        included); any other goes to its service marked as streamed, never merged, and every
        answer comes back as it arrives (an ensemble with decoupled steps runs here and answers
        each of its rounds; an A/B route streams from the arm it picks). A sequence's next
        request waits for this one's last answer; the tenant's admission holds until then."""
        self._check_names(request)
        name = request.model_name
        if not self.is_decoupled(name, request.model_version):
            yield await self.infer(request, ctx), True
            return
        params = request.parameters
        sequence = sequence_affinity(params) if SEQUENCE_ID in params else None
        turn: AbstractAsyncContextManager[None] = nullcontext() if sequence is None \
            else self.turns.turn((name, sequence))
        async with turn:
            admitted = None if self.admission is None else await self.admission.admit(
                request, ctx, sequence, self._sequence_idle_s(request) if sequence is not None else 0.0)
            try:
                async for response, final in self._streamed(request, ctx, sequence):
                    yield (None if response is None else InferResult(message=response)), final
            except InferError as exc:
                self.request_counts[(name, exc.code.value)] += 1
                raise
            finally:
                if self.admission is not None:
                    await self.admission.release(admitted)
            self.request_counts[(name, "OK")] += 1

    async def _streamed(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
                        ) -> AsyncIterator[tuple[pb.ModelInferResponse | None, bool]]:
        """The answers of an admitted streamed request: an ensemble's rounds, an A/B route's arm
        (each response marked with the arm), or the service's."""
        name = request.model_name
        timeout = ctx.time_remaining()
        if self.ensembles is not None and name in self.ensembles:
            async for answer in self.ensembles.infer_stream(request, timeout, sequence):
                yield answer
            return
        route = self.routes.lookup(name) if self.routes is not None else None
        if route is None or self.routes is None:
            async for answer in self.upstream.stream(request, ctx.raw, timeout, sequence):
                yield answer
            return
        target = self.routes.choose(route, request, ctx, sequence)  # the request now names the target
        try:
            if not self._target_decoupled(request.model_name, request.model_version):
                answers: AsyncIterator[tuple[pb.ModelInferResponse | None, bool]] = \
                    _once(self._dispatch(request, ctx, sequence))
            else:
                answers = self.upstream.stream(request, ctx.raw, timeout, sequence)
            async for response, final in answers:
                yield (None if response is None else self.routes.marked(target, response)), final
        except InferError as exc:
            self.routes.failed(route, target, exc)
            raise
        self.routes.arm_counts[(route.name, target.name, "OK")] += 1

    async def _infer_admitted(self, request: pb.ModelInferRequest, ctx: RequestContext,
                              affinity: str | None) -> InferResult:
        if self.admission is None and self.routes is None and self.ensembles is None:
            return await self._infer(request, ctx, affinity)
        admitted = None
        if self.admission is not None:  # tenants see route names, not the arms behind them
            span = tracing.current_span() if tracing.enabled else None
            started = time.time_ns() if span is not None else 0
            try:
                admitted = await self.admission.admit(request, ctx, affinity,
                                                      self._sequence_idle_s(request) if affinity is not None else 0.0)
            except InferError as exc:
                self.request_counts[(request.model_name, exc.code.value)] += 1
                if span is not None:
                    tracing.emit_span("gateway.admission", span, started, time.time_ns(),
                                      {"meshserve.error_code": exc.code.value}, error=f"{exc.code.value}: {exc}")
                raise
            if span is not None:
                tracing.emit_span("gateway.admission", span, started, time.time_ns(),
                                  {"meshserve.tenant": admitted.tenant or "(anonymous)"})
        try:
            route = self.routes.lookup(request.model_name) if self.routes is not None else None
            if route is None or self.routes is None:
                return await self._dispatch(request, ctx, affinity)
            target = self.routes.choose(route, request, ctx, affinity)  # the request now names the target
            try:
                result = await self._dispatch(request, ctx, affinity)
            except InferError as exc:
                self.routes.failed(route, target, exc)
                raise
            return self.routes.answered(route, target, result)
        finally:
            if self.admission is not None:
                await self.admission.release(admitted)

    def _sequence_idle_s(self, request: pb.ModelInferRequest) -> float:
        """A sequence model's idle timeout (Triton's default 1 s), for how long its tenant keeps it."""
        config = self.discovery.config_for(request.model_name, request.model_version)
        if config is None:
            return 0.0
        return (config.sequence_batching.max_sequence_idle_microseconds or 1_000_000) / 1e6

    async def _dispatch(self, request: pb.ModelInferRequest, ctx: RequestContext,
                        affinity: str | None) -> InferResult:
        """An ensemble runs here in the gateway; any other model goes to its service."""
        if self.ensembles is None or request.model_name not in self.ensembles:
            return await self._infer(request, ctx, affinity)
        name = request.model_name
        try:
            response = await self.ensembles.infer(request, ctx.time_remaining(), affinity, ctx.protocol)
        except InferError as exc:
            self.request_counts[(name, exc.code.value)] += 1
            raise
        self.request_counts[(name, "OK")] += 1
        return InferResult(message=response)

    async def _infer(self, request: pb.ModelInferRequest, ctx: RequestContext, affinity: str | None) -> InferResult:
        name = request.model_name
        timeout = ctx.time_remaining()
        try:
            config = self.discovery.config_for(name, request.model_version)
            facts = None if config is None else self._facts(config)
            if facts is not None and facts[2]:
                raise unary_decoupled_error(ctx.protocol)  # (a streaming call comes by infer_stream)
            coalescer = self.coalescer
            if self.coalesce_inflight and coalescer.idle(name):  # nothing to merge with: no merge check
                result = InferResult(message=await coalescer.send_alone(request, ctx.raw, timeout, affinity))
            elif not self.coalesce_inflight or facts is None or (shape := facts[1]) is None or \
                    (found := merge_key(request, shape, ctx.raw)) is None:  # a sampled request may be merged too
                result = InferResult(message=await self.upstream.send(request, ctx.raw, timeout, affinity))
            else:
                result = await coalescer.submit(found[0], request, ctx.raw, found[1], shape, timeout)
        except InferError as exc:
            self.request_counts[(name, exc.code.value)] += 1
            if exc.message == UNARY_DECOUPLED_GRPC and ctx.protocol == "http":  # the service's words for gRPC
                raise unary_decoupled_error(ctx.protocol) from None
            raise
        self.request_counts[(name, "OK")] += 1
        return result

    def _facts(self, config: mc.ModelConfig) -> tuple[mc.ModelConfig, ModelShape | None, bool]:
        """(config, what the merge check needs or None when its requests never merge, decoupled),
        worked out once per config (held by its id while discovery holds the config)."""
        facts = self._shapes.get(id(config))
        if facts is None or facts[0] is not config:
            facts = self._shapes[id(config)] = (config, ModelShape.of(config),
                                                config.model_transaction_policy.decoupled)
        return facts

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """Merged from the services' replicas; an ensemble's from the gateway, which runs it
        (all-model statistics list the ensembles too, as Triton's do)."""
        replicas: Iterable[Replica]
        if name:
            check_version(version, check_model_name(name))
            if self.ensembles is not None and name in self.ensembles:
                return pb.ModelStatisticsResponse(model_stats=self.ensembles.statistics(name, version))
            routes = await self.upstream.routes(name)
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
            raise grpc_error(err) or InferError.unavailable(f"statistics for model '{name}' unavailable: {err}")
        if not name and self.ensembles is not None:
            for s in self.ensembles.statistics("", ""):
                merged.setdefault((s.name, s.version), s)
        return pb.ModelStatisticsResponse(model_stats=[merged[k] for k in sorted(merged)])

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Every model the services' repositories hold (merged over replicas: READY beats LOADING
        beats UNAVAILABLE), then the ensembles run here."""
        healthy = [r for r in self.replicas if r.healthy]
        results = await asyncio.gather(*(r.index(ready_only, timeout=5) for r in healthy), return_exceptions=True)
        seen: dict[tuple[str, str], pb.RepositoryIndexResponse.ModelIndex] = {}
        for res in results:
            if isinstance(res, BaseException):
                continue
            for m in res.models:
                key = (m.name, m.version)
                if key not in seen or _STATE_RANK.get(m.state, 0) > _STATE_RANK.get(seen[key].state, 0):
                    seen[key] = m
        ready_names = {n for (n, v), m in seen.items() if m.state == "READY"}
        out = pb.RepositoryIndexResponse()
        for key in sorted(seen):
            m = seen[key]
            if not key[1] and key[0] in ready_names:
                continue  # an unloaded entry from one replica while another serves it
            out.models.append(m)
        if self.ensembles is not None:
            out.models.extend(self.ensembles.index(ready_only))
        return out

    async def _indexes(self) -> dict[Replica, pb.RepositoryIndexResponse]:
        """The full index of every healthy replica that answers (each also announces its kind)."""
        healthy = [r for r in self.replicas if r.healthy]
        results = await asyncio.gather(*(r.index(False, timeout=5) for r in healthy), return_exceptions=True)
        return {r: res for r, res in zip(healthy, results, strict=True) if not isinstance(res, BaseException)}

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None:
        """Triton's explicit-mode load across the mesh: the model's kind comes from the load's
        `config` override, else from the replicas whose repository holds it (each service lists
        every model directory of its kind); every healthy replica of that kind loads it."""
        check_model_name(name)  # the access table made sure the caller is an admin (with tenants)
        self.control.check("load", name, parameters, ctx.peer, self.admission is not None)
        files = [k[len("file:"):] for k in parameters if k.startswith("file:")]
        for rel in files:
            try:
                check_file_path(rel)  # 400 here, before any service sees the request
            except InferError as exc:
                raise poll_failed(name, exc.message) from None
        override = parameters["config"].string_param if "config" in parameters else None
        if files and override is None:
            raise poll_failed(name, FILES_NEED_CONFIG)
        kind: str | None = None
        if override is not None:
            try:
                kind = layout.override_kind(name, override, files)
            except ConfigError as exc:
                raise poll_failed(name, f"Invalid config override: {exc.message}") from None
        if self.ensembles is not None and (kind == "ensemble" or (kind is None and self.ensembles.is_ensemble_dir(name))):
            await self._load_ensemble(name, override, ctx)
            return
        indexes = await self._indexes()
        owners = [r for r, idx in indexes.items() if any(m.name == name for m in idx.models)]
        if kind is not None:
            targets = [r for r in indexes if r.kind == kind] or [r for r in owners if r.kind is None]
            if not targets:
                raise _no_service(name, kind)
        elif owners:
            targets = owners
        else:
            raise self._not_in_repository(name)
        req = pb.RepositoryModelLoadRequest(model_name=name, parameters=parameters)
        try:
            await self._fan_out("load", name, targets, lambda r: r.load(req, timeout=600))
        finally:
            self.discovery.forget(name)  # a reload may have changed its config
            await self.discovery.refresh()

    def _not_in_repository(self, name: str) -> InferError:
        """No service lists the model: Triton's error, unless the gateway's own view of the
        repository (--repository) knows a kind no healthy service serves."""
        if self.ensembles is not None and (self.ensembles.repository / name).is_dir():
            kind = layout.scan_model(self.ensembles.repository / name).kind
            if kind is not None:
                return _no_service(name, kind)
        return InferError.not_found(f"failed to load '{name}', failed to poll from model repository")

    async def _load_ensemble(self, name: str, override: str | None, ctx: RequestContext) -> None:
        """As Triton does: load the ensemble's composing models that are not loaded, then the ensemble."""
        assert self.ensembles is not None
        config = self.ensembles.load(name, override)
        for step in dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step):
            if step == name or step in self.discovery.table or (step in self.ensembles
                                                               and step not in self.ensembles.unloaded):
                continue  # served already (or an ensemble that names itself: its plan says so)
            try:
                await self.load_model(step, {}, ctx)
            except InferError as exc:
                raise InferError(exc.code, f"failed to load '{name}': composing model '{step}': {exc.message}") \
                    from None
        try:
            self.ensembles.plan(name)
        except InferError as exc:
            raise InferError.invalid(f"failed to load '{name}': {exc.message}") from None

    async def unload_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                           ctx: RequestContext) -> None:
        """Unload on every replica that lists the model. ``unload_dependents`` on an ensemble
        also unloads its composing models (Triton's rule)."""
        check_model_name(name)
        self.control.check("unload", name, parameters, ctx.peer, self.admission is not None)
        dependents = "unload_dependents" in parameters and parameters["unload_dependents"].bool_param
        if self.ensembles is not None and name in self.ensembles:
            config = self.ensembles.unload(name)
            if dependents and config is not None:
                for step in dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step):
                    await self.unload_model(step, {}, ctx)
            return
        indexes = await self._indexes()
        owners = [r for r, idx in indexes.items() if any(m.name == name for m in idx.models)]
        req = pb.RepositoryModelUnloadRequest(model_name=name, parameters=parameters)
        try:
            await self._fan_out("unload", name, owners, lambda r: r.unload(req, timeout=600))
        finally:
            await self.discovery.refresh()

    async def _fan_out(self, action: str, name: str, replicas: list[Replica],
                       fn: Callable[[Replica], Awaitable[object]]) -> None:
        """Run a load/unload on every replica at once; when some fail, one error names each
        failed replica and why, and the replicas where it worked."""
        results = await asyncio.gather(*(fn(r) for r in replicas), return_exceptions=True)
        failed: list[tuple[Replica, InferError]] = []
        for r, res in zip(replicas, results, strict=True):
            if isinstance(res, BaseException):
                failed.append((r, r.error(res)))
        if not failed:
            return
        first = failed[0][1]
        # a replica's own failure (not the request's) is UNAVAILABLE: never a 500 for it
        code = first.code if first.code not in (Code.INTERNAL, Code.UNKNOWN) else Code.UNAVAILABLE
        if len(replicas) == 1:
            raise InferError(code, first.message)
        done = [r.endpoint for r in replicas if all(r is not f for f, _ in failed)]
        if done and code is Code.NOT_FOUND:
            code = Code.UNAVAILABLE  # other replicas have the model: the mesh is inconsistent, not the request
        why = "; ".join(f"service {r.endpoint}: {e.message.removeprefix(f'service {r.endpoint}: ')}"
                        for r, e in failed)
        ok = f"; {action}ed on {', '.join(done)}" if done else ""
        raise InferError(code, f"failed to {action} '{name}' on {len(failed)} of {len(replicas)} replicas: {why}{ok}")

    async def metrics_text(self) -> tuple[bytes, str]:
        federated = await self._federated() if self.federate_metrics else []  # first: it sets federated_up
        samples, families = self.own_metrics()
        return metrics.render(samples, families, federated), metrics.CONTENT_TYPE

    def own_metrics(self) -> tuple[list[metrics.Sample], dict[str, metrics.Family]]:
        """This process's samples, and the families they and the services' belong to."""
        samples = self._metric_samples()
        families = GATEWAY_FAMILIES
        if self.ensembles is not None or self.federate_metrics:  # Triton's families: ensembles, services
            families = {**GATEWAY_FAMILIES, **metrics.MODEL_FAMILIES}
            if self.ensembles is not None:
                samples += self.ensembles.metric_samples()
        return samples, families

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
        for endpoint, up in sorted(self._federated_up.items()):
            samples.append(("federated_up", {"replica": endpoint}, up))
        if self.routes is not None:
            for (route, arm, outcome), n in sorted(self.routes.arm_counts.items()):
                samples.append(("route_requests", {"route": route, "arm": arm, "outcome": outcome}, n))
            for (route, model, outcome), n in sorted(self.routes.shadow_counts.items()):
                samples.append(("shadow_requests", {"route": route, "model": model, "outcome": outcome}, n))
        return samples

    async def _federated(self) -> list[metrics.Federated]:
        """The healthy replicas' metric families, each sample labelled ``replica``; one scrape of
        the services at a time, reused for FEDERATION_REUSE_S."""
        now = time.monotonic()
        if self._federation is None or (self._federation.done() and now - self._federated_at > FEDERATION_REUSE_S):
            self._federated_at = now
            self._federation = asyncio.ensure_future(self._scrape_replicas())
        return await asyncio.shield(self._federation)

    async def _scrape_replicas(self) -> list[metrics.Federated]:
        healthy = [r for r in self.replicas if r.healthy]
        results = await asyncio.gather(*(r.scrape(b"", timeout=FEDERATION_TIMEOUT_S) for r in healthy),
                                       return_exceptions=True)
        out: list[metrics.Federated] = []
        up = {r.endpoint: 0 for r in self.replicas}  # an unhealthy replica is not asked: 0
        texts = {r.endpoint: res.decode() for r, res in zip(healthy, results, strict=True)
                 if not isinstance(res, BaseException)}
        # A family a model defines (a python model's custom metric) that one replica alone has keeps
        # the model's own labels, as Triton shows it (NVIDIA's custom_metrics example looks for
        # `requests_process_latency_ns{model="custom_metrics",version="1"}`); several replicas'
        # samples of it need `replica` to stay apart.
        seen = Counter(name for text in texts.values() for name in set(metrics.family_names(text))
                       if metrics.is_model_defined(name))
        bare = frozenset(name for name, n in seen.items() if n == 1)
        for r, res in zip(healthy, results, strict=True):
            if isinstance(res, BaseException):
                log.debug("metrics of %s not federated: %s", r.endpoint, res)
                continue
            try:
                out.append(metrics.federate(texts[r.endpoint], {"replica": r.endpoint}, bare))
            except Exception as exc:  # an unreadable exposition costs that replica's families, not the scrape
                log.warning("metrics of %s not federated: unreadable exposition: %s", r.endpoint, exc)
                continue
            up[r.endpoint] = 1
        self._federated_up = up
        return out


async def _once(answer: Awaitable[InferResult]) -> AsyncIterator[tuple[pb.ModelInferResponse | None, bool]]:
    yield (await answer).message(), True


def _no_service(name: str, kind: str) -> InferError:
    return InferError.unavailable(f"failed to load '{name}': no healthy service replica serves its kind ({kind})")


_STATE_RANK = {"READY": 3, "LOADING": 2, "UNLOADING": 1}  # merging replicas' index entries: higher wins


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
