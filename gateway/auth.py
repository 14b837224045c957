"""Tenants: API key → tenant, what the tenant may call, its limits; and admission per request.

`tenants.yaml` (pydantic-validated, re-read when its mtime changes, checked at most once a second):

    anonymous: false          # requests without a key; default: allowed only when no tenants are listed
    share: 0.5                # default share of every process-wide cap one tenant may hold (see below)
    tenants:
      - name: acme
        keys_sha256: [<sha256 hex of the API key>]
        certificate_names: ["acme-client"]  # optional: a client certificate naming the tenant (mutual TLS)
        rate: 50              # requests per second (token bucket refill)
        burst: 100            # bucket size
        max_concurrency: 8    # optional
        models: ["add_sub", "scale*"]   # fnmatch patterns over model / route names; default ["*"]
        priority: 1           # optional default `priority` request parameter
        admin: false          # may load/unload models
        share: 0.25           # optional: this tenant's share, overriding the file's

Sequences: a sequence (model, ``sequence_id``) belongs to the tenant whose request used it first
while it lives (until its ``sequence_end``, or SEQUENCE_BINDING_MIN_S / twice the model's
``max_sequence_idle_microseconds`` after its last request): another tenant naming it gets 403 /
PERMISSION_DENIED, so it can neither read nor reset that sequence's state in the service. At most
MAX_SEQUENCES sequences are bound at once (one tenant: its share), then 429.

Shares: a cap the whole process shares (``--max-inflight`` requests and ``--max-inflight-bytes``
in flight, which streams hold until their last answer; ``--max-shm-regions`` and
``--max-shm-bytes`` of shared-memory regions) is held by one tenant up to max(1, cap * share);
past it the tenant's next request or registration gets 429 / RESOURCE_EXHAUSTED naming the
limit, while the others still have the rest. Anonymous callers (``anonymous: true``) share one
tenant's share between them. Without a tenants file nothing is counted per tenant. A cap the
gateway's own work under a request shares (``--ensemble-max-inflight-steps``) reads the admitted
request's tenant and share from ``CALLER``, which ``Admission.admit`` sets in the request's context.

Client certificates: on a port with mutual TLS, a request without an API key is the tenant one
of whose ``certificate_names`` equals a name of the client's verified certificate (its subject's
CN, then its SAN URIs, then its SAN DNS names: the first that a tenant lists). An API key, when
the request has one, wins: it is checked as always, whatever the certificate says. A tenant needs
keys, certificate names or both.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from gateway.quotas import StoreUnavailable
from gateway.quotas.bucket import Decision, Limits
from gateway.watched import WatchedFile
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.priorities import default_level, level_queue_policy, priority_level
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.infer_checks import int_value
from meshserve.repository.config import instance_count, sequence_slots
from meshserve.repository.names import is_valid_model_name
from meshserve.server import admission as gate_module
from meshserve.server.access import ALL, Grant, Op, Rule
from meshserve.server.admission import tenant_cap
from meshserve.server.core import RequestContext
from meshserve.server.limits import flag
from meshserve.server.tls import CLIENT_CERT_HEADER, CertNames

if TYPE_CHECKING:
    from gateway.tenants_file import TenantsFile, TenantSpec

log = logging.getLogger("meshserve.gateway.auth")

@functools.lru_cache(maxsize=4096)  # per request otherwise; bounded against random keys
def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_tenants(text: str, source: str = "tenants.yaml") -> TenantsFile:
    """Parse and validate; errors name the file and the offending field (gateway/tenants_file.py)."""
    from gateway.tenants_file import (
        parse,  # (pydantic and yaml only with such a file: docs/perf/suite-time.md)
    )

    return parse(text, source)


class Tenants:
    """A validated snapshot: key digest → tenant."""

    def __init__(self, spec: TenantsFile):
        self.spec = spec
        self.by_key = {k: t for t in spec.tenants for k in t.keys_sha256}
        self.by_cert = {n: t for t in spec.tenants for n in t.certificate_names}
        self.shares = {t.name: t.share for t in spec.tenants if t.share is not None}
        # the smallest share any caller holds: below its cap in flight in all, no caller is at its own
        self.least_share = min([spec.share, *self.shares.values()])

    def share_of(self, tenant: str) -> float:
        """The tenant's share of a process-wide cap ("" = anonymous callers: the file's)."""
        return self.shares.get(tenant, self.spec.share)

    def authenticate(self, headers: Mapping[str, Any]) -> TenantSpec | None:
        """The caller's tenant; None = anonymous (when allowed). Raises 401 otherwise."""
        key = api_key(headers)
        if key is None:
            names = headers.get(CLIENT_CERT_HEADER)
            if type(names) is CertNames and self.by_cert:  # (verified by the handshake: tls.client_cert)
                for name in names.split("\n"):
                    tenant = self.by_cert.get(name)
                    if tenant is not None:
                        return tenant
            if self.spec.anonymous_allowed:
                return None
            raise InferError(Code.UNAUTHENTICATED, "an API key is required "
                             "('Authorization: Bearer <key>' or 'x-api-key: <key>')")
        tenant = self.by_key.get(hash_key(key))
        if tenant is None:
            raise InferError(Code.UNAUTHENTICATED, "unknown API key")
        return tenant


