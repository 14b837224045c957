"""The gateway's infer path as a pipeline of stages, assembled once (``assemble``).

Each stage is a plain object that does one thing and hands the request to ``next``:

    Names → Outcomes → Turns → [Admit] → [Cache] → [ABRoutes] → [Ensembles] → [Place] → Forward

``infer(request, ctx, sequence)`` answers a unary call and ``stream(request, ctx, sequence)``
a client's streaming call for a decoupled model (``(response or None, final)`` pairs; the
outer two stages take no ``sequence``: ``Turns`` is where it is read). A stage whose policy is
not configured (no --tenants, --cache-config, --routes, --repository or lazy models) is not in the chain at all, and a stage
that has nothing to do for a request (no sequence id, not a route, not an ensemble) returns the
next stage's awaitable from a plain method: no coroutine frame of its own. The chain is built
once, at start: running it allocates nothing per request but the coroutines of the stages that
wait (``Outcomes``, and the one ``Forward`` picks for the way the request goes: a merge joins
``Coalescer.submit``'s directly) and a sequence's turn. ``Names`` reads the model name and the
parameters once and hands them to ``Outcomes``, which takes a request without parameters past
``Turns`` (nothing for it to read) and counts it by the name read (the request's own only where
an A/B route may have renamed it).

A new policy is one class here with ``infer`` (and ``stream`` where a streamed request needs it)
and one line in ``assemble``, at the place its order constraints give it.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Protocol

from gateway import pipeline_streams as streams
from gateway.auth import Admission, Admitted
from gateway.cache import CacheStage
from gateway.ensemble.catalog import EnsembleCatalog
from gateway.placement import Placement
from gateway.routes import ABRouter
from gateway.routing.ab import Route
from gateway.routing.table import SEQUENCE_ID, sequence_affinity
from gateway.turns import SequenceTurns
from gateway.upstream.coalesce import Coalescer
from gateway.upstream.merging import _UNKNOWN, ModelShape, _known, _layout, merge_key
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.native import mypyc_attr
from meshserve.protocol import hop
from meshserve.protocol.errors import InferError
from meshserve.repository.names import check_model_name, check_version
from meshserve.server.core import (
    UNARY_DECOUPLED_GRPC,
    InferResult,
    RequestContext,
    StreamAnswer,
    unary_decoupled_error,
)
from meshserve.telemetry import tracing

Answer = tuple[pb.ModelInferResponse | None, bool]  # a streamed answer inside the pipeline (None: an empty final)
Answers = AsyncGenerator[Answer, None]
Params = Any  # a request's parameters (a upb map of str -> pb.InferParameter)
Result = Coroutine[Any, Any, InferResult]  # what ``infer`` returns: the awaitable, not yet awaited
ConfigFor = Callable[[str, str], mc.ModelConfig | None]  # Discovery.config_for
Laid = tuple[bytes, "bytes | None", Any]  # a layout of request bytes (merging._layout's, and what goes with it)
# Parameters without a sequence id nor a hop's private name, read by ``Names`` from a request of
# a layout seen before (``Names._seen``): ``Outcomes`` needs only that there are some and none is
# ``SEQUENCE_ID`` (a path that reads them reads the request's own: ``Outcomes.infer``)
PLAIN: Params = frozenset()
_VALID_NAMES_KEPT = 4096  # bounded: a client sending random valid names cannot grow it further
FACTS_KEPT = 1024  # per-config merge facts kept (all dropped when full: one rebuild each)


class Stage(Protocol):
    """A stage after ``Turns``: ``sequence`` is the request's sequence key (or None)."""

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
              ) -> Result: ...

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
               ) -> Answers: ...


class Forwarding(Stage, Protocol):
    """What ``Outcomes`` and ``assemble`` need of the last stage (``Forward``). (A protocol:
    compiled, a value typed with a class refuses any other type; unit tests give their own.)"""

    upstream: Upstream

    def named(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None, name: str,
              version: str, outcomes: Outcomes | None = None, config: mc.ModelConfig | None = None,
              laid: Laid | None = None) -> Result: ...


