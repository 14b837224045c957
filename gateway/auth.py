"""Tenants: API key → tenant, what the tenant may call, its limits; and admission per request.

`tenants.yaml` (pydantic-validated, re-read when its mtime changes, checked at most once a second):

    anonymous: false          # requests without a key; default: allowed only when no tenants are listed
    share: 0.5                # default share of every process-wide cap one tenant may hold (see below)
    tenants:
      - name: acme
        keys_sha256: [<sha256 hex of the API key>]
        rate: 50              # requests per second (token bucket refill)
        burst: 100            # bucket size
        max_concurrency: 8    # optional
        models: ["add_sub", "scale*"]   # fnmatch patterns over model / route names; default ["*"]
        priority: 1           # optional default `priority` request parameter
        admin: false          # may load/unload models
        share: 0.25           # optional: this tenant's share, overriding the file's

Shares: a cap the whole process shares (``--max-inflight`` requests and ``--max-inflight-bytes``
in flight, which streams hold until their last answer; ``--max-shm-regions`` and
``--max-shm-bytes`` of shared-memory regions) is held by one tenant up to max(1, cap * share);
past it the tenant's next request or registration gets 429 / RESOURCE_EXHAUSTED naming the
limit, while the others still have the rest. Anonymous callers (``anonymous: true``) share one
tenant's share between them. Without a tenants file nothing is counted per tenant.
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.quotas.bucket import Decision, Limits
from gateway.watched import WatchedFile
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server import admission as gate_module
from meshserve.server.access import ALL, Grant, Op, Rule
from meshserve.server.admission import tenant_cap
from meshserve.server.core import RequestContext
from meshserve.server.limits import flag

log = logging.getLogger("meshserve.gateway.auth")

class TenantSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    keys_sha256: list[str] = Field(min_length=1)
    rate: float = Field(gt=0)
    burst: float = Field(ge=1)
    max_concurrency: int | None = Field(default=None, ge=1)
    models: list[str] = Field(default_factory=lambda: ["*"])
    priority: int | None = Field(default=None, ge=0)
    admin: bool = False
    share: float | None = Field(default=None, gt=0, le=1)  # of every process-wide cap; default: the file's

    @field_validator("keys_sha256")
    @classmethod
    def _hex_digests(cls, keys: list[str]) -> list[str]:
        out = []
        for k in keys:
            k = k.strip().lower()
            if len(k) != 64 or any(c not in "0123456789abcdef" for c in k):
                raise ValueError(f"'{k}' is not a sha256 hex digest (64 hex characters)")
            out.append(k)
        return out

    @property
    def limits(self) -> Limits:
        return Limits(rate=self.rate, burst=self.burst, max_concurrency=self.max_concurrency)

    def may_call(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anonymous: bool | None = None
    share: float = Field(default=0.5, gt=0, le=1)  # what one tenant may hold of a process-wide cap
    tenants: list[TenantSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        names: set[str] = set()
        keys: dict[str, str] = {}
        for t in self.tenants:
            if t.name in names:
                raise ValueError(f"tenant '{t.name}' is listed twice")
            names.add(t.name)
            for k in t.keys_sha256:
                if k in keys:
                    raise ValueError(f"a key of tenant '{t.name}' is also a key of tenant '{keys[k]}'")
                keys[k] = t.name
        return self

    @property
    def anonymous_allowed(self) -> bool:
        return self.anonymous if self.anonymous is not None else not self.tenants


@functools.lru_cache(maxsize=4096)  # per request otherwise; bounded against random keys
def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_tenants(text: str, source: str = "tenants.yaml") -> TenantsFile:
    """Parse and validate; errors name the file and the offending field."""
    try:
        data = yaml.safe_load(text) or {}
        return TenantsFile.model_validate(data)
    except (yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"{source}: {exc}") from None


class Tenants:
    """A validated snapshot: key digest → tenant."""

    def __init__(self, spec: TenantsFile):
        self.spec = spec
        self.by_key = {k: t for t in spec.tenants for k in t.keys_sha256}
        self.shares = {t.name: t.share for t in spec.tenants if t.share is not None}

    def share_of(self, tenant: str) -> float:
        """The tenant's share of a process-wide cap ("" = anonymous callers: the file's)."""
        return self.shares.get(tenant, self.spec.share)

    def authenticate(self, headers: dict[str, str]) -> TenantSpec | None:
        """The caller's tenant; None = anonymous (when allowed). Raises 401 otherwise."""
        key = api_key(headers)
        if key is None:
            if self.spec.anonymous_allowed:
                return None
            raise InferError(Code.UNAUTHENTICATED, "an API key is required "
                             "('Authorization: Bearer <key>' or 'x-api-key: <key>')")
        tenant = self.by_key.get(hash_key(key))
        if tenant is None:
            raise InferError(Code.UNAUTHENTICATED, "unknown API key")
        return tenant


