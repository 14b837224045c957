"""ServiceCore: the V2 operations of one backend service over its loaded models."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes
from meshserve.protocol.errors import InferError, model_not_found
from meshserve.repository import kinds, layout
from meshserve.repository.config import ConfigError, load_model_config, parse_config_json
from meshserve.repository.labels import read_labels
from meshserve.repository.names import check_load_name, check_model_name, check_version, model_file_path
from meshserve.server import admission, connections
from meshserve.server.access import ALL, Grant, Op
from meshserve.server.core import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    InferResult,
    RequestContext,
    unary_decoupled_error,
)
from meshserve.server.repository_control import FILES_NEED_CONFIG, ControlPolicy, poll_failed
from meshserve.telemetry import loop_lag, metrics
from services.base import memory
from services.base.control import ModelControl, fingerprint
from services.base.load_threads import DEFAULT_LOAD_THREADS, SharedGrowth
from services.base.model import ModelVersion, early_release
from services.base.runtime import RuntimeAdapter, RuntimeLoadError, placements
from services.base.scheduling.dynamic import DynamicBatcher
from services.base.warmup import run_warmup

log = logging.getLogger("meshserve.service")

# Model files given in a load request (`file:<path>` parameters) are written under
# <repository>/OVERRIDES_DIR/<fresh id>/<model>/: a hidden directory, so never a model directory
# of the repository's own (layout.model_dirs skips it), and a fresh one per load, so a reload
# never overwrites files a version still serving reads.
OVERRIDES_DIR = ".meshserve-overrides"
NOT_LOADED = "not loaded (explicit model control)"
EVICTED = "unloaded (evicted to make room under the memory budget)"
# errors writing a load request's files that the client's paths cause (the whole path over
# PATH_MAX; "1/a" given as a file and as a directory): 400, Triton's "failed to poll" text
_CLIENT_PATH_ERRORS = frozenset({errno.ENAMETOOLONG, errno.EEXIST, errno.ENOTDIR, errno.EISDIR})
# the service's own families beside Triton's nv_* ones (metrics.MODEL_FAMILIES)
SERVICE_FAMILIES = {
    "early_release": metrics.Family("meshserve_batch_early_release_total", "counter",
                                    "Batches the dynamic batcher released before max_queue_delay because the "
                                    "clients it expected were all queued (early release)"),
}
_FAMILIES = {**metrics.MODEL_FAMILIES, **SERVICE_FAMILIES, **memory.FAMILIES, **connections.FAMILIES,
             **loop_lag.FAMILIES}


@dataclass
class HostedModel:
    """A model of this service's kind, loaded or not."""

    name: str
    path: Path
    config: mc.ModelConfig | None = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    state: str = "UNAVAILABLE"
    reason: str = ""
    metadata: pb.ModelMetadataResponse | None = None