class Names:
    """A client request's model name, version and parameter names, before anything routes or
    counts it (an invalid name is never forwarded, nor a metric label); a streaming call for a
    model that is not decoupled takes the unary path (one answer, coalescing included)."""

    next: Outcomes

    def __init__(self, decoupled: Callable[[str, str], bool]):
        self._decoupled = decoupled  # GatewayCore.is_decoupled
        self._valid: set[str] = set()  # names that passed the names rule (a set lookup, not its regex)
        # The last request bytes' layout that passed ``check`` (merging._layout: all its bytes but the
        # id's and the tensors' contents) and what ``check`` read from it: (head, mid, (name, version,
        # PLAIN or None)). A request with the same layout (merging._known: two byte comparisons and a
        # step per tensor) has the same name, version and parameters; its upb reads are skipped.
        self._seen: tuple[bytes, bytes | None, tuple[str, str, Params | None]] | None = None
        self._misses = 0  # requests since the last that took a layout (see ``_remember``)

    def check(self, request: pb.ModelInferRequest) -> tuple[str, str, Params | None]:
        """(the model name, its version, the request's parameters or None when it has none):
        read once here and handed on (each upb field read costs ~750 instructions and makes a
        new object)."""
        name = request.model_name
        if name not in self._valid:
            check_model_name(name)
            if len(self._valid) < _VALID_NAMES_KEPT:
                self._valid.add(name)
        version = request.model_version
        if version:
            check_version(version, name)
        params = request.parameters
        if not params:
            return name, version, None
        for key in params:  # (a client's request carries none of the hop's private parameters)
            if key.startswith(hop.PRIVATE_PREFIX):
                raise InferError.invalid(f"request parameter '{key}' is reserved for meshserve's own hops; "
                                         f"parameters starting with '{hop.PRIVATE_PREFIX}' may not be sent")
        return name, version, params

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> Result:
        raw = ctx.raw
        if raw is not None:
            seen = self._seen
            if seen is not None and _known(raw, seen) is not _UNKNOWN:
                name, version, params = seen[2]
                self._misses = 0
                return self.next.infer(request, ctx, name, version, params, seen)
            name, version, params = self.check(request)
            self._remember(raw, name, version, params)
            return self.next.infer(request, ctx, name, version, params)
        name, version, params = self.check(request)
        return self.next.infer(request, ctx, name, version, params)

    def _remember(self, raw: bytes, name: str, version: str, params: Params | None) -> None:
        """Keep the layout of ``raw``, which passed ``check``, for the requests after it
        (``_seen``). Parameters with a sequence id are never kept (``Turns`` reads them). The
        first miss after a hit takes the new layout, later ones one in 64: a client whose layouts
        change with every request (ids of 128 bytes or more, fields out of protobuf's order) pays
        the walk (``_layout``) for one request in 64."""
        misses = self._misses
        self._misses = misses + 1 if misses < 63 else 0
        if misses or (params is not None and SEQUENCE_ID in params):
            return
        if (layout := _layout(raw)) is not None:
            self._seen = (layout[0], layout[1], (name, version, None if params is None else PLAIN))

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncGenerator[StreamAnswer, None]:
        return streams.names(self, request, ctx)  # (an async generator: interpreted, pipeline_streams.py)


class Turns:
    """A sequence's requests go on one at a time, in arrival order (gateway/turns.py), all to one
    replica: the sequence key is parsed here, once, and travels with the request."""

    next: Stage

    def __init__(self, turns: SequenceTurns):
        self.turns = turns

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
              ) -> Result:
        return self.infer_with(request, ctx, request.parameters)

    def infer_with(self, request: pb.ModelInferRequest, ctx: RequestContext, params: Params) -> Result:
        """``infer`` with the request's parameters read already (``Outcomes``: from ``Names``)."""
        if SEQUENCE_ID in params and (sequence := sequence_affinity(params)) is not None:
            return self.turns.run((request.model_name, sequence), lambda: self.next.infer(request, ctx, sequence))
        return self.next.infer(request, ctx, None)

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
               ) -> Answers:
        params = request.parameters
        if SEQUENCE_ID in params and (sequence := sequence_affinity(params)) is not None:
            return streams.turn(self, request, ctx, sequence)  # (the sequence's next waits for its last answer)
        return self.next.stream(request, ctx, None)


