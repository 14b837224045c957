"""Model control across the mesh (Triton's model repository extension at the gateway): the
repository index merged over the service replicas, and explicit load / unload on the replicas
that hold a model (or whose kind serves it), every call to a service through the Upstream;
ensembles are loaded and unloaded here, in the gateway that runs them."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from gateway.ensemble.catalog import EnsembleCatalog
from gateway.upstream.replica import Replica
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.repository import layout
from meshserve.repository.errors import ConfigError
from meshserve.repository.names import check_file_path, check_load_name, check_model_name
from meshserve.server.core import RequestContext
from meshserve.server.repository_control import FILES_NEED_CONFIG, ControlPolicy, poll_failed

INDEX_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 600.0
_STATE_RANK = {"READY": 3, "LOADING": 2, "UNLOADING": 1}  # merging replicas' index entries: higher wins


class ModelControl:
    """--allow-model-uploads / --allow-remote-model-control (``policy``) over the services'
    repositories; ``tenants``: whether --tenants is on (the policy's rules differ)."""

    def __init__(self, upstream: Upstream, ensembles: EnsembleCatalog | None, policy: ControlPolicy,
                 tenants: bool):
        self.upstream = upstream
        self.discovery = upstream.discovery
        self.ensembles = ensembles
        self.policy = policy
        self.tenants = tenants

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Every model the services' repositories hold (merged over replicas: READY beats LOADING
        beats UNAVAILABLE), then the ensembles run here."""
        results = await self.upstream.each(self.upstream.healthy(),
                                           lambda r: r.index(ready_only, timeout=INDEX_TIMEOUT_S))
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
        healthy = self.upstream.healthy()
        results = await self.upstream.each(healthy, lambda r: r.index(False, timeout=INDEX_TIMEOUT_S))
        return {r: res for r, res in zip(healthy, results, strict=True) if not isinstance(res, BaseException)}

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None:
        """Triton's explicit-mode load across the mesh: the model's kind comes from the load's
        `config` override, else from the replicas whose repository holds it (each service lists
        every model directory of its kind); every healthy replica of that kind loads it."""
        check_load_name(name)  # the access table made sure the caller is an admin (with tenants)
        self.policy.check("load", name, parameters, ctx.peer, self.tenants)
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
            await self._fan_out("load", name, targets, lambda r: r.load(req, timeout=LOAD_TIMEOUT_S))
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
        self.policy.check("unload", name, parameters, ctx.peer, self.tenants)
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
            await self._fan_out("unload", name, owners, lambda r: r.unload(req, timeout=LOAD_TIMEOUT_S))
        finally:
            await self.discovery.refresh()

    async def _fan_out(self, action: str, name: str, replicas: list[Replica],
                       fn: Callable[[Replica], Awaitable[object]]) -> None:
        """Run a load/unload on every replica at once; when some fail, one error names each
        failed replica and why, and the replicas where it worked."""
        results = await self.upstream.each(replicas, fn)
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


def _no_service(name: str, kind: str) -> InferError:
    return InferError.unavailable(f"failed to load '{name}': no healthy service replica serves its kind ({kind})")
