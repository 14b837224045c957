"""The ensembles of a model repository (`--repository`): their configs are read once at start;
each is compiled against the step models' configs the services report, again whenever those
change. A plan that does not compile makes the ensemble UNAVAILABLE with the step-naming error.

Each ensemble keeps Triton's statistics for its requests (the composing models count their own
in their services): per request one success or failure with its duration, a queue time (arrival
to the first step), and one "execution" of the request's batch size whose compute time is the
sum of the steps' round trips (Triton sums the composing models' compute times; the gateway sees
a step whole, so it reports it all as compute_infer). Failures count under reason OTHER, as
Triton's ensembles do."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.ensemble.executor import EnsembleExecutor, StepTimes, named
from gateway.ensemble.plan import EnsembleError, Plan, compile_plan
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.datatypes import config_to_wire
from meshserve.protocol.errors import InferError, model_not_found
from meshserve.protocol.infer_checks import reject_mixed_contents
from meshserve.repository.config import ENSEMBLE_PLATFORM, ConfigError, load_model_config, parse_config
from meshserve.repository.labels import Labels, read_labels
from meshserve.repository.layout import model_dirs
from meshserve.server.core import unary_decoupled_error
from meshserve.telemetry.metrics import Sample
from meshserve.telemetry.model_stats import ModelStats

if TYPE_CHECKING:
    from gateway.placement import Placement
    from gateway.upstream.upstream import Upstream

log = logging.getLogger("meshserve.gateway.ensemble")

Lookup = Callable[[str, str], "mc.ModelConfig | None"]


def read_ensembles(repository: str | Path) -> tuple[dict[str, mc.ModelConfig], dict[str, Labels], dict[str, str]]:
    """(name → validated config, name → its own labels, name → load error) for every
    `platform: "ensemble"` model. The labels (with which the gateway classifies those outputs:
    executor.py:_classification) are read at load by the services' rule
    (meshserve/repository/labels.py:read_labels): a file outside the model's folder, or one that
    does not read, fails the load (Triton's: core's model.cc, Model::Init)."""
    configs: dict[str, mc.ModelConfig] = {}
    labels: dict[str, Labels] = {}
    errors: dict[str, str] = {}
    for d in model_dirs(repository):
        cfg_file = d / "config.pbtxt"
        if not cfg_file.is_file():
            continue
        try:
            if parse_config(cfg_file).platform != ENSEMBLE_PLATFORM:
                continue
            config = load_model_config(d)
            labels[d.name] = read_labels(d, config)
            configs[d.name] = config
        except ConfigError as exc:
            errors[d.name] = str(exc)
    return configs, labels, errors


class EnsembleCatalog:
    def __init__(self, repository: str | Path, max_inflight_steps: int = 256):
        self.repository = Path(repository)
        self.configs, self.labels, self.errors = read_ensembles(self.repository)
        self.max_inflight_steps = max_inflight_steps
        self.executor: EnsembleExecutor | None = None
        self._lookup: Lookup = lambda model, version: None
        self._plans: dict[str, tuple[tuple[Any, ...], Plan | EnsembleError]] = {}
        self.unloaded: set[str] = set()  # unloaded through the API: unknown to infer, "unloaded" in the index
        self.stats = {name: ModelStats(name, 1) for name in self.configs}  # an ensemble has version 1
        for name, err in self.errors.items():
            log.error("ensemble %s not loaded: %s", name, err)

    # ---- model control (explicit mode: load / unload through the API) -------------------
    def is_ensemble_dir(self, name: str) -> bool:
        """True when the repository holds an ensemble of that name (also one added since start)."""
        if name in self:
            return True
        cfg_file = self.repository / name / "config.pbtxt"
        try:
            return cfg_file.is_file() and parse_config(cfg_file).platform == ENSEMBLE_PLATFORM
        except (ConfigError, OSError, ValueError):
            return False

    def load(self, name: str, override_json: str | None = None) -> mc.ModelConfig:
        """(Re)read the ensemble's config from the repository (or the load request's override);
        it serves again once its plan compiles. InferError naming the model when it cannot."""
        model_dir = self.repository / name
        if override_json is None and not model_dir.is_dir():
            raise InferError.not_found(f"failed to load '{name}', failed to poll from model repository")
        try:
            config = load_model_config(model_dir, override_json=override_json)
            if config.platform != ENSEMBLE_PLATFORM:
                raise InferError.invalid(f"failed to load '{name}': not an ensemble (platform '{config.platform}')")
            labels = read_labels(model_dir, config)
        except ConfigError as exc:
            raise InferError.invalid(f"failed to load '{name}': {exc}") from None
        self.configs[name] = config
        self.labels[name] = labels
        self.stats.setdefault(name, ModelStats(name, 1))  # an ensemble added to the repository at run time
        self.errors.pop(name, None)
        self.unloaded.discard(name)
        self._plans.pop(name, None)
        return config

    def unload(self, name: str) -> mc.ModelConfig | None:
        """Take the ensemble out of service; its config (for its composing models), if it had one."""
        self.unloaded.add(name)
        self._plans.pop(name, None)
        return self.configs.get(name)

    def bind(self, upstream: Upstream, lookup: Lookup) -> None:
        """Where steps go (the gateway's Upstream) and where step models' configs come from."""
        self.executor = EnsembleExecutor(upstream, self.max_inflight_steps)
        self._lookup = lookup

    def place(self, placement: Placement) -> None:
        """The model mesh (--model-control-mode lazy): a step whose model is loaded nowhere is
        placed before it is sent (executor), and until then the plan compiles against the step
        model's config as --repository has it (``Placement.described``): the ensemble is
        described and ready without loading its steps."""
        assert self.executor is not None, "EnsembleCatalog.bind() was not called"
        self.executor.placement = placement
        served, described = self._lookup, placement.described
        self._lookup = lambda model, version: served(model, version) or described(model, version)
        self._plans.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.configs or name in self.errors

    def plan(self, name: str, version: str = "") -> Plan:
        """The compiled plan; InferError UNAVAILABLE naming the step when it does not compile."""
        if name in self.unloaded:
            raise model_not_found(name, version)
        if name in self.errors:
            raise InferError.unavailable(f"ensemble '{name}' failed to load: {self.errors[name]}")
        config = self.configs[name]
        if version and version != "1":
            raise model_not_found(name, version)
        steps = config.ensemble_scheduling.step
        found = [self._lookup(s.model_name, "" if s.model_version < 0 else str(s.model_version)) for s in steps]
        # the steps' configs themselves, compared by identity (their id()s could be reused by
        # configs loaded after these were dropped: a stale plan)
        key = tuple(found)
        cached = self._plans.get(name)
        if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key, strict=True)):
            try:
                result: Plan | EnsembleError = compile_plan(config, self._lookup, self.labels.get(name))
            except EnsembleError as exc:
                log.error("%s", exc)
                result = exc.with_traceback(None)  # (kept: not the frames of the request that compiled it)
            cached = self._plans[name] = (key, result)
        if isinstance(cached[1], EnsembleError):
            raise InferError.unavailable(str(cached[1]))
        return cached[1]

    async def placed_plan(self, name: str, version: str, timeout: float | None) -> Plan:
        """``plan``; when it does not compile because a step's model is one the model mesh
        manages and no replica serves, its config is read from --repository
        (``Placement.describe``), and when that does not read either (a broken model file) the
        step's model is placed first (``Placement.ready``: its load's answer, a failed load's
        reason named after the step); then the plan is compiled again."""
        try:
            return self.plan(name, version)
        except InferError:
            placement = None if self.executor is None else self.executor.placement
            if placement is None or name not in self.configs or name in self.unloaded:
                raise
            cold = [(i, s.model_name, "" if s.model_version < 0 else str(s.model_version))
                    for i, s in enumerate(self.configs[name].ensemble_scheduling.step)
                    if s.model_name in placement.catalog and placement.manages(s.model_name)]
            cold = [(i, m, v) for i, m, v in cold if self._lookup(m, v) is None]
            if not cold:
                raise
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, model, v in cold:
            await placement.describe(model)
            if self._lookup(model, v) is not None:
                continue
            try:
                await placement.ready(model, v, None if deadline is None else deadline - time.monotonic())
            except InferError as exc:
                raise named(name, f"step {i} (model '{model}')", exc) from None
        return self.plan(name, version)

    def decoupled(self, name: str, version: str) -> bool:
        """Whether the ensemble has a decoupled step (False when it does not compile: its
        request then fails with the reason)."""
        try:
            return self.plan(name, version).decoupled
        except InferError:
            return False

    async def infer(self, request: pb.ModelInferRequest, timeout: float | None,
                    affinity: str | None = None, protocol: str = "grpc") -> pb.ModelInferResponse:
        """A unary call (``protocol``: the client's, for Triton's refusal of a decoupled ensemble)."""
        arrival = time.monotonic_ns()
        plan = await self.placed_plan(request.model_name, request.model_version, timeout)
        if plan.decoupled:
            raise unary_decoupled_error(protocol)
        reject_mixed_contents(request)  # the gateway runs this request itself (infer_checks)
        assert self.executor is not None, "EnsembleCatalog.bind() was not called"
        stats, times = self.stats[plan.name], StepTimes()
        try:
            response = await self.executor.run(plan, request, timeout, times, affinity)
        except InferError:
            stats.record_failure(time.monotonic_ns() - arrival, "OTHER")
            raise
        end = time.monotonic_ns()
        batched = plan.max_batch_size > 0 and request.inputs and request.inputs[0].shape
        rows = request.inputs[0].shape[0] if batched else 1
        stats.record_batch(max(1, rows), 1, 0, times.steps_ns, 0)
        stats.record_success(end - arrival, times.first_ns - arrival)
        return response

    async def infer_stream(self, request: pb.ModelInferRequest, timeout: float | None,
                           affinity: str | None = None) -> AsyncGenerator[tuple[pb.ModelInferResponse | None, bool], None]:
        """A streaming call: an ensemble with a decoupled step answers each of its responses
        (executor.run_stream), then the final flag alone; any other answers once."""
        plan = await self.placed_plan(request.model_name, request.model_version, timeout)
        if not plan.decoupled:
            yield await self.infer(request, timeout, affinity), True
            return
        arrival = time.monotonic_ns()
        reject_mixed_contents(request)
        assert self.executor is not None, "EnsembleCatalog.bind() was not called"
        stats, times = self.stats[plan.name], StepTimes()
        try:
            async for response in self.executor.run_stream(plan, request, timeout, times, affinity):
                yield response, False
        except InferError:
            stats.record_failure(time.monotonic_ns() - arrival, "OTHER")
            raise
        except (GeneratorExit, asyncio.CancelledError):  # the client left
            stats.record_failure(time.monotonic_ns() - arrival, "CANCELED")
            raise
        batched = plan.max_batch_size > 0 and request.inputs and request.inputs[0].shape
        stats.record_batch(max(1, request.inputs[0].shape[0] if batched else 1), 1, 0, times.steps_ns, 0)
        stats.record_success(time.monotonic_ns() - arrival, times.first_ns - arrival)
        yield None, True

    def statistics(self, name: str, version: str) -> list[pb.ModelStatistics]:
        """Statistics of one ensemble, or (``name`` "") of every ensemble that is ready or has
        served requests; like a model that is not loaded, an ensemble that is neither is "not
        available" (its plan does not compile: it never loaded, as far as a client can tell)."""
        if not name:
            return [s.to_pb() for n, s in sorted(self.stats.items()) if self._listed(n)]
        if name in self.errors or not self._listed(name):
            raise InferError.invalid(f"requested model '{name}' is not available")
        if version and version != "1":
            raise InferError.invalid(f"requested model '{name}' version {version} is not available")
        return [self.stats[name].to_pb()]

    def _listed(self, name: str) -> bool:
        stats = self.stats[name]
        return bool(stats.success.count or stats.fail.count) or self.ready(name, "")

    def metric_samples(self) -> list[Sample]:
        """The listed ensembles' nv_* samples (metrics.MODEL_FAMILIES), for the gateway's /metrics."""
        return [s for name, stats in sorted(self.stats.items()) if self._listed(name)
                for s in stats.samples({"model": name, "version": "1"})]

    def ready(self, name: str, version: str) -> bool:
        try:
            self.plan(name, version)
        except InferError:
            return False
        return True

    def index(self, ready_only: bool) -> list[pb.RepositoryIndexResponse.ModelIndex]:
        """Repository index entries for the ensembles (READY when the plan compiles)."""
        out = []
        if not ready_only:  # ensemble directories added since start are listed (not loaded) too
            try:
                dirs = model_dirs(self.repository)
            except OSError as exc:
                log.error("cannot list the model repository %s: %s", self.repository, exc)
                dirs = []
            for d in dirs:
                if d.name not in self and self.is_ensemble_dir(d.name):
                    out.append(pb.RepositoryIndexResponse.ModelIndex(name=d.name, state="UNAVAILABLE",
                                                                     reason="not loaded (explicit model control)"))
        for name in sorted({*self.configs, *self.errors}):
            if name in self.unloaded:
                if not ready_only:
                    out.append(pb.RepositoryIndexResponse.ModelIndex(name=name, state="UNAVAILABLE", reason="unloaded"))
                continue
            try:
                self.plan(name)
            except InferError as exc:
                if not ready_only:
                    out.append(pb.RepositoryIndexResponse.ModelIndex(name=name, state="UNAVAILABLE",
                                                                     reason=exc.message))
                continue
            out.append(pb.RepositoryIndexResponse.ModelIndex(name=name, version="1", state="READY"))
        return out

    def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        if name in self.unloaded:
            raise model_not_found(name, version)
        if name in self.errors:
            raise InferError.unavailable(f"ensemble '{name}' failed to load: {self.errors[name]}")
        if version and version != "1":
            raise model_not_found(name, version)
        config = self.configs[name]
        if self.decoupled(name, version) and not config.model_transaction_policy.decoupled:
            # (as Triton's: an ensemble with a decoupled step is decoupled itself)
            config = mc.ModelConfig.FromString(config.SerializeToString())
            config.model_transaction_policy.decoupled = True
        return pb.ModelConfigResponse(config=config)

    def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        config = self.model_config(name, version).config
        md = pb.ModelMetadataResponse(name=name, versions=["1"], platform=ENSEMBLE_PLATFORM)
        batch = [-1] if config.max_batch_size > 0 else []
        for t in config.input:
            md.inputs.add(name=t.name, datatype=config_to_wire(t.data_type), shape=batch + list(t.dims))
        for t in config.output:
            md.outputs.add(name=t.name, datatype=config_to_wire(t.data_type), shape=batch + list(t.dims))
        return md