# (before Outcomes, which names it: compiled, a Python class's annotation of a native class defined
# after it crashes the module's import)
@mypyc_attr(native_class=False)  # (compiled: a Python class, its class defaults and methods as in pure Python)
class Outcomes:
    """Every request that passed the name check is counted once, here, by the model it went to
    (an A/B route's target once the arm is chosen: ``request.model_name`` when it ends) and its
    outcome: ``meshserve_gateway_requests_total``. A request without parameters (no sequence
    id) goes past ``Turns`` (``past_turns``: the stage after it) without a look; where that
    stage is ``Forward`` (no policy configured: nothing can rename the request on the way), it
    gets the name and version ``Names`` read (``forward``: two upb reads fewer)."""

    next: Turns
    past_turns: Stage
    forward: Forwarding | None = None  # past_turns, when it is Forward (or Ensembles then Forward)
    cache: CacheStage | None = None  # past_turns, when it is the cache (CacheStage.named)
    # past_turns is Ensembles and Forward comes next: the ensembles' names go by ``_counted``
    # (through Ensembles), any other name straight to ``forward``
    ensembles: EnsembleCatalog | None = None

    def __init__(self, counts: Counter[tuple[str, str]], renames: bool):
        self.counts = counts
        self.renames = renames  # an A/B route may point the request at another name (ABRoutes)

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, name: str, version: str,
              params: Params | None, laid: Laid | None = None) -> Result:
        """The request's coroutine, counted (``laid``: the layout ``Names`` found the request's bytes
        in, handed to ``Forward.named``): a request without parameters where ``Forward`` is
        the stage past ``Turns`` gets ``Forward``'s own coroutine, which counts it (``ended``,
        ``failed``: no coroutine of this stage's per request); where the cache is (and no A/B
        route can rename the request), ``CacheStage.named``'s, which counts it the same way;
        any other, ``_counted``'s. Where ``Forward`` is past ``Turns``, parameters without a
        sequence id (perf_analyzer sends ``triton_enable_empty_final_response`` with every
        request) have nothing for ``Turns``, which would hand the request on unchanged: they take
        ``Forward``'s own coroutine as well (the cache's path keeps ``_counted``: its key and its
        rules read the parameters). Where ``Ensembles`` and then ``Forward`` are past ``Turns``
        (``--repository`` without other policies: the usual deployment), a name that is not an
        ensemble takes ``Forward``'s coroutine the same way; an ensemble's goes by ``_counted``."""
        forward = self.forward
        if forward is not None and (ensembles := self.ensembles) is not None and name in ensembles:
            forward = None  # (an ensemble: run by the Ensembles stage)
        if params is None:
            cache = self.cache
            if forward is not None or (cache is not None and not self.renames):
                try:
                    return forward.named(request, ctx, None, name, version, self, None, laid) if forward is not None \
                        else cache.named(request, ctx, name, version, self)  # type: ignore[union-attr]
                except InferError as exc:  # (refused before it left: counted as it would be inside)
                    raise self.failed(name, exc, ctx.protocol) from None
        elif forward is not None and SEQUENCE_ID not in params:
            try:
                return forward.named(request, ctx, None, name, version, self, None, laid)
            except InferError as exc:
                raise self.failed(name, exc, ctx.protocol) from None
        return self._counted(request, ctx, name, version, request.parameters if params is PLAIN else params)

    async def counting(self, answer: Result, name: str, protocol: str) -> InferResult:
        """``answer`` awaited and counted under ``name`` (``CacheStage.named``'s paths other than
        its lead and ``Forward``'s, which count their own)."""
        try:
            result = await answer
        except InferError as exc:
            raise self.failed(name, exc, protocol) from None
        self.counts[(name, "OK")] += 1
        return result

    async def _counted(self, request: pb.ModelInferRequest, ctx: RequestContext, name: str, version: str,
                       params: Params | None) -> InferResult:
        try:
            if params is not None:
                result = await self.next.infer_with(request, ctx, params)
            elif (cache := self.cache) is not None:
                result = await cache.named(request, ctx, name, version)
            else:
                result = await self.past_turns.infer(request, ctx, None)
        except InferError as exc:
            raise self.failed(request.model_name if self.renames else name, exc, ctx.protocol) from None
        self.counts[(request.model_name if self.renames else name, "OK")] += 1
        return result

    def failed(self, name: str, exc: InferError, protocol: str) -> InferError:
        """Count a request of ``name`` that ended with ``exc``; the error for the client (the
        service's words for a unary call on a decoupled model put in the client's protocol's).
        An answered one is counted by ``self.counts[(name, "OK")] += 1``, inline where it ends."""
        self.counts[(name, exc.code.value)] += 1
        if exc.message == UNARY_DECOUPLED_GRPC and protocol == "http":  # the service's words for gRPC
            return unary_decoupled_error(protocol)
        return exc

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncGenerator[StreamAnswer, None]:
        return streams.outcomes(self, request, ctx)