def api_key(headers: dict[str, str]) -> str | None:
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
    async def acquire(self, tenant: str, limits: Limits, lease_s: float = 0.0) -> tuple[Decision, str]: ...

    async def release(self, tenant: str, ticket: str) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class Admitted:
    tenant: str  # "" = anonymous
    ticket: str  # the quota store's ("" for anonymous callers)
    size: int = 0  # the request's bytes, counted against the tenant's share until it ends


class Admission:
    """authenticate → authorize the model/route → take quota. The core calls it before routing."""

    def __init__(self, directory: TenantDirectory, store: QuotaStore):
        self.rejections: Counter[tuple[str, str]] = Counter()  # (tenant, reason)
        self.directory = directory
        self.store = store
        # requests and bytes each tenant ("" anonymous) has in flight in this process (its share)
        self.inflight: dict[str, list[int]] = {}

    def share_of(self, tenant: str) -> float:
        """The tenant's share of this process's caps (meshserve/server/shm.py counts regions by it)."""
        return self.directory.get().share_of(tenant)

    async def admit(self, request: pb.ModelInferRequest, ctx: RequestContext) -> Admitted:
        tenants = self.directory.get()
        tenant = tenants.authenticate(ctx.headers)
        raw = ctx.raw
        size = len(raw) if raw is not None else ctx.nbytes
        if tenant is None:  # anonymous (allowed by the file): one share between them, no quota
            self._take_share("", tenants.share_of(""), size, request.model_name)
            return Admitted("", "", size)
        name = tenant.name
        if not tenant.may_call(request.model_name):
            raise InferError(Code.PERMISSION_DENIED,
                             f"tenant '{name}' may not call model '{request.model_name}'")
        self._take_share(name, tenant.share if tenant.share is not None else tenants.spec.share, size,
                         request.model_name)
        lease = ctx.time_remaining() or 0.0
        try:
            try:
                decision, ticket = await self.store.acquire(name, tenant.limits, lease)
            except Exception as exc:  # the store is down: refuse rather than run unmetered
                raise InferError.unavailable(f"quota store unavailable: {exc}") from None
            if not decision.allowed:
                what = "rate limit" if decision.reason == "rate" else "concurrency limit"
                # labels: tenants from the config and three reasons: bounded cardinality
                self.rejections[(name, "rate" if decision.reason == "rate" else "concurrency")] += 1
                raise InferError.exhausted(f"tenant '{name}' is over its {what}",
                                           retry_after_s=decision.retry_after_s)
        except BaseException:
            self._give_share(name, size)
            raise
        if tenant.priority is not None and "priority" not in request.parameters:
            request.parameters["priority"].uint64_param = tenant.priority
            ctx.raw = None  # the forwarded bytes must carry the new parameter
        return Admitted(name, ticket, size)

    def _take_share(self, tenant: str, share: float, size: int, model: str) -> None:
        """Count one request of ``size`` bytes against the tenant's share of this process's
        --max-inflight / --max-inflight-bytes (an unbounded cap has no share); 429 past it. As
        the process-wide gate, a tenant with nothing in flight is admitted whatever the size."""
        held = self.inflight.get(tenant)
        if held is None:
            held = self.inflight[tenant] = [0, 0]
        gate = gate_module.gate
        who = f"tenant '{tenant}'" if tenant else "anonymous callers"
        if gate.max_requests != gate_module.UNBOUNDED:
            cap = tenant_cap(gate.max_requests, share)
            if held[0] >= cap:
                self.rejections[(tenant or "(anonymous)", "share")] += 1
                raise InferError.exhausted(
                    f"{who} has {held[0]} inference requests in flight, its share ({share:g} of "
                    f"{flag('max_inflight')} {gate.max_requests}: {cap}); request for model '{model}' refused, "
                    "retry later", retry_after_s=gate_module.RETRY_AFTER_S)
        if held[0] and gate.max_bytes != gate_module.UNBOUNDED:
            cap = tenant_cap(gate.max_bytes, share)
            if held[1] + size > cap:
                self.rejections[(tenant or "(anonymous)", "share")] += 1
                raise InferError.exhausted(
                    f"{who} has {held[1]} bytes of inference requests in flight; this one's {size} would pass its "
                    f"share ({share:g} of {flag('max_inflight_bytes')} {gate.max_bytes}: {cap}); request for model "
                    f"'{model}' refused, retry later", retry_after_s=gate_module.RETRY_AFTER_S)
        held[0] += 1
        held[1] += size

    def _give_share(self, tenant: str, size: int) -> None:
        held = self.inflight[tenant]
        held[0] -= 1
        held[1] -= size
        if not held[0]:
            del self.inflight[tenant]

    async def release(self, admitted: Admitted | None) -> None:
        if admitted is None:
            return
        self._give_share(admitted.tenant, admitted.size)
        if admitted.ticket:
            try:
                await self.store.release(admitted.tenant, admitted.ticket)
            except Exception as exc:  # a lease expires on its own in Redis
                log.warning("quota release for tenant '%s' failed: %s", admitted.tenant, exc)

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
