"""The model mesh at the gateway (docs/model-mesh.md): lazy loading, placement across the
replicas of a kind, copies that follow demand, and what the gateway shows about it.

A model the policy manages (``--model-control-mode lazy``, or ``--lazy-model NAME``, or pinned)
that no healthy replica serves is loaded on its first request: one load per model at a time
(the requests that arrive meanwhile wait for it, each within its own deadline and its admission:
they hold their tenant's and the process's slots while they wait), at most
``--max-concurrent-loads`` loads at once, on the replicas its kind's services list it on, tried
in the order ``gateway/routing/placement.py:rank`` gives (weighted rendezvous hashing: every
gateway tries the same replica first). A replica that refuses for room (RESOURCE_EXHAUSTED: its
budget is full of models it may not evict) or is gone is skipped for the next; when none takes
it the request is answered UNAVAILABLE with Retry-After. A load that fails for the model's own
reason answers every waiting request with that reason, and the same answer is given for
``FAILED_HOLD_S`` without another load (a broken model cannot be made to load in a loop).
With ``--tenants`` a load counts against the tenant whose request started it
(``gateway/auth.py:CALLER``; anonymous callers as one tenant) from its start to its end, queued
or running, at most max(1, ``--max-concurrent-loads`` x its share) at once: a request that would
start one more waits in its tenant's own line, within its deadline, and no load starts for it
meanwhile (``Placement._start``); a request that joins a load in flight never waits for a share.

Every ``--placement-interval`` the gateway reads each healthy replica's repository index (which
models its kind lists) and its metrics (budget, memory used, each model's size and pending
count; on a replica with GPUs each GPU's budget and device memory used, and each model's device
size), and moves copies: pinned models are placed (on ``min_copies`` replicas), a model whose
pending count per copy stayed high gets a copy more, one idle for ``--scale-down-idle`` a copy
fewer (never under its ``min_copies``).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import re
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gateway.auth import CALLER
from gateway.routing import placement as arith
from gateway.upstream.replica import CALL_ERRORS, Replica
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import Code, InferError, model_not_found
from meshserve.repository import layout
from meshserve.repository.config import load_model_config
from meshserve.repository.errors import ConfigError
from meshserve.server.admission import tenant_cap
from meshserve.telemetry import metrics

log = logging.getLogger("meshserve.gateway.placement")
T = TypeVar("T")

LOAD_TIMEOUT_S = 600.0  # one load on one replica
CALL_TIMEOUT_S = 5.0  # an index or a scrape of one replica
PLACE_RETRY_S = 2.0  # every replica refused a load for room: tried again for this long
PLACE_ATTEMPTS = 3  # sends of one request whose model was evicted (or lost) before it ran
FAILED_HOLD_S = 5.0  # a model whose load failed answers with that failure this long, without a new load
COLD_START_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RECENT_COLD_STARTS = 16  # per model, for the placement endpoint
EVICTED = "Request for unknown model"  # a service's words for a model it does not hold (model_not_found)

FAMILIES = {
    "cold_start": metrics.Family("meshserve_gateway_model_cold_start_seconds", "histogram",
                                 "Lazy loads this gateway started: from the first request to the model "
                                 "being served, by model"),
    "placement_loads": metrics.Family("meshserve_gateway_placement_loads_total", "counter",
                                      "Loads the gateway's placement asked a replica for, by model and outcome "
                                      "(OK, or the error code)"),
    "placement_unloads": metrics.Family("meshserve_gateway_placement_unloads_total", "counter",
                                        "Copies the gateway's placement removed (idle), by model"),
    "model_copies": metrics.Family("meshserve_gateway_model_copies", "gauge",
                                   "Healthy replicas serving the model"),
    "cold_waiting": metrics.Family("meshserve_gateway_cold_waiting_requests", "gauge",
                                   "Requests waiting for their model's lazy load"),
    "load_share_waits": metrics.Family("meshserve_gateway_lazy_load_share_waits_total", "counter",
                                       "Requests whose model's load waited for one of their tenant's loads to end "
                                       "(its share of --max-concurrent-loads in flight), by tenant"),
    "replica_memory_pressure": metrics.Family("meshserve_gateway_replica_memory_pressure", "gauge",
                                              "A replica's memory used over its budget (0..1; its own "
                                              "meshserve_memory_* figures as last read)"),
    "replica_gpu_memory_pressure": metrics.Family("meshserve_gateway_replica_gpu_memory_pressure", "gauge",
                                                  "A replica's device memory used over its budget on one GPU "
                                                  "(0..1; its own meshserve_gpu_memory_* figures as last read)"),
    "replica_saturation": metrics.Family("meshserve_gateway_replica_saturation", "gauge",
                                         "Requests queued in a replica (its nv_inference_pending_request_count "
                                         "summed over its models, as last read)"),
}


@dataclass(frozen=True)
class Policy:
    """The placement flags (``add_arguments``)."""

    lazy_all: bool = False  # --model-control-mode lazy
    lazy_models: frozenset[str] = frozenset()  # --lazy-model
    pinned: frozenset[str] = frozenset()  # --pin
    min_copies: int = 1  # --min-copies
    copies: tuple[tuple[str, int], ...] = ()  # --model-copies NAME=N
    max_loads: int = 4  # --max-concurrent-loads
    pending_per_copy: float = 8.0  # --scale-up-pending (0: never add copies for demand)
    busy_rounds: int = 3  # --scale-up-intervals
    idle_s: float = 300.0  # --scale-down-idle
    interval_s: float = 2.0  # --placement-interval
    retry_after_s: float = 2.0  # Retry-After when no replica has room

    def manages(self, name: str) -> bool:
        return self.lazy_all or name in self.lazy_models or name in self.pinned

    def min_copies_of(self, name: str) -> int:
        return next((n for m, n in self.copies if m == name), self.min_copies)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-control-mode", choices=("explicit", "lazy"), default="explicit",
                    help="lazy: a model of the services' repositories that no replica serves is loaded on its "
                         "first request, on a replica placement picks (docs/model-mesh.md); explicit (default): "
                         "the services load what they are told")
    ap.add_argument("--lazy-model", action="append", default=[], metavar="NAME",
                    help="load this model lazily even without --model-control-mode lazy (repeatable)")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME",
                    help="a model placed at start and kept on its min copies (give the services --pin too, so "
                         "that they never evict it; repeatable)")
    ap.add_argument("--min-copies", type=int, default=1, metavar="N",
                    help="replicas each lazily loaded model is placed on (default 1)")
    ap.add_argument("--model-copies", action="append", default=[], metavar="NAME=N",
                    help="min copies of one model (repeatable)")
    ap.add_argument("--max-concurrent-loads", type=int, default=4, metavar="N",
                    help="lazy loads this gateway runs at once (more wait their turn)")
    ap.add_argument("--scale-up-pending", type=float, default=8.0, metavar="N",
                    help="a model gets a copy more when its pending requests per copy stay at N or over "
                         "(0: never)")
    ap.add_argument("--scale-up-intervals", type=int, default=3, metavar="N",
                    help="... for this many placement intervals in a row")
    ap.add_argument("--scale-down-idle", type=float, default=300.0, metavar="SECONDS",
                    help="a model with more than its min copies loses one after this long without a request")
    ap.add_argument("--placement-interval", type=float, default=2.0, metavar="SECONDS",
                    help="how often placement reads the replicas' indexes and memory figures")


def policy_from_args(args: argparse.Namespace) -> Policy | None:
    """The placement policy, or None when nothing is lazy or pinned (no stage, no loop)."""
    copies = []
    for item in args.model_copies:
        name, sep, n = item.partition("=")
        if not sep or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--model-copies '{item}': expected NAME=N with N >= 1")
        copies.append((name, int(n)))
    if args.min_copies < 1 or args.max_concurrent_loads < 1:
        raise ValueError("--min-copies and --max-concurrent-loads must be at least 1")
    lazy_all = args.model_control_mode == "lazy"
    if not lazy_all and not args.lazy_model and not args.pin:
        return None
    return Policy(lazy_all, frozenset(args.lazy_model), frozenset(args.pin), args.min_copies, tuple(copies),
                  args.max_concurrent_loads, args.scale_up_pending, args.scale_up_intervals, args.scale_down_idle,
                  args.placement_interval)


# ---- what a replica says about its memory (its /metrics, over meshserve.Metrics/Scrape) ----
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_WANTED = ("meshserve_memory_budget_bytes", "meshserve_memory_used_bytes", "meshserve_memory_base_bytes",
           "meshserve_model_memory_bytes", "meshserve_gpu_memory_budget_bytes", "meshserve_gpu_memory_used_bytes",
           "meshserve_model_gpu_memory_bytes",
           "nv_inference_pending_request_count", "nv_inference_request_success", "nv_inference_request_failure",
           "meshserve_model_loads_total", "meshserve_model_evictions_total")


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the exposition's samples of the families placement reads."""
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        yield m.group(1), dict(_LABEL.findall(m.group(2) or "")), value