class Admit:
    """The tenant's quota and share (gateway/auth.py:Admission), held until the answer (a
    streamed request: its last answer). Tenants see route names, not the arms behind them."""

    next: Stage

    def __init__(self, admission: Admission, config_for: ConfigFor):
        self.admission = admission
        self._config_for = config_for

    async def _admit(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Admitted:
        idle_s = self._sequence_idle_s(request) if sequence is not None else 0.0
        span = tracing.current_span() if tracing.enabled else None
        if span is None:
            return await self.admission.admit(request, ctx, sequence, idle_s)
        started = time.time_ns()
        try:
            admitted = await self.admission.admit(request, ctx, sequence, idle_s)
        except InferError as exc:
            tracing.emit_span("gateway.admission", span, started, time.time_ns(),
                              {"meshserve.error_code": exc.code.value}, error=f"{exc.code.value}: {exc}")
            raise
        tracing.emit_span("gateway.admission", span, started, time.time_ns(),
                          {"meshserve.tenant": admitted.tenant or "(anonymous)"})
        return admitted

    def _sequence_idle_s(self, request: pb.ModelInferRequest) -> float:
        """A sequence model's idle timeout (Triton's default 1 s), for how long its tenant keeps it."""
        config = self._config_for(request.model_name, request.model_version)
        if config is None:
            return 0.0
        return (config.sequence_batching.max_sequence_idle_microseconds or 1_000_000) / 1e6

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Result:
        # (released in a finally that awaits: interpreted, pipeline_streams.py, as mypyc can leave
        # a cancelled coroutine's error behind there: docs/perf/native.md)
        return streams.admitted_infer(self, request, ctx, sequence)

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Answers:
        return streams.admitted(self, request, ctx, sequence)


class ABRoutes:
    """An A/B route (--routes): pick the arm (``ABRouter.choose`` points the request at its
    target and starts a shadow copy if one is due), mark each answer with the arm, count the
    arm's outcome. Any other name goes on untouched."""

    next: Stage

    def __init__(self, routes: ABRouter, target_decoupled: Callable[[str, str], bool]):
        self.routes = routes
        self._target_decoupled = target_decoupled

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
              ) -> Result:
        route = self.routes.lookup(request.model_name)
        if route is None:
            return self.next.infer(request, ctx, sequence)
        return self._routed(route, request, ctx, sequence)

    async def _routed(self, route: Route, request: pb.ModelInferRequest, ctx: RequestContext,
                      sequence: str | None) -> InferResult:
        target = self.routes.choose(route, request, ctx, sequence)  # the request now names the target
        try:
            result = await self.next.infer(request, ctx, sequence)
        except InferError as exc:
            self.routes.failed(route, target, exc)
            raise
        return self.routes.answered(route, target, result)

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
               ) -> Answers:
        route = self.routes.lookup(request.model_name)
        if route is None:
            return self.next.stream(request, ctx, sequence)
        return streams.routed(self, route, request, ctx, sequence)