class ServiceCore:
    """Hosts the repository's models of one kind (e.g. "onnx") and serves them."""

    # a version's instances run in processes of their own (the python kind): a first load's
    # memory estimate adds an interpreter per instance (services/base/memory.py)
    instances_are_processes = False

    def __init__(self, kind: str, repository: Path, adapters: dict[str, RuntimeAdapter],
                 gpu_available: bool = False):
        self.kind = kind
        self.repository = repository
        self.adapters = adapters
        self.gpu_available = gpu_available
        self.models: dict[str, HostedModel] = {}
        self._started = False
        self._draining = False
        # a runtime's one-time start (MemoryBook.prime) happens once, in the first build of its backend
        self._load_lock = threading.Lock()
        # --model-load-thread-count: models loaded at once (at start, by load requests), the threads
        # they load on; loads of one model go one after the other (name -> its lock and its users)
        self.load_threads = DEFAULT_LOAD_THREADS
        self._load_pool: ThreadPoolExecutor | None = None
        self._load_slots: asyncio.Semaphore | None = None
        self._model_loads: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        # the resident growth of overlapping builds, split among them (services/base/load_threads.py)
        self._growth = SharedGrowth(memory.rss_bytes)
        self._one_build = threading.Lock()  # the builds that are measured one at a time (_measured_build)
        # what the loads in flight are expected to take, per budget (memory.HOST, GPUs): counted as
        # used by another load's room check, so loads at once cannot all fit in the same room
        self._reserved: dict[int, dict[int, int]] = {}
        # plain loads (no parameters) queued or running, per model: another plain load of the same
        # model meanwhile waits for that one's outcome instead of loading it again (_load_once)
        self._plain_loads: dict[str, asyncio.Future[None]] = {}
        self.control = ModelControl()
        self._fingerprints: dict[str, tuple] = {}
        # model directories of other kinds (by their fingerprint): not scanned again until they change
        self._foreign: dict[str, tuple] = {}
        self._poller: asyncio.Task[None] | None = None
        self.server_name = SERVER_NAME
        # --allow-model-uploads / --allow-remote-model-control: a service has no tenants, so
        # load/unload come from loopback clients only unless the operator opens them
        self.access = ControlPolicy()
        # --max-model-load-bytes: an adapter with a guard_load measures an uploaded model's load first
        self.max_model_load_bytes = 0
        # --memory-budget / --pin: sizes, budget and eviction (services/base/memory.py); main()
        # enforces it in explicit model control (loads evict, or are refused)
        self.memory = memory.MemoryBook(budget=memory.default_budget(), enforced=False)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Scan the repository and load every model of our kind (versions per policy): up to
        ``load_threads`` models at once (--model-load-thread-count), the pinned ones first (they
        fit), each model's failure its own; returns once every load has ended."""
        self.memory.base = memory.measure_base()  # before any load; runtimes add theirs (services/base/memory.py)
        loop = asyncio.get_running_loop()
        pool = self._loads()
        entries = await self._scan()
        todo: list[tuple[HostedModel, layout.ModelEntry]] = []
        for entry in entries:
            if not self._is_mine(entry):
                self._foreign[entry.name] = fingerprint(entry.path)
                continue
            hosted = HostedModel(entry.name, entry.path, entry.config)
            self.models[entry.name] = hosted
            self._fingerprints[entry.name] = fingerprint(entry.path)
            if not self.control.loads_at_start(entry.name):
                hosted.reason = NOT_LOADED
                continue
            if entry.config is None or not entry.loadable_versions:
                hosted.reason = entry.error or "config could not be loaded"
                log.error("model '%s' not loaded: %s", entry.name, hosted.reason)
                continue
            if entry.error:
                log.warning("model '%s': %s", entry.name, entry.error)
            todo.append((hosted, entry))
        for backend in sorted({entry.config.backend for _, entry in todo if entry.config is not None}):
            # each runtime's one-time start, alone: what it adds goes to the base, not to a model loading beside it
            await loop.run_in_executor(pool, self.memory.prime, backend, self.adapters.get(backend))
        pinned = [job for job in todo if job[0].name in self.memory.pinned]
        for group in (pinned, [job for job in todo if job[0].name not in self.memory.pinned]):  # pinned first
            await asyncio.gather(*(self._start_load(hosted, entry) for hosted, entry in group))
        self._started = True
        if self.control.mode == "poll":
            self._poller = asyncio.ensure_future(self._poll_repository())

    def startup_failures(self) -> list[tuple[str, str]]:
        """(name, reason) of each model the start meant to load that has no version ready
        (--exit-on-error); a model explicit mode left unloaded is none of them."""
        return [(h.name, h.reason or "no version loaded") for h in self.models.values()
                if not h.versions and h.reason != NOT_LOADED]

    async def _scan(self) -> list[layout.ModelEntry]:
        """Every model directory of the repository read (its config: a python model's
        auto_complete_config runs here), ``load_threads`` at once on the load threads."""
        loop = asyncio.get_running_loop()
        pool = self._loads()
        return await asyncio.gather(*(loop.run_in_executor(pool, self._scan_one, d)
                                      for d in layout.model_dirs(self.repository)))

    def _scan_one(self, model_dir: Path) -> layout.ModelEntry:
        return layout.scan_model(model_dir, gpu_available=self.gpu_available)

    async def _start_load(self, hosted: HostedModel, entry: layout.ModelEntry) -> None:
        assert entry.config is not None
        async with self._one_load(hosted.name):
            try:
                await self._load_versions(hosted, entry.config, entry.loadable_versions, evict=False)
            except Exception:
                pass  # recorded on the model (index shows UNAVAILABLE + reason); others still load

    @contextlib.asynccontextmanager
    async def _one_load(self, name: str) -> AsyncIterator[None]:
        """A load of ``name`` may run: after the loads of the same model before it, and while fewer
        than ``load_threads`` loads run (Triton's load thread pool)."""
        if self._load_slots is None:
            self._load_slots = asyncio.Semaphore(self.load_threads)
        lock, users = self._model_loads.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock, self._load_slots:
                yield
        finally:
            users[0] -= 1
            if not users[0]:  # (no entry is kept for a name nobody loads now)
                del self._model_loads[name]

    def _loads(self) -> ThreadPoolExecutor:
        """The threads builds and start-up scans run on: --model-load-thread-count of them."""
        if self._load_pool is None:
            self._load_pool = ThreadPoolExecutor(self.load_threads, thread_name_prefix="meshserve-load")
        return self._load_pool

    def _is_mine(self, entry: layout.ModelEntry) -> bool:
        """A model of this service's kind (or one whose config is broken but whose files are)."""
        return entry.kind == self.kind or (entry.config is None and entry.kind is None
                                           and _looks_like(entry.path, self.kind))

    async def _load_versions(self, hosted: HostedModel, config: mc.ModelConfig, versions: list[int],
                             path: Path | None = None, evict: bool = True) -> None:
        """Load ``versions`` from ``path`` (default: the model's directory), then retire the old ones.
        Under an enforced memory budget the load first makes room (``evict``: by unloading idle
        versions of other models, least recently used first) or is refused."""
        path = hosted.path if path is None else path
        loop = asyncio.get_running_loop()
        loaded: dict[int, ModelVersion] = {}
        started = time.monotonic()
        reservation = object()
        try:
            try:
                if self.memory.enforced:
                    await self._make_room(hosted, config, versions, path, evict, id(reservation))
                for v in versions:
                    t0 = time.monotonic()
                    try:
                        mv = await loop.run_in_executor(self._loads(), self._measured_build, path, config, v)
                    except InferError:
                        raise
                    except Exception as exc:  # Triton's words for a version that failed to load
                        raise RuntimeLoadError(f"load failed for model '{hosted.name}': version {v} is at "
                                               f"UNAVAILABLE state: {exc}") from None
                    loaded[v] = mv
                    mv.stats.load_duration_s = time.monotonic() - t0  # nv_model_load_duration_secs
                    log.info("loaded model '%s' version %d in %.2fs", hosted.name, v, mv.stats.load_duration_s)
            except Exception as exc:
                for mv in loaded.values():
                    await mv.close(drain=False)
                hosted.state, hosted.reason = "UNAVAILABLE", str(exc)
                log.error("model '%s' failed to load: %s", hosted.name, exc)
                raise
        finally:
            self._reserved.pop(id(reservation), None)  # its versions' measured sizes count from here
        for v, mv in loaded.items():
            self.memory.measured(hosted.name, v, mv.memory_bytes)
            self.memory.measured_gpu(hosted.name, v, mv.gpu_bytes)
        self.memory.loaded(hosted.name, time.monotonic() - started)
        old, old_path = hosted.versions, hosted.path
        hosted.config = config
        hosted.versions = loaded
        hosted.path = path
        hosted.metadata = _metadata(config, sorted(loaded))
        hosted.state, hosted.reason = ("READY", "") if loaded else ("UNAVAILABLE", "no versions selected")
        await self._release(list(old.values()))  # load new, then retire old (drain its queue)
        del old
        if old_path != path:
            self._remove_override(old_path)
        if self.memory.enforced and evict:
            await self._settle(hosted.name)

    def _measured_build(self, path: Path, config: mc.ModelConfig, version: int) -> ModelVersion:
        """``_build_version`` with the version's size measured (services/base/memory.py:version_bytes),
        after the runtime's one-time start (if this is its first load here) went to the base."""
        # the outputs' label files, read before any instance is made: one outside the model's folder,
        # or that does not read, fails the load (Triton's core model.cc, Model::Init)
        labels = read_labels(path, config)
        with self._load_lock:
            self.memory.prime(config.backend, self.adapters.get(config.backend))
        devices = self._gpu_devices(config)
        if devices or (self.memory.enforced and not self.instances_are_processes):
            # one such build at a time: device memory is read per process, and an in-process
            # runtime's growth can only be told apart alone (docs/model-control.md, "Loading in parallel")
            with self._one_build:
                mv = self._build_measuring(path, config, version, devices)
        else:
            mv = self._build_measuring(path, config, version, devices)
        if labels:  # (most models have none)
            mv.encoder.labels = labels
        return mv

    def _build_measuring(self, path: Path, config: mc.ModelConfig, version: int,
                         devices: dict[int, int]) -> ModelVersion:
        own = [os.getpid()]
        meter = memory.gpu_meter() if devices else None
        gpu_before = {d: memory.gpu_read(meter, d, own) for d in devices}
        files = memory.files_bytes(path / str(version))
        token = self._growth.begin(files)
        try:
            mv = self._build_version(path, config, version)
        finally:
            grown = self._growth.end(token)  # its share of the growth, other builds running beside it
        mv.memory_bytes = memory.version_bytes(grown, mv.instances, files)
        if devices:  # its instances' own processes (python workers) hold device memory too
            pids = own + [pid for i in mv.instances if isinstance(pid := getattr(i, "pid", None), int)]
            gpu_after = {d: memory.gpu_read(meter, d, pids) for d in devices}
            mv.gpu_bytes = memory.gpu_version_bytes(gpu_before, gpu_after, devices, files)
        return mv

    def _gpu_devices(self, config: mc.ModelConfig) -> dict[int, int]:
        """GPU -> the version's instances on it ({} on a host without a GPU: the CPU path)."""
        if not self.gpu_available:
            return {}
        out: dict[int, int] = {}
        for p in placements(config, True):
            if p.kind == "gpu":
                out[p.device_id] = out.get(p.device_id, 0) + 1
        return out

    # ---- the memory budget -------------------------------------------------------------
    def used_bytes(self) -> int:
        """The measured sizes of every loaded version (meshserve_memory_used_bytes)."""
        return sum(mv.memory_bytes for mv in self._all_versions())

    def _held(self, versions: Iterable[ModelVersion]) -> dict[int, int]:
        """What ``versions`` hold per budget: memory.HOST, and each GPU (device bytes)."""
        out = {memory.HOST: 0}
        for mv in versions:
            out[memory.HOST] += mv.memory_bytes
            for d, n in mv.gpu_bytes.items():
                out[d] = out.get(d, 0) + n
        return out

    def _budgets(self, resources: Iterable[int]) -> dict[int, int]:
        """The budgets of ``resources`` (a GPU without --gpu-memory-budget nor a readable size: none)."""
        book = self.memory
        return {r: book.budget if r == memory.HOST else book.gpu_budgets[r]
                for r in resources if r == memory.HOST or r in book.gpu_budgets}

    async def _make_room(self, hosted: HostedModel, config: mc.ModelConfig, versions: list[int], path: Path,
                         evict: bool, reservation: int | None = None) -> None:
        """Unload the least recently used idle, unpinned versions of other models until the
        load's estimate fits the budget; wait (up to memory.EVICTION_WAIT_S) while busy versions
        could make room once idle; else refuse with RESOURCE_EXHAUSTED, also when only fresh
        versions (loaded within the grace, not used yet: memory.is_fresh) could make room: a
        gateway's request for them is on its way. A reload counts the versions it retires as
        free (they go once the new ones are up). Loads in flight count with their estimates; the
        room found is reserved under ``reservation`` until the load ends."""
        book = self.memory
        instances = len(placements(config, self.gpu_available))
        devices = self._gpu_devices(config)
        needed = {memory.HOST: 0, **dict.fromkeys(devices, 0)}
        for v in versions:
            files = memory.files_bytes(path / str(v))
            needed[memory.HOST] += book.estimate(hosted.name, v, files, instances, self.instances_are_processes)
            for d, n in book.estimate_gpu(hosted.name, v, files, devices).items():
                needed[d] += n
        budgets = self._budgets(needed)
        own = self._held(hosted.versions.values())
        deadline = time.monotonic() + memory.EVICTION_WAIT_S
        while True:
            held = self._held(self._all_versions())
            used = {r: held.get(r, 0) - own.get(r, 0) + sum(o.get(r, 0) for o in self._reserved.values())
                    for r in needed}
            candidates = self._candidates(hosted.name) if evict else []
            plan = memory.plan_room(needed, used, budgets, candidates)
            if plan is not None:
                if reservation is not None:  # (no await since the plan: no other load took this room)
                    self._reserved[reservation] = needed
                await self._evict(plan)
                return
            # busy versions become idle (and used: no longer fresh) once their requests end
            later = [replace(c, busy=False, fresh=False) if c.busy else c for c in candidates]
            idle_later = memory.plan_room(needed, used, budgets, later)
            if idle_later is None or time.monotonic() >= deadline:
                raise InferError.exhausted(self._no_room(hosted.name, needed, used, budgets),
                                           retry_after_s=admission.RETRY_AFTER_S)
            await asyncio.sleep(0.05)  # busy versions finish their requests; then plan again

    def _candidates(self, loading: str) -> list[memory.Candidate]:
        """The loaded versions an eviction may consider: every unpinned one but ``loading``'s,
        each marked busy (requests in flight, live sequences) and fresh (memory.is_fresh)."""
        pinned, grace_s, now_ms = self.memory.pinned, self.memory.grace_s, memory.now()
        return [memory.Candidate(name, v, mv.last_used_ms(), mv.memory_bytes, mv.busy(),
                                 memory.is_fresh(mv.stats.last_inference_ms, mv.stats.fail.count, mv.loaded_ms,
                                                 grace_s, now_ms), tuple(sorted(mv.gpu_bytes.items())))
                for name, other in self.models.items() if name != loading and name not in pinned
                for v, mv in other.versions.items()]

    async def _evict(self, plan: list[memory.Candidate]) -> None:
        """Unload the planned versions: all taken out of service in one step (right after the
        plan, no await between: no request reaches them), then closed and their memory trimmed."""
        victims = [self._take_for_eviction(c.model, c.version) for c in plan]
        names = {mv.name for mv in victims}
        await self._release(victims)
        for name in names:
            self._forget_override(self.models[name])

    async def _release(self, versions: list[ModelVersion]) -> None:
        """Close retired versions (their queues drained), then give their memory back: the
        versions are freed now (memory.collect) and the heap trimmed (memory.trim). Empties
        ``versions``: the caller must hold no other reference."""
        if not versions:
            return
        for mv in versions:
            await mv.close(drain=True)
        del mv
        versions.clear()
        memory.collect()
        await asyncio.get_running_loop().run_in_executor(None, memory.trim)
        if self.gpu_available:
            memory.gpu_trim()

    async def _settle(self, loaded: str) -> None:
        """After a load: its measured size may be larger than its estimate; while the budget is
        passed, unload idle versions of other models (least recently used first, no waiting).
        The budget comes before the grace: fresh versions go too when the others are not enough.
        The same for each GPU's budget."""
        held = self._held(self._all_versions())
        budgets = self._budgets(held)
        passed = {r for r, b in budgets.items() if held[r] > b}
        if passed:
            candidates = self._candidates(loaded)
            needed = dict.fromkeys(held, 0)
            plan = memory.plan_room(needed, held, budgets, candidates)
            if plan is None:
                plan = memory.plan_room(needed, held, budgets, [replace(c, fresh=False) for c in candidates])
            if plan is None:  # not enough idle versions: unload what may go, the rest is reported
                plan = [c for c in candidates if not c.busy and any(c.holds(r) for r in passed)]
            await self._evict(plan)

    def _no_room(self, name: str, needs: dict[int, int], used_by: dict[int, int], budgets: dict[int, int]) -> str:
        """The refusal's words for the budget that is short: host memory's first, else a GPU's."""
        short = [r for r in budgets if used_by.get(r, 0) + needs[r] > budgets[r]] or [memory.HOST]
        r = memory.HOST if memory.HOST in short else short[0]
        needed, used, budget = needs.get(r, 0), used_by.get(r, 0), budgets.get(r, self.memory.budget)
        which = "memory budget" if r == memory.HOST else f"memory budget of GPU {r}"
        if needed > budget:
            return (f"failed to load '{name}': it needs about {needed} bytes, more than the whole {which} "
                    f"of the {self.kind} service ({budget} bytes)")
        return (f"failed to load '{name}': not enough room in the {which} of the {self.kind} service: it needs "
                f"about {needed} bytes and {used} of {budget} bytes are held by models that cannot be evicted now "
                f"(pinned, {self._unevictable_now()})")

    def _unevictable_now(self) -> str:
        """Why a loaded version may not go now, in the refusal's words (the grace when there is one)."""
        busy = "busy with requests in flight or live sequences"
        grace_s = self.memory.grace_s
        if grace_s <= 0:
            return f"or {busy}"
        return f"{busy}, or loaded less than {grace_s:g} s ago and not served a request yet"

    def _take_for_eviction(self, name: str, version: int) -> ModelVersion:
        """Take an idle version out of service at once (no request can reach it after this)."""
        hosted = self.models[name]
        mv = hosted.versions.pop(version)
        mv.ready = False
        if hosted.versions:
            assert hosted.config is not None
            hosted.metadata = _metadata(hosted.config, sorted(hosted.versions))
        else:
            hosted.state, hosted.reason = "UNAVAILABLE", EVICTED
        self.memory.evicted(name)
        log.info("evicted model '%s' version %d (%d bytes) to make room under the memory budget",
                 name, version, mv.memory_bytes)
        return mv

    def _forget_override(self, hosted: HostedModel) -> None:
        """A model loaded from a load request's files that is no longer loaded: delete the files."""
        if not hosted.versions and self._is_override(hosted.path):  # not loaded again meanwhile
            self._remove_override(hosted.path)
            hosted.path = self.repository / hosted.name

    def _build_version(self, path: Path, config: mc.ModelConfig, version: int) -> ModelVersion:
        backend = config.backend
        adapter = self.adapters.get(backend)
        if adapter is None:
            raise InferError.unavailable(
                f"model '{config.name}': backend '{backend}' is not served by the {self.kind} service")
        model_file = layout.model_file(path, config, version)
        early_release(config)  # a bad value fails the load before any instance is made
        self._guard_upload(adapter, path, model_file, config)
        instances = [adapter.load(model_file, config, p) for p in placements(config, self.gpu_available)]
        run_warmup(config, instances, path)  # before the version can be marked ready
        return ModelVersion(config, version, path, instances, config.platform or backend)

    def _guard_upload(self, adapter: RuntimeAdapter, path: Path, model_file: Path, config: mc.ModelConfig) -> None:
        """An uploaded model's files (a load request's `file:` parameters) are loaded first where
        their memory is bounded, when the adapter can (services/onnx/load_guard.py)."""
        guard = getattr(adapter, "guard_load", None)
        if guard is not None and self.max_model_load_bytes and self._is_override(path) and model_file.is_file():
            guard(model_file, config, self.max_model_load_bytes)

    async def stop(self, drain: bool = True) -> None:
        self._draining = True
        if self._poller is not None:
            self._poller.cancel()
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=False)  # (a build running finishes; its thread then ends)
        for hosted in self.models.values():
            for mv in hosted.versions.values():
                await mv.close(drain=drain)
            self._remove_override(hosted.path)

    # ---- model files from load requests ------------------------------------------------
    def _is_override(self, path: Path) -> bool:
        return path.parent.parent == self.repository / OVERRIDES_DIR

    def _remove_override(self, path: Path) -> None:
        """Delete a load request's model files once no version reads them any more."""
        if self._is_override(path):
            shutil.rmtree(path.parent, ignore_errors=True)

    def _write_override(self, name: str, files: dict[str, bytes]) -> Path:
        """Write a load request's ``file:<path>`` contents into a fresh directory under the
        repository; every path is checked by the names rule (nothing escapes it) before any
        byte is written. Returns the model directory to load from."""
        model_dir = self.repository / OVERRIDES_DIR / uuid.uuid4().hex / name
        try:
            targets = [(model_file_path(model_dir, rel), rel, data) for rel, data in files.items()]
        except InferError as exc:
            raise poll_failed(name, exc.message) from None
        for target, rel, data in targets:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            except OSError as exc:
                shutil.rmtree(model_dir.parent, ignore_errors=True)
                why = os.strerror(exc.errno) if exc.errno else type(exc).__name__  # never the path
                if exc.errno in _CLIENT_PATH_ERRORS:  # the paths the client chose: too long, a file in the way
                    shown = repr(rel) if len(rel) <= 64 else f"{rel[:64]!r}... ({len(rel)} characters)"
                    raise poll_failed(name, f"cannot write file {shown} of the load request: {why}") from None
                raise InferError.unavailable(f"failed to load '{name}': cannot write the model files of the "
                                             f"load request under the repository: {why}") from None
        return model_dir

    # ---- V2Core -----------------------------------------------------------------------
    def authorize(self, op: Op, model: str, ctx: RequestContext) -> Grant:
        return ALL  # a service is an internal hop: no tenants (the gateway is the front door)

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self._started and not self._draining

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=self.server_name, version=SERVER_VERSION, extensions=EXTENSIONS)

    def _resolve(self, name: str, version: str) -> ModelVersion:
        hosted = self.models.get(name)
        if hosted is None or not hosted.versions:
            check_model_name(name)  # an invalid name is a client error, not "not found"
            raise model_not_found(name, version)
        if not version:
            for v in sorted(hosted.versions, reverse=True):
                mv = hosted.versions[v]
                if mv.ready:
                    return mv
            raise InferError.unavailable(f"model '{name}' has no ready version")
        try:
            mv = hosted.versions[int(version)]
        except (ValueError, KeyError):
            check_version(version, name)
            raise model_not_found(name, version) from None
        if not mv.ready:
            raise InferError.unavailable(f"model '{name}' version {version} is not ready")
        return mv

    async def model_ready(self, name: str, version: str) -> bool:
        if name not in self.models:
            check_model_name(name)  # an invalid name is a client error, not "not ready"
        try:
            mv = self._resolve(name, version)
        except InferError:
            return False
        why = await mv.runtime_ready()
        if why is not None:  # (Triton's verbose line, its words)
            log.debug("Model '%s' version %s is not ready: %s", name, mv.version_str, why)
            return False
        return True

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        mv = self._resolve(name, version)
        hosted = self.models[name]
        assert hosted.metadata is not None
        if not version:
            return hosted.metadata
        md = pb.ModelMetadataResponse()
        md.CopyFrom(hosted.metadata)
        del md.versions[:]
        md.versions.append(mv.version_str)
        return md

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=self._resolve(name, version).config)

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        mv = self._resolve(request.model_name, request.model_version)
        if mv.decoupled:
            raise unary_decoupled_error(ctx.protocol)  # Triton's text; INVALID_ARGUMENT / 400, not its 501
        body = await mv.infer(request, self._deadline_ns(ctx), ctx.hop)
        return InferResult(raw=body)

    async def infer_stream(self, request: pb.ModelInferRequest, ctx: RequestContext
                           ) -> AsyncIterator[tuple[InferResult | None, bool]]:
        """Every response of one request, in order, the last with final=True (its response may be
        None: Triton's empty final response). A model that is not decoupled gives exactly one
        item, (result, True). Errors raise InferError."""
        mv = self._resolve(request.model_name, request.model_version)
        if not mv.decoupled:
            body = await mv.infer(request, self._deadline_ns(ctx), ctx.hop)
            yield InferResult(raw=body), True
            return
        # closed with this generator (a client that goes away cancels the request in the model),
        # not whenever the garbage collector gets to it
        async with contextlib.aclosing(mv.infer_stream(request, self._deadline_ns(ctx), ctx.hop)) as answers:
            async for raw, final in answers:
                yield (InferResult(raw=raw) if raw is not None else None), final

    def is_decoupled(self, name: str, version: str) -> bool:
        """Whether the model answers each request with zero or more responses (InferError
        NOT_FOUND for an unknown model)."""
        return self._resolve(name, version).decoupled

    @staticmethod
    def _deadline_ns(ctx: RequestContext) -> int | None:
        hop = ctx.hop
        deadline_ns = hop.deadline_ns  # a gateway's stream hop carries its deadline in the Hop
        if ctx.deadline is not None:
            transport = int(ctx.deadline * 1e9)  # time.monotonic() and monotonic_ns share a clock
            deadline_ns = transport if deadline_ns is None else min(deadline_ns, transport)
        return deadline_ns

    def _all_versions(self) -> Iterator[ModelVersion]:
        for hosted in self.models.values():
            yield from hosted.versions.values()

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        if not name:
            return pb.ModelStatisticsResponse(model_stats=[mv.stats.to_pb() for mv in self._all_versions()])
        check_version(version, check_model_name(name))
        hosted = self.models.get(name)
        if hosted is None or not hosted.versions:
            raise InferError.invalid(f"requested model '{name}' is not available")
        if version:
            try:
                mvs = [hosted.versions[int(version)]]
            except (ValueError, KeyError):
                raise InferError.invalid(f"requested model '{name}' version {version} is not available") from None
        else:
            mvs = [hosted.versions[v] for v in sorted(hosted.versions)]
        return pb.ModelStatisticsResponse(model_stats=[mv.stats.to_pb() for mv in mvs])

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        """Every model of this kind: loaded versions READY; models on disk that are not loaded
        (also directories added since start) UNAVAILABLE with the reason, or LOADING."""
        if not ready_only:
            await self._sync_with_disk()
        out = pb.RepositoryIndexResponse()
        for name in sorted(self.models):
            hosted = self.models[name]
            if hosted.versions:
                for v in sorted(hosted.versions):
                    out.models.add(name=name, version=str(v), state="READY")
            elif not ready_only:  # (a reason from the start or a scan names files: no path of this host goes out)
                out.models.add(name=name, state=hosted.state, reason=self._without_paths(hosted.reason, hosted.path,
                                                                                         name))
        return out

    async def _sync_with_disk(self) -> None:
        """Pick up model directories of this kind added since start (not loaded: UNAVAILABLE)
        and forget not-loaded ones whose directory is gone. A directory is scanned (its config
        read) once per change of its files; other kinds' directories are remembered as foreign.
        Measured (2-core box, 100 model directories, 50 of another kind): 2.4 ms per full index,
        2.6 ms with one new directory to scan; the gateway's discovery probes ask ready-only and
        skip this (3 us)."""
        try:
            dirs = {d.name: d for d in layout.model_dirs(self.repository)}
        except OSError as exc:
            log.error("cannot list the model repository %s: %s", self.repository, exc)
            return
        fresh = {name: d for name, d in dirs.items() if name not in self.models
                 and self._foreign.get(name) != fingerprint(d)}
        if fresh:
            loop = asyncio.get_running_loop()
            entries = await loop.run_in_executor(None, lambda: [
                (layout.scan_model(d, gpu_available=self.gpu_available), fingerprint(d)) for d in fresh.values()])
            for entry, fp in entries:
                if entry.name in self.models:
                    continue  # loaded meanwhile
                if not self._is_mine(entry):
                    self._foreign[entry.name] = fp
                    continue
                self._foreign.pop(entry.name, None)
                self.models[entry.name] = HostedModel(entry.name, entry.path, entry.config,
                                                      reason=entry.error or NOT_LOADED)
        for name in [n for n, h in self.models.items()
                     if n not in dirs and not h.versions and h.state == "UNAVAILABLE" and h.reason != "unloaded"]:
            del self.models[name]

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None:
        """(Re)load a model from the repository: load new versions, then retire old ones."""
        self._check_control("load", name, parameters, ctx)
        if parameters:  # a config override or files: a load of its own
            await self._load(name, parameters)
        else:
            await self._load_once(name)

    async def _load_once(self, name: str) -> None:
        """A plain load, single-flight: while one of the model is queued or running, another (two
        gateways placing the same cold model at once) gets its outcome instead of a second load.
        A load asked for after it ended loads again (Triton's reload)."""
        while (pending := self._plain_loads.get(name)) is not None:
            try:
                await asyncio.shield(pending)
                return
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise  # this caller went away
                # the first caller went away before its load ended: load it here
            except InferError as exc:  # the same answer, in an error of its own
                raise InferError(exc.code, exc.message, retry_after_s=exc.retry_after_s) from None
        done = self._plain_loads[name] = asyncio.get_running_loop().create_future()
        try:
            await self._load(name, {})
        except asyncio.CancelledError:
            done.cancel()
            raise
        except BaseException as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        else:
            done.set_result(None)
        finally:
            if self._plain_loads.get(name) is done:
                del self._plain_loads[name]

    def _check_control(self, action: str, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                       ctx: RequestContext) -> None:
        """A load or unload may go ahead: a valid name, the control API on, the caller allowed."""
        (check_load_name if action == "load" else check_model_name)(name)
        refused = self.control.api_error()
        if refused:
            raise InferError.unsupported(refused)
        self.access.check(action, name, parameters, ctx.peer, tenants=False)

    async def _load(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter]) -> None:
        """Triton's load: the model's directory in the repository, its config replaced by a
        ``config`` parameter; with ``file:<path>`` parameters (which need ``config``, as in
        Triton) the model's files are those given, written to a fresh directory (see OVERRIDES_DIR)."""
        path = self.repository / check_model_name(name)  # never a path outside the repository
        override = parameters["config"].string_param if "config" in parameters else None
        files = {k[len("file:"):]: p.bytes_param for k, p in parameters.items() if k.startswith("file:")}
        if files and override is None:
            raise poll_failed(name, FILES_NEED_CONFIG)
        if override is not None:
            try:
                parse_config_json(override, model=name)
            except ConfigError as exc:
                raise poll_failed(name, f"Invalid config override: {exc.message}") from None
        if not files and not path.is_dir():
            raise InferError.not_found(f"failed to load '{name}', failed to poll from model repository")
        async with self._one_load(name):
            if files:
                path = await asyncio.get_running_loop().run_in_executor(None, self._write_override, name, files)
            try:
                await self._load_from(name, path, override)
            except BaseException as exc:
                hosted = self.models.get(name)
                if hosted is None or hosted.path != path or not hosted.versions:
                    self._remove_override(path)  # no version reads these files: the load failed before the swap
                    if hosted is not None and hosted.path == path:  # a first load from files: nothing on disk now
                        hosted.path = self.repository / name
                if hosted is None and name not in self._foreign and (self.repository / name).is_dir():
                    hosted = self.models[name] = HostedModel(name, self.repository / name)
                if isinstance(exc, InferError):  # no path of this host in an answer
                    exc.message = self._without_paths(exc.message, path, name)
                    exc.args = (exc.message,)
                if hosted is not None and not hosted.versions:  # the index shows why, as Triton's does
                    hosted.state, hosted.reason = "UNAVAILABLE", str(exc)
                raise

    def _without_paths(self, message: str, path: Path, name: str) -> str:
        """``message`` with the model directory's path made relative to it and the repository's
        path hidden: load errors name files (onnxruntime's do) and are sent to the client."""
        model_dirs = {str(p) for p in (path, path.absolute(), path.resolve())}
        repositories = {str(p) for p in (self.repository.absolute(), self.repository.resolve())}
        for prefix in sorted(model_dirs, key=len, reverse=True):  # 1/model.onnx, not /srv/repo/m/1/model.onnx
            message = message.replace(prefix + "/", "").replace(prefix, f"<model {name}>")
        for prefix in sorted(repositories, key=len, reverse=True):
            message = message.replace(prefix, "<repository>")
        return message

    async def _load_from(self, name: str, path: Path, override: str | None) -> None:
        try:
            config = await asyncio.get_running_loop().run_in_executor(  # (a python model's auto_complete_config)
                self._loads(), functools.partial(load_model_config, path, override_json=override,
                                                 gpu_available=self.gpu_available))
        except ConfigError as exc:
            raise InferError.invalid(f"failed to load '{name}': {exc}") from None
        kind = layout.service_kind(config)
        if kind != self.kind:
            raise InferError.invalid(f"failed to load '{name}': it is a {kind} model, not served by the "
                                     f"{self.kind} service")
        try:
            versions = layout.select_versions(config.version_policy, layout.available_versions(path))
        except ConfigError as exc:
            raise InferError.invalid(f"failed to load '{name}': {exc}") from None
        if not versions:  # (Triton's words: core's model_lifecycle.cc; nothing would serve it)
            raise InferError.invalid(f"failed to load '{name}': at least one version must be available under the "
                                     f"version policy of model '{name}'")
        hosted = self.models.setdefault(name, HostedModel(name, path))
        if not hosted.versions:
            hosted.state, hosted.reason = "LOADING", ""
        try:
            await self._load_versions(hosted, config, versions, path)
        except InferError as exc:
            if not exc.message.startswith(f"failed to load '{name}'"):
                exc.message = f"failed to load '{name}': {exc.message}"
                exc.args = (exc.message,)
            raise
        except Exception as exc:
            raise InferError.invalid(f"failed to load '{name}': {exc}") from None

    async def unload_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                           ctx: RequestContext) -> None:
        self._check_control("unload", name, parameters, ctx)
        await self._unload(name)

    async def _unload(self, name: str) -> None:
        hosted = self.models.get(name)
        if hosted is None or not hosted.versions:
            return  # Triton: unloading a model that is not loaded succeeds
        old, hosted.versions = hosted.versions, {}
        hosted.state, hosted.reason = "UNAVAILABLE", "unloaded"
        for mv in old.values():
            mv.ready = False
        del mv
        await self._release(list(old.values()))
        del old
        self._forget_override(hosted)

    async def _poll_repository(self) -> None:
        """poll mode: reload models whose files changed, load new ones, unload removed ones. The
        directories are read, and the changed models loaded, up to ``load_threads`` at once."""
        while True:
            await asyncio.sleep(self.control.poll_secs)
            try:
                entries = {e.name: e for e in await self._scan()}
            except Exception:
                log.exception("repository poll failed")
                continue
            changed = []
            for name, entry in entries.items():
                if entry.kind != self.kind:
                    continue
                fp = fingerprint(entry.path)
                if self._fingerprints.get(name) == fp and name in self.models:
                    continue
                self._fingerprints[name] = fp
                changed.append(name)
            await asyncio.gather(*(self._poll_load(name) for name in changed))
            for name in [n for n in self.models if n not in entries]:
                log.info("repository poll: model '%s' was removed; unloading", name)
                self._fingerprints.pop(name, None)
                await self._unload(name)

    async def _poll_load(self, name: str) -> None:
        log.info("repository poll: model '%s' changed; reloading", name)
        try:
            await self._load(name, {})
        except Exception as exc:  # the old versions keep serving
            log.error("repository poll: reloading model '%s' failed: %s", name, exc)

    async def metrics_text(self) -> tuple[bytes, str]:
        samples: list[metrics.Sample] = []
        for mv in self._all_versions():
            labels = {"model": mv.name, "version": mv.version_str}
            samples += mv.stats.samples(labels)
            if isinstance(mv.scheduler, DynamicBatcher):
                samples.append(("early_release", labels, mv.scheduler.early_releases))
        gate = admission.gate
        bound = gate.max_requests if gate.max_requests != admission.UNBOUNDED else 0
        samples += self.memory.samples(((mv.name, mv.version_str, mv.memory_bytes) for mv in self._all_versions()),
                                       gate.requests, bound,
                                       [(mv.name, mv.version_str, d, n) for mv in self._all_versions()
                                        for d, n in mv.gpu_bytes.items()])
        samples += connections.samples() + loop_lag.samples()
        return metrics.render(samples, _FAMILIES), metrics.CONTENT_TYPE


def _metadata(config: mc.ModelConfig, versions: list[int]) -> pb.ModelMetadataResponse:
    batch = [-1] if config.max_batch_size > 0 else []
    md = pb.ModelMetadataResponse(name=config.name, versions=[str(v) for v in versions],
                                  platform=config.platform or config.backend)
    for t in config.input:
        md.inputs.add(name=t.name, datatype=datatypes.config_to_wire(t.data_type), shape=[*batch, *t.dims])
    for o in config.output:
        md.outputs.add(name=o.name, datatype=datatypes.config_to_wire(o.data_type), shape=[*batch, *o.dims])
    return md


def _looks_like(path: Path, kind: str) -> bool:
    """A model whose config failed to parse: guess its kind from the files so that its error shows."""
    row = kinds.by_name(kind)
    return any(any(path.glob(f"*/*{suffix}")) for suffix in (row.suffixes if row else ()))