@dataclass
class ReplicaFacts:
    """One replica's memory and queue figures as last read (None: it does not announce them)."""

    budget: float | None = None
    used: float | None = None
    base: float | None = None  # its RSS beyond the models' budget (services/base/memory.py: the base)
    sizes: dict[str, float] = field(default_factory=dict)  # model -> bytes (all versions)
    # device memory, per GPU (its index as the replica names it): none on a replica without one
    gpu_budget: dict[str, float] = field(default_factory=dict)
    gpu_used: dict[str, float] = field(default_factory=dict)
    gpu_sizes: dict[str, float] = field(default_factory=dict)  # model -> device bytes (all versions and GPUs)
    pending: dict[str, float] = field(default_factory=dict)  # model -> queued requests
    served: dict[str, float] = field(default_factory=dict)  # model -> requests answered (ok or not)
    loads: float = 0.0
    evictions: float = 0.0

    @classmethod
    def parse(cls, text: str) -> ReplicaFacts:
        facts = cls()
        for name, labels, value in samples(text):
            model = labels.get("model", "")
            if name == "meshserve_memory_budget_bytes":
                facts.budget = value
            elif name == "meshserve_memory_used_bytes":
                facts.used = value
            elif name == "meshserve_memory_base_bytes":
                facts.base = value
            elif name == "meshserve_model_memory_bytes":
                facts.sizes[model] = facts.sizes.get(model, 0.0) + value
            elif name == "meshserve_gpu_memory_budget_bytes":
                facts.gpu_budget[labels.get("gpu", "")] = value
            elif name == "meshserve_gpu_memory_used_bytes":
                facts.gpu_used[labels.get("gpu", "")] = value
            elif name == "meshserve_model_gpu_memory_bytes":
                facts.gpu_sizes[model] = facts.gpu_sizes.get(model, 0.0) + value
            elif name == "nv_inference_pending_request_count":
                facts.pending[model] = facts.pending.get(model, 0.0) + value
            elif name.startswith("nv_inference_request_"):
                facts.served[model] = facts.served.get(model, 0.0) + value
            elif name == "meshserve_model_loads_total":
                facts.loads += value
            elif name == "meshserve_model_evictions_total":
                facts.evictions += value
        return facts