class Ensembles:
    """An ensemble of --repository runs here, as a DAG over the services
    (gateway/ensemble/catalog.py); any other model goes on to its service."""

    next: Stage

    def __init__(self, ensembles: EnsembleCatalog):
        self.ensembles = ensembles

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
              ) -> Result:
        if request.model_name not in self.ensembles:
            return self.next.infer(request, ctx, sequence)
        return self._run(request, ctx, sequence)

    async def _run(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> InferResult:
        return InferResult(message=await self.ensembles.infer(request, ctx.time_remaining(), sequence, ctx.protocol))

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
               ) -> Answers:
        if request.model_name not in self.ensembles:
            return self.next.stream(request, ctx, sequence)
        return self.ensembles.infer_stream(request, ctx.time_remaining(), sequence)


class Place:
    """The model mesh (--model-control-mode lazy, gateway/placement.py): a managed model that no
    healthy replica serves is loaded first (the request waits for the load, within its deadline,
    holding its admission); a request a replica answers with "unknown model" (it evicted the model
    after the routing table was read: the request never ran) is placed and sent once more. A
    model the policy does not manage goes on untouched."""

    next: Stage

    def __init__(self, placement: Placement):
        self.placement = placement

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
              ) -> Result:
        if not self.placement.manages(request.model_name):
            return self.next.infer(request, ctx, sequence)
        return self._placed(request, ctx, sequence)

    async def _placed(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
                      ) -> InferResult:
        placement, name, version = self.placement, request.model_name, request.model_version
        await placement.ready(name, version, ctx.time_remaining())
        return await placement.resend(name, version, ctx.time_remaining, lambda: self.next.infer(request, ctx, sequence))

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
               ) -> Answers:
        if not self.placement.manages(request.model_name):
            return self.next.stream(request, ctx, sequence)
        return streams.placed(self, request, ctx, sequence)