def api_key(headers: Mapping[str, Any]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


class TenantDirectory(WatchedFile[Tenants]):
    """tenants.yaml, reloaded without restart when it changes (an invalid edit keeps the old one)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic):
        super().__init__(path, lambda text, source: Tenants(parse_tenants(text, source)), clock)


class QuotaStore(Protocol):
    async def acquire(self, tenant: str, limits: Limits, lease_s: float = 0.0) -> tuple[Decision, str]:
        """The tenant's decision and its concurrency ticket; StoreUnavailable when the store
        cannot answer (the request is refused 503 / UNAVAILABLE)."""
        ...

    async def release(self, tenant: str, ticket: str) -> None: ...

    async def close(self) -> None: ...


# a sequence stays its tenant's this long after its last request at least (or twice the
# model's max_sequence_idle_microseconds, when longer), unless it ends
SEQUENCE_BINDING_MIN_S = 60.0
MAX_SEQUENCES = 65536  # sequences bound to tenants at once in this process


@dataclass(frozen=True)
class Admitted:
    tenant: str  # "" = anonymous
    ticket: str  # the quota store's ("" for anonymous callers)
    size: int = 0  # the request's bytes, counted against the tenant's share until it ends
    queued: tuple[str, int] | None = None  # the model and level whose queue share it holds (``Admission.queue_room``)


# the tenant ("" = anonymous callers) and share of the request the running task serves, set when
# the request is admitted (with tenants: None in a gateway without); the work the gateway does for
# the request (an ensemble's steps: gateway/ensemble/executor.py:StepSlots) counts against it
CALLER: ContextVar[tuple[str, float] | None] = ContextVar("meshserve_tenant", default=None)


class QueueRooms(NamedTuple):
    """A model's bounded queues at its services (``queue_room``), one per priority level."""

    default: int  # the level of a request without a `priority` (or with one outside the levels)
    rooms: tuple[int, ...]  # rooms[level - 1]: the requests its replicas queue and run at once there, 0 unbounded

    def level_of(self, priority: int) -> int:
        """The level a request's ``priority`` (0: none) queues at, by the services' rule
        (``meshserve/priorities.py:priority_level``: 0 or one above the levels at the default
        level; a negative one, which the service refuses, counts there too)."""
        return priority_level(priority, len(self.rooms), self.default)


def queue_room(config: mc.ModelConfig, replicas: int) -> QueueRooms | None:
    """How many requests for a model its ``replicas`` hold at once at each priority level before
    one refuses "exceeds maximum queue size": each one's queue at that level (its policy's
    ``max_queue_size``, by the services' rule: ``meshserve/priorities.py:level_queue_policy``)
    and what its instances run (``max_batch_size`` rows each); None when no level is bounded.
    Without ``priority_levels`` one queue, the default policy's."""
    if not config.HasField("dynamic_batching"):
        return None
    db = config.dynamic_batching
    levels = int(db.priority_levels)
    sizes = [level_queue_policy(level, levels, db.priority_queue_policy, db.default_queue_policy).max_queue_size
             for level in range(1, max(1, levels) + 1)]
    if not any(s > 0 for s in sizes):
        return None
    running = max(1, config.max_batch_size) * instance_count(config)
    each = max(1, replicas)
    default = default_level(levels, int(db.default_priority_level))
    return QueueRooms(default, tuple((s + running) * each if s > 0 else 0 for s in sizes))


def sequence_room(config: mc.ModelConfig, instances: int, replicas: int) -> int:
    """How many live sequences of a model its ``replicas`` hold at once (the rest wait in a
    backlog): each replica's ``sequence_slots`` (Triton's rule, as the services hold them:
    services/sequence/model.py:policy_from_config); 0 = unbounded (no sequence batching)."""
    if not config.HasField("sequence_batching"):
        return 0
    return sequence_slots(config, instances) * max(1, replicas)


class Admission:
    """authenticate → authorize the model/route → take quota. The core calls it before routing."""

    def __init__(self, directory: TenantDirectory, store: QuotaStore, clock: Callable[[], float] = time.monotonic):
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.directory = directory
        self.store = store
        self._clock = clock
        # live sequences: (model, sequence key) -> [tenant, when the binding lapses]; per tenant how many
        self.sequences: dict[tuple[str, str], list[Any]] = {}
        self._sequences_held: Counter[str] = Counter()
        # requests and bytes each tenant ("" anonymous) has in flight in this process (its share)
        self.inflight: dict[str, list[int]] = {}
        # a model whose config bounds a queue at the services (max_queue_size): the requests its
        # replicas queue and run at once at each priority level, None = unbounded
        # (gateway/core.py:GatewayCore.queue_room; the attribute None: no such bound is looked up);
        # what each (tenant, model, level) has in flight of that level's room
        self.queue_room: Callable[[str, str], QueueRooms | None] | None = None
        self.queued: Counter[tuple[str, str, int]] = Counter()
        # the same for a sequence model's slots (the sequences its replicas hold at once), and per
        # (tenant, model) its sequences in use: sequence -> when last used (oldest first)
        self.sequence_room: Callable[[str, str], int] | None = None
        self._live: dict[tuple[str, str], dict[str, float]] = {}
        # with several replicas, the one a sequence key is pinned to and how many serve the model
        # (gateway/core.py:GatewayCore.sequence_replica; None: one replica, or not looked up), and
        # each live sequence's replica, (tenant, model, sequence) -> its endpoint
        self.sequence_replica: Callable[[str, str, str], tuple[str, int] | None] | None = None
        self._pinned: dict[tuple[str, str, str], str] = {}

    def share_of(self, tenant: str) -> float:
        """The tenant's share of this process's caps (meshserve/server/shm.py counts regions by it)."""
        return self.directory.get().share_of(tenant)

    def caller(self, headers: Mapping[str, Any]) -> tuple[str, float]:
        """The caller's tenant ("" = anonymous callers) and its share, from a request's headers
        alone: what the transport counts before a request is parsed (meshserve/server/inflate.py:
        a compressed body's inflated bytes). Raises 401 as ``admit`` does."""
        tenants = self.directory.get()
        tenant = tenants.authenticate(headers)
        name = "" if tenant is None else tenant.name
        return name, tenants.share_of(name)

    async def admit(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None = None,
                    sequence_idle_s: float = 0.0) -> Admitted:
        """Authenticate, authorize the model, hold the tenant's share and take its quota.
        ``sequence``: the request's sequence key (routing.table.sequence_affinity), bound to the
        tenant while the sequence lives (``sequence_idle_s``: the model's idle timeout)."""
        tenants = self.directory.get()
        tenant = tenants.authenticate(ctx.headers)
        raw = ctx.raw
        size = len(raw) if raw is not None else ctx.nbytes
        if tenant is None:  # anonymous (allowed by the file): one share between them, no quota
            share = tenants.share_of("")
            queued = self._take_share("", share, size, request, None)
            if sequence is not None:
                try:
                    self._bind_sequence("", share, request, sequence, sequence_idle_s)
                except BaseException:
                    self._give_share("", size, queued)
                    raise
            CALLER.set(("", share))
            return Admitted("", "", size, queued)
        name = tenant.name
        if not tenant.may_call(request.model_name):
            raise InferError(Code.PERMISSION_DENIED,
                             f"tenant '{name}' may not call model '{request.model_name}'")
        share = tenants.share_of(name)
        queued = self._take_share(name, share, size, request, tenant.priority)
        lease = ctx.time_remaining() or 0.0
        try:
            try:
                decision, ticket = await self.store.acquire(name, tenant.limits, lease)
            except StoreUnavailable as exc:  # the store is down or slow: refuse rather than run unmetered
                raise InferError(Code.UNAVAILABLE, str(exc), retry_after_s=exc.retry_after_s) from None
            except Exception:  # (its text is not a client's: a Redis error names Redis's address)
                log.exception("quota store failed")
                raise InferError.unavailable("quota store unavailable") from None
            if not decision.allowed:
                what = "rate limit" if decision.reason == "rate" else "concurrency limit"
                # labels: tenants from the config and four reasons (rate, concurrency, share, sequence): bounded
                self.rejections[(name, "rate" if decision.reason == "rate" else "concurrency")] += 1
                raise InferError.exhausted(f"tenant '{name}' is over its {what}",
                                           retry_after_s=decision.retry_after_s)
            if sequence is not None:  # once admitted: a refused request neither binds nor ends a sequence
                try:
                    self._bind_sequence(name, share, request, sequence, sequence_idle_s)
                except BaseException:
                    await self._release_ticket(name, ticket)
                    raise
        except BaseException:
            self._give_share(name, size, queued)
            raise
        if tenant.priority is not None and "priority" not in request.parameters:
            request.parameters["priority"].uint64_param = tenant.priority
            ctx.raw = None  # the forwarded bytes must carry the new parameter
        CALLER.set((name, share))
        return Admitted(name, ticket, size, queued)

    def crowded(self) -> bool:
        """Whether some caller may hold its whole share of --max-inflight requests: the process
        has as many in flight as the smallest share's cap (a caller's are among the process's)."""
        gate = gate_module.gate
        return gate.requests >= tenant_cap(gate.max_requests, self.directory.get().least_share)

    def at_door(self, model: str, headers: Mapping[str, Any]) -> InferError | None:
        """The refusal ``admit`` would give a request for ``model`` from a caller that already
        holds its whole share of --max-inflight requests, found from the request's headers and
        its model's name alone: the front doors ask (when ``crowded``) before they parse the
        request, so that a tenant's flood past its share costs the gateway a refusal each and no
        more (docs/security.md, "Refused at the door"). Counted as ``_take_share`` counts it.
        None for anything else (a caller that is no tenant, a model it may not call or whose name
        is not valid, room in its share), which ``admit`` decides as before."""
        gate = gate_module.gate
        tenants = self.directory.get()
        try:
            tenant = tenants.authenticate(headers)
        except InferError:
            return None  # (admit answers 401)
        if tenant is not None and not tenant.may_call(model):
            return None  # (admit answers 403)
        name = "" if tenant is None else tenant.name
        share = tenants.share_of(name)
        held = self.inflight.get(name)
        if held is None or held[0] < (cap := tenant_cap(gate.max_requests, share)) or not is_valid_model_name(model):
            return None
        return self._over_share(name, share, held[0], cap, model)

    def _over_share(self, tenant: str, share: float, requests: int, cap: int, model: str) -> InferError:
        """A request refused because its caller holds its whole share of --max-inflight (counted)."""
        self.rejections[(tenant or "(anonymous)", "share")] += 1
        who = f"tenant '{tenant}'" if tenant else "anonymous callers"
        return InferError.exhausted(
            f"{who} has {requests} inference requests in flight, its share ({share:g} of "
            f"{flag('max_inflight')} {gate_module.gate.max_requests}: {cap}); request for model '{model}' refused, "
            "retry later", retry_after_s=gate_module.RETRY_AFTER_S)

    def _take_share(self, tenant: str, share: float, size: int, request: pb.ModelInferRequest,
                    priority: int | None) -> tuple[str, int] | None:
        """Count one request of ``size`` bytes against the tenant's share of this process's
        --max-inflight / --max-inflight-bytes (an unbounded cap has no share); 429 past it. As
        the process-wide gate, a tenant with nothing in flight is admitted whatever the size.
        For a model whose queues its services bound (``queue_room``), its share of the room of the
        level the request queues at (its ``priority`` parameter, else the tenant's ``priority``,
        else the model's default level) too: (model, level) when the request is counted there
        (``_give_share`` gives it back), None otherwise."""
        model = request.model_name
        # (the tenant's entry is made when the request is counted, at the end: a refusal, or a
        # failed lookup, leaves none for a tenant with nothing in flight; _give_share drops it at 0)
        held = self.inflight.get(tenant)
        requests, nbytes = (0, 0) if held is None else held
        gate = gate_module.gate
        who = f"tenant '{tenant}'" if tenant else "anonymous callers"
        if gate.max_requests != gate_module.UNBOUNDED:
            cap = tenant_cap(gate.max_requests, share)
            if requests >= cap:
                raise self._over_share(tenant, share, requests, cap, model)
        if requests and gate.max_bytes != gate_module.UNBOUNDED:
            cap = tenant_cap(gate.max_bytes, share)
            if nbytes + size > cap:
                self.rejections[(tenant or "(anonymous)", "share")] += 1
                raise InferError.exhausted(
                    f"{who} has {nbytes} bytes of inference requests in flight; this one's {size} would pass its "
                    f"share ({share:g} of {flag('max_inflight_bytes')} {gate.max_bytes}: {cap}); request for model "
                    f"'{model}' refused, retry later", retry_after_s=gate_module.RETRY_AFTER_S)
        room_of = self.queue_room
        queued = None
        if room_of is not None and (rooms := room_of(model, request.model_version)) is not None:
            params = request.parameters
            if "priority" in params:
                priority = int_value(params["priority"])
            level = rooms.level_of(priority or 0)
            room = rooms.rooms[level - 1]
            if room:
                cap = tenant_cap(room, share)
                key = (tenant, model, level)
                if self.queued[key] >= cap:
                    self.rejections[(tenant or "(anonymous)", "share")] += 1
                    where = f" at priority level {level}" if len(rooms.rooms) > 1 else ""
                    raise InferError.exhausted(
                        f"{who} has {self.queued[key]} requests for model '{model}' in flight{where}, its share "
                        f"({share:g} of the {room} its replicas queue and run at once{where} (max_queue_size): "
                        f"{cap}); retry later", retry_after_s=gate_module.RETRY_AFTER_S)
                self.queued[key] += 1
                queued = (model, level)
        if held is None:
            self.inflight[tenant] = [1, size]
        else:
            held[0] += 1
            held[1] += size
        return queued

    def _bind_sequence(self, tenant: str, share: float, request: pb.ModelInferRequest, sequence: str,
                       idle_s: float) -> None:
        """The sequence is the tenant's (refused, 403, while it is another's); it stays bound
        until its end or its binding lapses."""
        key = (request.model_name, sequence)
        now = self._clock()
        bound = self.sequences.get(key)
        who = f"tenant '{tenant}'" if tenant else "anonymous callers"
        if bound is not None and bound[0] != tenant and bound[1] > now:
            self.rejections[(tenant or "(anonymous)", "sequence")] += 1
            raise InferError(Code.PERMISSION_DENIED,
                             f"{who} may not use sequence {sequence[2:]} of model '{request.model_name}': another "
                             "tenant's sequence with that id is in progress")
        params = request.parameters
        model = request.model_name
        if "sequence_end" in params and params["sequence_end"].bool_param:
            if bound is not None:  # its last request: the id is free once it has run (turns keep the order)
                del self.sequences[key]
                self._sequences_held[bound[0]] -= 1
                self._unlive(bound[0], model, sequence)
            return
        lapses = now + max(SEQUENCE_BINDING_MIN_S, 2 * idle_s)
        if bound is not None and bound[0] == tenant:
            bound[1] = lapses
            live = self._live.get((tenant, model))
            if live is not None and live.pop(sequence, None) is not None:
                live[sequence] = now  # (to the end: the most recently used)
            else:  # (its slot was counted idle: it holds one again)
                self._take_slot(tenant, share, request, sequence, idle_s, now)
            return
        self._take_slot(tenant, share, request, sequence, idle_s, now)
        if bound is not None:  # lapsed: the other tenant's sequence is over
            self._sequences_held[bound[0]] -= 1
            self._unlive(bound[0], model, sequence)
        elif len(self.sequences) >= MAX_SEQUENCES or self._sequences_held[tenant] >= tenant_cap(MAX_SEQUENCES, share):
            self._sweep_sequences(now)
            cap = tenant_cap(MAX_SEQUENCES, share)
            if len(self.sequences) >= MAX_SEQUENCES or self._sequences_held[tenant] >= cap:
                self.rejections[(tenant or "(anonymous)", "share")] += 1
                self._unlive(tenant, model, sequence)
                raise InferError.exhausted(
                    f"{who} has {self._sequences_held[tenant]} sequences in progress (its share: {cap} of the "
                    f"{MAX_SEQUENCES} this gateway tracks, {len(self.sequences)} in progress); end one or retry later",
                    retry_after_s=gate_module.RETRY_AFTER_S)
        self.sequences[key] = [tenant, lapses]
        self._sequences_held[tenant] += 1

    def _take_slot(self, tenant: str, share: float, request: pb.ModelInferRequest, sequence: str, idle_s: float,
                   now: float) -> None:
        """A sequence of a model whose services hold a bounded number of live sequences
        (``sequence_room``) takes one of the tenant's share of them: at most max(1, room x share)
        used within twice the model's idle timeout (older ones the service has let go); 429 past it."""
        room_of = self.sequence_room
        if room_of is None:
            return
        model = request.model_name
        room = room_of(model, request.model_version)
        if not room:
            return
        live = self._live.get((tenant, model))
        if live is None:
            live = self._live[(tenant, model)] = {}
        cap = tenant_cap(room, share)
        who = f"tenant '{tenant}'" if tenant else "anonymous callers"
        if len(live) >= cap:
            self._let_go(tenant, model, live, now - 2 * idle_s)
            if len(live) >= cap:
                self.rejections[(tenant or "(anonymous)", "share")] += 1
                raise InferError.exhausted(
                    f"{who} has {len(live)} sequences of model '{model}' in progress, its share ({share:g} of the "
                    f"{room} its replicas hold at once: {cap}); end one or retry later",
                    retry_after_s=gate_module.RETRY_AFTER_S)
        pin_of = self.sequence_replica
        pinned = pin_of(model, request.model_version, sequence) if pin_of is not None else None
        if pinned is not None:  # several replicas: the tenant's share of the one its sequence is pinned to
            endpoint, replicas = pinned
            each = tenant_cap(room // replicas, share)
            pins = self._pinned
            on = sum(1 for s in live if pins.get((tenant, model, s)) == endpoint)
            if on >= each:
                self._let_go(tenant, model, live, now - 2 * idle_s)
                on = sum(1 for s in live if pins.get((tenant, model, s)) == endpoint)
                if on >= each:
                    self.rejections[(tenant or "(anonymous)", "share")] += 1
                    raise InferError.exhausted(
                        f"{who} has {on} sequences of model '{model}' in progress on the replica sequence "
                        f"{sequence[2:]} is pinned to, its share ({share:g} of the {room // replicas} one replica "
                        f"holds at once: {each}); end one, or start it with another sequence id, or retry later",
                        retry_after_s=gate_module.RETRY_AFTER_S)
            pins[(tenant, model, sequence)] = endpoint
        live[sequence] = now

    def _let_go(self, tenant: str, model: str, live: dict[str, float], idle_since: float) -> None:
        """The tenant's sequences of the model unused since ``idle_since`` (the service has let them
        go) no longer hold a slot."""
        for old in [k for k, used in live.items() if used < idle_since]:  # (at most its share)
            del live[old]
            if self._pinned:
                self._pinned.pop((tenant, model, old), None)

    def _unlive(self, tenant: str, model: str, sequence: str) -> None:
        live = self._live.get((tenant, model))
        if live is not None:
            live.pop(sequence, None)
            if self._pinned:
                self._pinned.pop((tenant, model, sequence), None)
            if not live:
                del self._live[(tenant, model)]

    def _sweep_sequences(self, now: float) -> None:
        for key, (tenant, lapses) in list(self.sequences.items()):
            if lapses <= now:
                del self.sequences[key]
                self._sequences_held[tenant] -= 1
                self._unlive(tenant, key[0], key[1])

    def _give_share(self, tenant: str, size: int, queued: tuple[str, int] | None) -> None:
        held = self.inflight[tenant]
        held[0] -= 1
        held[1] -= size
        if not held[0]:
            del self.inflight[tenant]
        if queued is not None:
            key = (tenant, *queued)
            left = self.queued[key] - 1
            if left:
                self.queued[key] = left
            else:
                del self.queued[key]

    async def release(self, admitted: Admitted | None) -> None:
        if admitted is None:
            return
        CALLER.set(None)  # (the task may serve another request next: its admission names its own)
        self._give_share(admitted.tenant, admitted.size, admitted.queued)
        if admitted.ticket:
            await self._release_ticket(admitted.tenant, admitted.ticket)

    async def _release_ticket(self, tenant: str, ticket: str) -> None:
        try:
            await self.store.release(tenant, ticket)
        except Exception as exc:  # a lease expires on its own in Redis
            log.warning("quota release for tenant '%s' failed: %s", tenant, exc)

    def authorize(self, op: Op, model: str, ctx: RequestContext, rule: Rule | None = None) -> Grant:
        """The access table's verdict on a call other than infer (meshserve.server.access):
        401 without a valid key, 403 for a tenant the rule excludes; the Grant filters what a
        LISTED op returns. ``rule`` overrides the op's own (the gateway's --metrics-auth)."""
        rule = op.rule if rule is None else rule
        if rule is Rule.OPEN or rule is Rule.INFER:  # infer: admit() on the infer path
            return ALL
        tenant = self.directory.get().authenticate(ctx.headers)
        if rule is Rule.ADMIN:
            if tenant is None or not tenant.admin:
                who = "anonymous callers" if tenant is None else f"tenant '{tenant.name}'"
                raise InferError(Code.PERMISSION_DENIED, f"{op.label} needs an admin API key; {who} may not")
            return ALL
        if tenant is None:  # anonymous callers (when allowed) see every model
            return ALL
        if tenant.admin:  # admins see every model
            return Grant(tenant=tenant.name) if rule is Rule.OWN else ALL
        if rule is Rule.MODEL and not tenant.may_call(model):
            raise InferError(Code.PERMISSION_DENIED, f"tenant '{tenant.name}' may not use model '{model}' "
                             f"({op.label})")
        if rule is Rule.LISTED:
            return Grant(tenant.may_call)
        return Grant(tenant=tenant.name) if rule is Rule.OWN else ALL