@dataclass
class ModelState:
    """What this gateway knows of one managed model beyond the routing table."""

    touched: float = 0.0  # monotonic clock of its last request here (0: none yet)
    cold_starts: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_COLD_STARTS))
    demand: arith.Demand = field(default_factory=lambda: arith.Demand(0, 0.0))
    served: float = -1.0  # its served count over the replicas at the last refresh


class Placement:
    def __init__(self, upstream: Upstream, policy: Policy, repository: str | Path | None = None):
        self.upstream = upstream
        self.discovery = upstream.discovery
        self.policy = policy
        self.repository = Path(repository) if repository is not None else None
        self.catalog: dict[str, list[str]] = {}  # model -> endpoints whose repository lists it
        self.facts: dict[str, ReplicaFacts] = {}  # endpoint -> its figures
        self.models: dict[str, ModelState] = {}  # managed models seen (bounded by the catalog)
        self.cold_start: dict[str, metrics.Histogram] = {}
        self.load_counts: Counter[tuple[str, str]] = Counter()
        self.unload_counts: Counter[str] = Counter()
        self.waiting = 0
        self._loads: dict[str, asyncio.Future[None]] = {}
        # with tenants: the loads in flight (queued or running) each tenant's requests started
        # ("" = anonymous callers; a tenant with none has no key: bounded by the tenants file)
        self.loads_held: Counter[str] = Counter()
        self.share_waits: Counter[str] = Counter()  # tenant -> requests that waited for its load share
        self._change: asyncio.Future[None] | None = None  # set when a load starts or a counted one ends
        self._failed: dict[str, tuple[float, InferError]] = {}
        self._gate: asyncio.Semaphore | None = None
        self._described: dict[str, tuple[float, mc.ModelConfig, list[int]]] = {}
        self._describing: set[str] = set()  # described() reads them in the background
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ---- the request path ----------------------------------------------------------------
    def manages(self, name: str) -> bool:
        return self.policy.manages(name)

    def serving(self, name: str, version: str) -> bool:
        """Whether a healthy replica serves (name, version) by the routing table now."""
        routes = self.discovery.table.models.get(name)
        if routes is None:
            return False
        if version:
            replicas = routes.versions.get(int(version)) if version.isdigit() else None
            return replicas is not None and any(r.healthy for r in replicas)
        return any(r.healthy for rs in routes.versions.values() for r in rs)

    def lost(self, exc: InferError, name: str, version: str) -> bool:
        """Whether ``exc`` (UNAVAILABLE) came from the replicas serving ``name`` leaving the pool:
        the Upstream ejects a replica only for a request that never reached it, so the request
        may be placed elsewhere and sent again."""
        return exc.code is Code.UNAVAILABLE and not self.serving(name, version)

    def touch(self, name: str) -> None:
        state = self.models.get(name)
        if state is None:
            if name not in self.catalog:
                return  # not a model of the repositories: nothing to remember (bounded)
            state = self.models[name] = ModelState()
        state.touched = time.monotonic()

    async def ready(self, name: str, version: str, timeout: float | None) -> None:
        """The model's last use noted; loaded first (``ensure``) when no healthy replica serves
        it. The Place stage's (gateway/pipeline.py:Place) and an ensemble step's
        (gateway/ensemble/executor.py): a step's model is placed as a direct request's is."""
        self.touch(name)
        if not self.serving(name, version):
            await self.ensure(name, timeout)

    async def resend(self, name: str, version: str, remaining: Callable[[], float | None],
                     send: Callable[[], Awaitable[T]]) -> T:
        """``send()`` (the request for ``name``, after ``ready``), placed and sent again when a
        replica answers that it does not hold the model (evicted after the table was read: the
        request never ran) or the replicas serving it left the pool: at most PLACE_ATTEMPTS
        sends, then UNAVAILABLE with Retry-After. ``remaining``: the request's time left."""
        for attempt in range(1, PLACE_ATTEMPTS + 1):
            try:
                return await send()
            except InferError as exc:
                if not evicted(exc) and not self.lost(exc, name, version):
                    raise
                if attempt == PLACE_ATTEMPTS:
                    raise InferError(Code.UNAVAILABLE, f"model '{name}' was evicted again before its request ran "
                                     "(its replicas' memory budgets are full); retry later",
                                     retry_after_s=self.policy.retry_after_s) from None
                await self.ensure(name, remaining(), stale=True)
                if self.serving(name, "") and not self.serving(name, version):
                    raise  # the model is served, but not that version: the service's answer stands
        raise AssertionError("unreachable")

    async def ensure(self, name: str, timeout: float | None, stale: bool = False) -> None:
        """Return once a healthy replica serves ``name``, loading it if none does (one load per
        model at a time; this request waits for it within ``timeout``). ``stale``: a replica
        answered that it does not hold the model (evicted since the table was read)."""
        if stale:
            await self.discovery.refresh()
            if self.serving(name, ""):
                return
        deadline = None if timeout is None else time.monotonic() + timeout
        self.waiting += 1
        try:
            load = self._loads.get(name)
            if load is None:
                load = await self._start(name, deadline)
            await asyncio.wait_for(asyncio.shield(load), None if deadline is None
                                   else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise InferError(Code.DEADLINE_EXCEEDED,
                             f"model '{name}' was still loading when the request's deadline passed") from None
        finally:
            self.waiting -= 1

    async def _start(self, name: str, deadline: float | None) -> asyncio.Future[None]:
        """The load of ``name``: the one under way (joined, whoever started it), or one started
        now. With tenants a load counts against the tenant whose request starts it
        (``gateway/auth.py:CALLER``; "" anonymous callers) until it ends (``_done``), at most
        max(1, --max-concurrent-loads x its share) at once: past that the request waits in its
        tenant's own line, within its deadline, for one of its tenant's loads to end (or for
        another request to start this model's load, which it joins); no load is started for it
        meanwhile, so a request that gives up leaves nothing behind. No tenants, or the
        gateway's own load of a pinned model (no ``CALLER``): nothing counted."""
        caller = CALLER.get()
        waited = False
        while True:
            load = self._loads.get(name)
            if load is not None:
                return load
            failed = self._failed.get(name)
            if failed is not None and time.monotonic() < failed[0]:
                raise InferError(failed[1].code, failed[1].message, retry_after_s=failed[1].retry_after_s)
            tenant = None
            if caller is not None:
                tenant, share = caller
                held = self.loads_held[tenant]
                cap = tenant_cap(self.policy.max_loads, share)
                if held >= cap:
                    if not waited:
                        waited = True
                        self.share_waits[tenant or "(anonymous)"] += 1
                    if not await self._changed(deadline):
                        who = f"tenant '{tenant}' has" if tenant else "anonymous callers have"
                        raise InferError(Code.DEADLINE_EXCEEDED,
                                         f"model '{name}' was not loaded when the request's deadline passed: {who} "
                                         f"{held} lazy model loads in flight, its share ({share:g} of "
                                         f"--max-concurrent-loads {self.policy.max_loads}: {cap})")
                    continue
                self.loads_held[tenant] = held + 1
            load = self._loads[name] = asyncio.ensure_future(self._place(name, time.monotonic()))
            load.add_done_callback(functools.partial(self._done, name, tenant=tenant))
            self._wake()
            return load

    async def _changed(self, deadline: float | None) -> bool:
        """Wait for a load to start or end (``_wake``); False: the deadline passed first."""
        if self._change is None:
            self._change = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._change), None if deadline is None
                                   else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True

    def _wake(self) -> None:
        """The requests waiting in their tenants' lines look again (``_start``)."""
        change, self._change = self._change, None
        if change is not None and not change.done():
            change.set_result(None)

    def _done(self, name: str, load: asyncio.Future[None], tenant: str | None = None) -> None:
        if tenant is not None:
            left = self.loads_held[tenant] - 1
            if left > 0:
                self.loads_held[tenant] = left
            else:
                del self.loads_held[tenant]
            self._wake()
        if self._loads.get(name) is load:
            del self._loads[name]
        if not load.cancelled() and isinstance(exc := load.exception(), InferError) \
                and exc.code is not Code.UNAVAILABLE and exc.code is not Code.NOT_FOUND:
            self._failed[name] = (time.monotonic() + FAILED_HOLD_S, exc)

    async def _place(self, name: str, started: float) -> None:
        """The lazy load of ``name``: its first copy (awaited), then its other min copies."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.policy.max_loads)
        async with self._gate:
            await self.discovery.refresh()  # another gateway (or worker) may have placed it already
            if self.serving(name, ""):
                return
            order = await self._order(name)
            await self._load_first(name, order)
            self.discovery.forget(name)
            await self.discovery.refresh()
        elapsed = time.monotonic() - started
        self.cold_start.setdefault(name, metrics.Histogram(COLD_START_BUCKETS_S)).observe(elapsed)
        self.models.setdefault(name, ModelState()).cold_starts.append(elapsed)
        state = self.models.setdefault(name, ModelState())
        if self.policy.min_copies_of(name) > 1:
            add, drop = self._plan(name, state, time.monotonic())
            self._spawn(self._quietly(self._apply(name, state, add, drop)))

    async def _order(self, name: str) -> list[Replica]:
        """The healthy replicas whose repository lists ``name``, best first (``arith.rank``)."""
        if name not in self.catalog:
            await self.refresh_catalog()  # a model directory added since the last read
        if name not in self.catalog:
            raise model_not_found(name)  # never a load for a name no service lists
        by_endpoint = {r.endpoint: r for r in self.upstream.healthy()}
        weights = {e: self._weight(e) for e in self.catalog[name] if e in by_endpoint}
        if not weights:
            raise InferError(Code.UNAVAILABLE, f"model '{name}': no healthy replica of its kind to load it on",
                             retry_after_s=self.policy.retry_after_s)
        return [by_endpoint[e] for e in arith.rank(name, weights)]

    def _weight(self, endpoint: str) -> float:
        facts = self.facts.get(endpoint)
        return facts.budget if facts is not None and facts.budget else 1.0

    async def _load_first(self, name: str, order: list[Replica]) -> Replica:
        """Load on the first of ``order`` that takes it; RESOURCE_EXHAUSTED (no room) or a replica
        that is gone moves on to the next; any other failure is the model's and ends it. When
        every replica refused for room (their models are busy: a busy model is not evicted),
        the order is tried again after a pause (busy models finish in milliseconds), for at
        most PLACE_RETRY_S, then UNAVAILABLE with Retry-After."""
        pause, waited = 0.02, 0.0
        while True:
            refused = 0
            for replica in order:
                if not replica.healthy:
                    continue
                try:
                    await self._load_on(replica, name)
                    return replica
                except InferError as err:
                    if err.code not in (Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE):
                        raise
                    refused += 1
            if waited >= PLACE_RETRY_S or not refused:
                break
            await asyncio.sleep(pause)
            waited += pause
            pause = min(pause * 2, 0.25)
        raise InferError(Code.UNAVAILABLE, f"model '{name}' could not be placed: no replica of its kind has room "
                         f"({refused} refused; retry later)", retry_after_s=self.policy.retry_after_s)

    async def _load_on(self, replica: Replica, name: str) -> None:
        try:
            await replica.load(pb.RepositoryModelLoadRequest(model_name=name), timeout=LOAD_TIMEOUT_S)
        except CALL_ERRORS as exc:
            err = replica.error(exc)
            code = err.code if err.code not in (Code.INTERNAL, Code.UNKNOWN) else Code.UNAVAILABLE
            self.load_counts[(name, code.value)] += 1
            message = err.message.removeprefix(f"service {replica.endpoint}: ")
            if not message.startswith(f"failed to load '{name}'"):
                message = f"failed to load '{name}': {message}"
            raise InferError(code, message) from None
        self.load_counts[(name, "OK")] += 1
        log.info("placement: loaded '%s' on %s", name, replica.endpoint)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- describing a model that is not loaded (metadata, config) ----------------------
    async def describe(self, name: str) -> tuple[mc.ModelConfig, list[int]] | None:
        """The config and versions of a managed model no replica serves, from --repository
        (None: no repository here, or not a model of the services' repositories)."""
        if self.repository is None or not self.manages(name):
            return None
        if name not in self.catalog:
            await self.refresh_catalog()
            if name not in self.catalog:
                return None
        path = self.repository / name
        stamp = _stamp(path)
        if stamp is None:
            return None
        kept = self._described.get(name)
        if kept is not None and kept[0] == stamp:
            return kept[1], kept[2]
        loop = asyncio.get_running_loop()
        try:
            config, versions = await loop.run_in_executor(None, _read_model, path)
        except (ConfigError, OSError):
            return None
        self._described[name] = (stamp, config, versions)
        return config, versions

    def described(self, name: str, version: str) -> mc.ModelConfig | None:
        """The config of a managed model of the services' repositories as --repository has it
        (``describe``), for an ensemble's plan while the step's model is loaded nowhere
        (gateway/ensemble/catalog.py): what ``describe`` last read; a model not read yet is
        read in the background (its files may be large: never on the loop) and None for now.
        None also: not a managed model of the repositories, or not that version."""
        kept = self._described.get(name)
        if kept is None:
            if (self.repository is not None and self.manages(name) and name in self.catalog
                    and name not in self._describing):
                try:
                    asyncio.get_running_loop()
                except RuntimeError:
                    return None  # (not on the loop: nothing to read it in)
                self._describing.add(name)
                self._spawn(self._prefetch(name))
            return None
        if version and (not version.isdigit() or int(version) not in kept[2]):
            return None
        return kept[1]

    async def _prefetch(self, name: str) -> None:
        try:
            await self.describe(name)
        finally:
            self._describing.discard(name)

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse | None:
        described = await self.describe(name)
        if described is None or (version and int(version) not in described[1]):
            return None
        return pb.ModelConfigResponse(config=described[0])

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse | None:
        described = await self.describe(name)
        if described is None or (version and int(version) not in described[1]):
            return None
        config, versions = described
        batch = [-1] if config.max_batch_size > 0 else []
        out = pb.ModelMetadataResponse(name=name, platform=config.platform or config.backend,
                                       versions=[version] if version else [str(v) for v in versions])
        for tensors, into in ((config.input, out.inputs), (config.output, out.outputs)):
            for t in tensors:
                into.add(name=t.name, datatype=datatypes.config_to_wire(t.data_type), shape=[*batch, *t.dims])
        return out

    # ---- the loop: catalog, figures, copies ----------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        for task in [self._task, *self._background]:
            if task is not None:
                task.cancel()

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep placing whatever happens
                log.exception("placement refresh failed")
            await asyncio.sleep(self.policy.interval_s)

    async def refresh_catalog(self) -> None:
        healthy = self.upstream.healthy()
        results = await self.upstream.each(healthy, lambda r: r.index(False, timeout=CALL_TIMEOUT_S))
        catalog: dict[str, list[str]] = {}
        for r, res in zip(healthy, results, strict=True):
            if isinstance(res, BaseException):
                continue
            for m in res.models:
                endpoints = catalog.setdefault(m.name, [])
                if r.endpoint not in endpoints:
                    endpoints.append(r.endpoint)
        self.catalog = catalog
        for name in [n for n in self.models if n not in catalog]:
            del self.models[name]

    async def refresh_facts(self) -> None:
        healthy = self.upstream.healthy()
        results = await self.upstream.each(healthy, lambda r: r.scrape(b"", timeout=CALL_TIMEOUT_S))
        facts: dict[str, ReplicaFacts] = {}
        for r, res in zip(healthy, results, strict=True):
            if isinstance(res, bytes):
                facts[r.endpoint] = ReplicaFacts.parse(res.decode(errors="replace"))
        self.facts = facts

    async def refresh(self) -> None:
        await self.refresh_catalog()
        await self.refresh_facts()
        now = time.monotonic()
        for name in self.catalog:
            if not self.manages(name) or name in self._loads:
                continue
            if name in self.policy.pinned and not self.serving(name, ""):
                self._spawn(self._quietly(self.ensure(name, None)))  # placed at start, again after a loss
                continue
            state = self.models.get(name)
            if state is None:
                continue
            self._measure(name, state, now)
            add, drop = self._plan(name, state, now)
            if add or drop:
                self._spawn(self._quietly(self._apply(name, state, add, drop)))

    def _hosts(self, name: str) -> list[str]:
        routes = self.discovery.table.models.get(name)
        if routes is None:
            return []
        return list(dict.fromkeys(r.endpoint for rs in routes.versions.values() for r in rs if r.healthy))

    def _measure(self, name: str, state: ModelState, now: float) -> None:
        """The model's copies, pending count and idleness from the figures just read."""
        hosts = self._hosts(name)
        demand = state.demand
        demand.copies = len(hosts)
        demand.pending = sum(self.facts[e].pending.get(name, 0.0) for e in hosts if e in self.facts)
        busy = demand.copies > 0 and demand.pending / demand.copies >= self.policy.pending_per_copy > 0
        demand.busy_rounds = demand.busy_rounds + 1 if busy else 0
        served = sum(f.served.get(name, 0.0) for f in self.facts.values())
        if served != state.served or demand.pending or now - state.touched < self.policy.interval_s:
            demand.idle_since = None
        elif demand.idle_since is None:
            demand.idle_since = now
        state.served = served

    def _plan(self, name: str, state: ModelState, now: float) -> tuple[list[str], list[str]]:
        """(replicas to load a copy on, replicas to unload one from) for a served model."""
        hosts = self._hosts(name)
        if not hosts:
            return [], []  # not served: its next request places it
        healthy = {r.endpoint for r in self.upstream.healthy()}
        weights = {e: self._weight(e) for e in self.catalog.get(name, ()) if e in healthy}
        order = arith.rank(name, weights)
        policy = self.policy
        wanted = arith.wanted_copies(state.demand, policy.min_copies_of(name), len(order), policy.pending_per_copy,
                                     policy.busy_rounds, policy.idle_s, now)
        return arith.pick_copies(order, hosts, wanted)

    async def _apply(self, name: str, state: ModelState, add: list[str], drop: list[str]) -> None:
        by_endpoint = {r.endpoint: r for r in self.upstream.healthy()}
        for endpoint in add:
            if endpoint in by_endpoint:
                await self._load_on(by_endpoint[endpoint], name)
                state.demand.busy_rounds = 0
        for endpoint in drop:
            if endpoint in by_endpoint:
                await by_endpoint[endpoint].unload(pb.RepositoryModelUnloadRequest(model_name=name),
                                                   timeout=LOAD_TIMEOUT_S)
                self.unload_counts[name] += 1
                state.demand.idle_since = None
                log.info("placement: removed an idle copy of '%s' from %s", name, endpoint)
        await self.discovery.refresh()

    @staticmethod
    async def _quietly(coro: Awaitable[None]) -> None:
        try:
            await coro
        except (InferError, *CALL_ERRORS) as exc:
            log.info("placement: %s", exc)

    # ---- what it shows -------------------------------------------------------------------
    def view(self) -> dict[str, object]:
        """The placement endpoint's answer (GET /v2/placement, `meshserve placement`)."""
        replicas = []
        for r in self.upstream.replicas:
            f = self.facts.get(r.endpoint)
            replicas.append({"endpoint": r.endpoint, "kind": r.kind, "healthy": r.healthy,
                             "budget_bytes": None if f is None else f.budget,
                             "used_bytes": None if f is None else f.used,
                             "base_bytes": None if f is None else f.base,
                             "gpus": None if f is None else {
                                 gpu: {"budget_bytes": f.gpu_budget.get(gpu), "used_bytes": f.gpu_used.get(gpu)}
                                 for gpu in sorted({*f.gpu_budget, *f.gpu_used})},
                             "pending": None if f is None else sum(f.pending.values()),
                             "loads": None if f is None else f.loads,
                             "evictions": None if f is None else f.evictions})
        models = []
        now = time.time()
        for name in sorted(self.catalog):
            state = self.models.get(name)
            hosts = self._hosts(name)
            sizes = [self.facts[e].sizes[name] for e in hosts if e in self.facts and name in self.facts[e].sizes]
            gpu_sizes = [self.facts[e].gpu_sizes[name] for e in hosts
                         if e in self.facts and name in self.facts[e].gpu_sizes]
            cold = list(state.cold_starts) if state is not None else []
            models.append({"name": name, "replicas": hosts, "copies": len(hosts),
                           "min_copies": self.policy.min_copies_of(name), "pinned": name in self.policy.pinned,
                           "lazy": self.manages(name), "size_bytes": max(sizes) if sizes else None,
                           "gpu_size_bytes": max(gpu_sizes) if gpu_sizes else None,
                           "last_used": None if state is None or not state.touched
                           else round(now - (time.monotonic() - state.touched), 3),
                           "pending": state.demand.pending if state is not None else 0.0,
                           "cold_starts": len(cold), "cold_start_last_s": cold[-1] if cold else None,
                           "cold_start_max_s": max(cold) if cold else None,
                           "loading": name in self._loads})
        return {"policy": {"lazy": self.policy.lazy_all, "min_copies": self.policy.min_copies,
                           "max_concurrent_loads": self.policy.max_loads,
                           "scale_up_pending": self.policy.pending_per_copy, "scale_down_idle_s": self.policy.idle_s},
                "replicas": replicas, "models": models}

    def metric_samples(self) -> list[metrics.Sample]:
        out: list[metrics.Sample] = []
        for name, hist in sorted(self.cold_start.items()):
            out.append(("cold_start", {"model": name}, hist))
        for (name, outcome), n in sorted(self.load_counts.items()):
            out.append(("placement_loads", {"model": name, "outcome": outcome}, n))
        for name, n in sorted(self.unload_counts.items()):
            out.append(("placement_unloads", {"model": name}, n))
        for name in sorted(self.models):
            out.append(("model_copies", {"model": name}, len(self._hosts(name))))
        out.append(("cold_waiting", {}, self.waiting))
        for tenant, n in sorted(self.share_waits.items()):
            out.append(("load_share_waits", {"tenant": tenant}, n))
        for endpoint, f in sorted(self.facts.items()):
            if f.budget and f.used is not None:
                out.append(("replica_memory_pressure", {"replica": endpoint}, round(f.used / f.budget, 4)))
            out.append(("replica_saturation", {"replica": endpoint}, sum(f.pending.values())))
            for gpu, budget in sorted(f.gpu_budget.items()):
                if budget and gpu in f.gpu_used:
                    out.append(("replica_gpu_memory_pressure", {"replica": endpoint, "gpu": gpu},
                                round(f.gpu_used[gpu] / budget, 4)))
        return out


def _stamp(path: Path) -> float | None:
    """When a model directory's config last changed (None: unreadable)."""
    try:
        return max((p.stat().st_mtime for p in (path, path / "config.pbtxt") if p.exists()), default=0.0)
    except OSError:
        return None


def _read_model(path: Path) -> tuple[mc.ModelConfig, list[int]]:
    config = load_model_config(path)
    return config, layout.select_versions(config.version_policy, layout.available_versions(path))


def evicted(exc: InferError) -> bool:
    """Whether a service answered that it does not hold the model (it was evicted, or unloaded,
    after the routing table was read): the request never ran, and may go again."""
    return exc.code is Code.NOT_FOUND and EVICTED in exc.message