@mypyc_attr(native_class=False)  # (compiled: a Python class, its methods patchable; native.md)
class Forward:
    """The last stage: the request goes to its service through the coalescer and the
    ``Upstream`` (gateway/upstream/). A model with nothing in the coalescer sends at once
    (``Coalescer.send_alone``: no merge check) unless its last wave was merged
    (``Coalescer.crowded``: then the wave's first request joins the pass's flush with the
    rest); a request the merge check accepts (gateway/upstream/merging.py:merge_key) joins the
    coalescer; any other is sent alone."""

    def __init__(self, upstream: Upstream, coalescer: Coalescer):
        self.upstream = upstream
        self.coalescer = coalescer
        self.coalesce = bool(coalescer.batches_per_replica)  # --coalesce-inflight 0: never merge
        self._config_for = upstream.discovery.config_for
        self._facts: dict[int, tuple[mc.ModelConfig, ModelShape | None, bool]] = {}  # facts()

    def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> Result:
        """The coroutine of the way the request goes (a plain method: no frame of its own, so a
        merged request's chain is one coroutine shorter). The service's words for a unary call
        on a decoupled model are put in the client's protocol's by ``Outcomes``."""
        return self.named(request, ctx, sequence, request.model_name, request.model_version)

    def named(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None, name: str,
              version: str, outcomes: Outcomes | None = None, config: mc.ModelConfig | None = None,
              laid: Laid | None = None) -> Result:
        """``infer`` of a request whose model name and version were read already (read once,
        handed on: ``Outcomes.forward``, where no stage before this one can rename it). With
        ``outcomes`` the returned coroutine counts the request's outcome there (``Outcomes.failed``;
        one coroutine fewer per request than ``Outcomes`` awaiting it). ``config``: the served
        config of (name, version) when the caller looked it up just now (gateway/cache.py:
        CacheStage.named, the stage before this one: the same ``Discovery.config_for``). ``laid``:
        the layout ``Names`` found the request's bytes in (``Names._seen``): where the model's
        merge key remembers the same layout (``ModelShape.layout``), its answer is the request's."""
        deadline = ctx.deadline  # (ctx.time_remaining(), inline)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        raw = ctx.raw
        if config is None:
            config = self._config_for(name, version)
        facts = None if config is None else self._facts.get(id(config))
        if config is not None and (facts is None or facts[0] is not config):
            facts = self.facts(config)
        if facts is not None and facts[2]:
            raise unary_decoupled_error(ctx.protocol)  # (a streaming call comes by stream)
        if self.coalesce:
            coalescer = self.coalescer
            idle = name not in coalescer.busy
            if idle:
                crowded = coalescer.crowded
                if name not in crowded:  # idle, one request at a time: nothing to merge with, no merge check
                    return self._alone(request, name, version, raw, timeout, sequence, outcomes, ctx.protocol,
                                       True, ctx.stream)
                # the first request of a wave (the last one was merged): it waits for this pass's
                # flush with the rest of its wave (one hop message); a wave of one forgets it
                crowded.discard(name)
            if facts is not None and (shape := facts[1]) is not None:
                # (the merge key's layout is the one Names found the bytes in: its answer, without a second walk)
                found = lay[0][2] if laid is not None and raw is not None and (lay := shape.layout) and \
                    lay[0][0] == laid[0] and lay[0][1] == laid[1] else merge_key(request, shape, raw)
                if found is not None:  # a sampled request may be merged too
                    return coalescer.submit(found[0], request, raw, found[1], shape, timeout, name, outcomes,
                                            ctx.protocol, idle)
            return self._alone(request, name, version, raw, timeout, sequence, outcomes, ctx.protocol, idle, ctx.stream)
        return self._alone(request, name, version, raw, timeout, sequence, outcomes, ctx.protocol, False, ctx.stream)

    async def _alone(self, request: pb.ModelInferRequest, name: str, version: str, raw: bytes | None,
                     timeout: float | None, sequence: str | None, outcomes: Outcomes | None, protocol: str,
                     alone: bool = True, client_stream: str | None = None) -> InferResult:
        """``Coalescer.send_alone`` (``alone``: requests arriving meanwhile see the model busy;
        else just sent), without a frame of its own; counted by ``outcomes`` (see ``named``)."""
        busy = self.coalescer.busy
        if alone:
            busy[name] = busy.get(name, 0) + 1
        try:
            # (InferResult's message positionally: a call with keywords costs ~1.2k instructions more)
            result = InferResult(await self._send(request, name, version, raw, timeout, sequence, client_stream))
        except InferError as exc:
            if outcomes is None:
                raise
            raise outcomes.failed(name, exc, protocol) from None
        finally:
            if alone:
                self.coalescer.done(name)
        if outcomes is not None:
            outcomes.counts[(name, "OK")] += 1
        return result

    def _send(self, request: pb.ModelInferRequest, name: str, version: str, raw: bytes | None,
              timeout: float | None, sequence: str | None, client_stream: str | None = None
              ) -> Coroutine[Any, Any, pb.ModelInferResponse]:
        """``Upstream.send``; a client's bytes with tracing off go straight to ``Upstream.infer``
        with the name and version read already (``client_stream``: Upstream.infer's)."""
        if raw is None or tracing.enabled:
            return self.upstream.send(request, raw, timeout, sequence, client_stream)
        return self.upstream.infer(name, version, request.id, raw, timeout, sequence, client_stream)

    def stream(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
               ) -> Answers:
        """Marked as streamed, never merged: every answer of the service as it arrives."""
        return self.upstream.stream(request, ctx.raw, ctx.time_remaining(), sequence, ctx.stream)

    def facts(self, config: mc.ModelConfig) -> tuple[mc.ModelConfig, ModelShape | None, bool]:
        """(config, what the merge check needs or None when its requests never merge, decoupled),
        worked out once per config (held by its id while discovery holds the config)."""
        facts = self._facts.get(id(config))
        if facts is None or facts[0] is not config:
            if len(self._facts) >= FACTS_KEPT:  # (configs replaced by reloads: dropped, not kept forever)
                self._facts.clear()
            facts = self._facts[id(config)] = (config, ModelShape.of(config),
                                               config.model_transaction_policy.decoupled)
        return facts


def assemble(counts: Counter[tuple[str, str]], turns: SequenceTurns, forward: Forwarding,
             decoupled: Callable[[str, str], bool], target_decoupled: Callable[[str, str], bool],
             admission: Admission | None = None, routes: ABRouter | None = None,
             ensembles: EnsembleCatalog | None = None, cache: CacheStage | None = None,
             placement: Placement | None = None) -> Names:
    """The gateway's infer path, in order; the first stage is returned. The order, and why:

    1. ``Names``: nothing routes, counts or forwards a request whose model name, version or
       parameter names are refused (an invalid name never becomes a metric label).
    2. ``Outcomes``: outside every policy, so each request is counted exactly once whichever
       stage ends it (a refused admission, a failed arm, the service's answer).
    3. ``Turns``: before admission, so a sequence's requests are admitted in arrival order too
       (one waiting on the quota store cannot be overtaken by the next).
    4. ``Admit``: before the A/B choice, so a tenant's quota, share and allowed models apply to
       the name the client called (a route's name, not the arm behind it).
    5. ``CacheStage`` (--cache-config, gateway/cache.py): after ``Admit``, so a hit still
       counts against the tenant's quota and is refused to a tenant that may not call the
       model (a tenant reaches an entry only through a request it was admitted for), and
       before ``ABRoutes``. The A/B rule: an A/B route's name is never cached (its arm is
       chosen after this stage, so no hit can answer from an arm the route would not have
       picked); a request that names a model directly is cached by that model's own config.
       An ensemble whose own config enables the cache is cached as a whole here (before
       ``Ensembles`` runs it); a step whose model's own config enables it is looked up per
       step (the executor sends it through gateway/cache.py:CacheStage.step, not this chain).
    6. ``ABRoutes``: rewrites the request to its arm's target, which may itself be an ensemble.
    7. ``Ensembles``: an ensemble runs in the gateway; its steps go to ``Upstream`` directly.
    8. ``Place`` (lazy models, gateway/placement.py): after ``Admit``, so a tenant's request for
       a model it may not use never triggers a load, and a flood of requests for cold models is
       bounded by admission (each waits holding its slots); after ``ABRoutes``, so the arm's
       target is what gets loaded. An ensemble's steps go to ``Upstream`` directly, placed by
       the same ``Placement.ready`` / ``resend`` (docs/model-mesh.md, "Ensembles over lazy models").
    9. ``Forward``: the coalescer and ``Upstream``.
    """
    turn = Turns(turns)
    stages: list[Stage] = [turn]
    if admission is not None:
        stages.append(Admit(admission, forward.upstream.discovery.config_for))
    if cache is not None:
        stages.append(cache)
    if routes is not None:
        stages.append(ABRoutes(routes, target_decoupled))
    if ensembles is not None:
        stages.append(Ensembles(ensembles))
    if placement is not None:
        stages.append(Place(placement))
    stages.append(forward)
    for stage, after in zip(stages, stages[1:], strict=False):
        stage.next = after  # type: ignore[attr-defined]  # (Forward has no next)
    head = Names(decoupled)
    head.next = Outcomes(counts, renames=routes is not None)
    head.next.next = turn
    head.next.past_turns = stages[1]
    if stages[1] is forward:
        head.next.forward = forward
    elif len(stages) == 3 and isinstance(stages[1], Ensembles) and stages[2] is forward:
        head.next.forward, head.next.ensembles = forward, ensembles  # (a name that is not an ensemble: Forward)
    elif stages[1] is cache:
        head.next.cache = cache
    if cache is not None and cache.next is forward:
        # (a miss hands Forward the name, version and config read: with no Ensembles stage the
        # cache's config look-up, GatewayCore._cache_config_for, is Forward's Discovery.config_for)
        cache.forward = forward
    return head

