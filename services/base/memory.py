"""Memory accounting of a service: what each loaded model version costs, the budget it must fit
in, and which versions go first when a load needs room (docs/model-mesh.md, "Service side").

Every kind measures the same way (`measure_load` around its version build, called by
`services/base/core.py:ServiceCore`): the resident-set change the load caused in the service
process, plus the proportional set size of any process the version runs in (a python model's
worker: `ProcessBound.resident_bytes`), and never less than the version's files on disk (weights
have to be somewhere; a load that reuses memory freed by an earlier unload shows a smaller
change than it costs). Before a load the size is estimated: the size the version had when last
loaded here, else its files times ``ESTIMATE_FACTOR`` per instance.

The service's own memory is its **base**: its resident size before its first model load, taken
at start (`measure_base`, `services/base/core.py:ServiceCore.start`), plus each runtime's one-time
start (`MemoryBook.prime`): before the first load of a runtime the service hosts, its adapter's
optional ``prime()`` builds, runs and drops a trivial model (onnxruntime's environment and kernel
registries: ~19 MiB its first session keeps for good; torch's JIT, allocator and intra-op thread
pool: ~8 MiB), and what that added to the RSS goes to the base, not to the first model loaded.
A runtime no model of the service uses is never primed (a sequence service serving only
TorchScript models pays no onnxruntime start). It is on /metrics as meshserve_memory_base_bytes:
a replica's RSS stays under its budget + its base + the slack docs/model-mesh.md states.

Memory comes back on unload: `trim` hands freed heap back to the kernel (glibc's malloc_trim)
after every unload and eviction (docs/perf/memory-return.md has the figures).

**Device memory** (docs/model-mesh.md, "GPU memory"): a version with KIND_GPU instances also holds
memory on each GPU they run on, counted per device against its own budget (``--gpu-memory-budget``,
by default ``DEFAULT_BUDGET_SHARE`` of the device's memory): measured as the change of the
device memory the service's processes hold across the build (NVML, ``pynvml``, when installed;
else torch's allocator for this process when torch is already loaded and sees the device), never
less than the version's files per instance on the device; estimated (files times
``ESTIMATE_FACTOR`` per instance) when it cannot be measured. A load makes room on each device
it needs the same way as in host memory (`plan_room`). A service with no GPU instance never
reads a device and shows no GPU figure: the CPU path is the one above.

The eviction choice (`plan_evictions`) is a pure function: least recently used first, among the
versions that are neither pinned nor busy nor fresh. A **fresh** version (`is_fresh`) was loaded
less than the grace (``--eviction-grace``, ``EVICTION_GRACE_S``) ago and has not served a request
yet: the load a gateway placed it for is answered before its request arrives, and another load
that evicted it meanwhile would send that request back for another load (thrash). The grace is
bounded, so a version whose request never comes is evictable after it (no load waits on it for
ever); a load that could only make room by evicting fresh versions is refused at once
(RESOURCE_EXHAUSTED: the gateway tries another replica, or again a moment later).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from meshserve.telemetry.metrics import Family, Histogram, Sample

# --memory-budget's default: this share of the cgroup's memory limit, or of physical memory
# when the process has no limit (the rest: the service's own heap, requests in flight, headroom)
DEFAULT_BUDGET_SHARE = 0.8
# a first load's estimate: its files' size times this, per instance (onnxruntime and torch hold
# the weights once per session plus a few percent: 50 MB of weights measured 52-53 MiB)
ESTIMATE_FACTOR = 1.2
# a version whose runtime runs in processes of its own (python) adds this per instance to a
# first estimate: an interpreter with numpy, measured at ~30 MiB of PSS each
PROCESS_ESTIMATE_BYTES = 32 << 20
# a load that needs room waits at most this long for busy versions (requests in flight, live
# sequences) to become idle before it is refused
EVICTION_WAIT_S = 30.0
# --eviction-grace's default: a version that has not served a request yet is not evicted (by
# another load) for this long after its load. As long as the gateway's retry window for a load
# refused for room (gateway/placement.py:PLACE_RETRY_S), so a load refused because of a fresh
# version whose request never comes succeeds within that window once its grace is over
EVICTION_GRACE_S = 2.0
# --eviction-grace's bound: a longer grace would let loads that arrive together keep a replica's
# budget for versions nobody asks for (every other load refused meanwhile)
MAX_EVICTION_GRACE_S = 60.0
# models whose counters are kept once they are no longer loaded (a bound on /metrics label sets)
MAX_TRACKED_MODELS = 4096
LOAD_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)

FAMILIES = {
    "memory_budget": Family("meshserve_memory_budget_bytes", "gauge",
                            "Bytes the service's loaded models may hold (--memory-budget)"),
    "memory_base": Family("meshserve_memory_base_bytes", "gauge",
                          "The service's resident size before its first model load (interpreter, runtime "
                          "libraries and their one-time start): its RSS beyond the models' budget"),
    "memory_used": Family("meshserve_memory_used_bytes", "gauge",
                          "Bytes the service's loaded model versions hold (the sum of their measured sizes)"),
    "memory_pressure": Family("meshserve_memory_pressure_ratio", "gauge",
                              "meshserve_memory_used_bytes / meshserve_memory_budget_bytes"),
    "saturation": Family("meshserve_saturation_ratio", "gauge",
                         "Inference requests in flight / --max-inflight (0 when unbounded)"),
    "model_memory": Family("meshserve_model_memory_bytes", "gauge",
                           "Measured resident size of one loaded model version (all its instances)"),
    "model_loads": Family("meshserve_model_loads_total", "counter", "Model loads that succeeded"),
    "model_evictions": Family("meshserve_model_evictions_total", "counter",
                              "Model versions unloaded to make room under the memory budget"),
    "model_load_seconds": Family("meshserve_model_load_duration_seconds", "histogram",
                                 "Time one model load took (every version: files to ready), in seconds"),
    "gpu_memory_budget": Family("meshserve_gpu_memory_budget_bytes", "gauge",
                                "Bytes of one GPU's memory the service's loaded models may hold (--gpu-memory-budget)"),
    "gpu_memory_used": Family("meshserve_gpu_memory_used_bytes", "gauge",
                              "Bytes of one GPU's memory the service's loaded model versions hold (the sum of their "
                              "measured device sizes)"),
    "model_gpu_memory": Family("meshserve_model_gpu_memory_bytes", "gauge",
                               "Measured device memory of one loaded model version on one GPU (its instances there)"),
    "cpu_memory_total": Family("nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes"),
    "cpu_memory_used": Family("nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes"),
}


# ---- sizes and limits -----------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    """``"536870912"``, ``"512Mi"``, ``"2G"``, ``"1.5GiB"`` -> bytes (Kubernetes' suffixes: K M G T
    are powers of 1000, Ki Mi Gi Ti of 1024; a trailing B is allowed). ValueError otherwise."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 536870912, 512Mi, 2G)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def cgroup_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The smallest memory limit of this process's cgroup and its ancestors (v2 memory.max, v1
    memory.limit_in_bytes; the cgroup read from /proc/self/cgroup, or the mount's root as a
    container with its own cgroup namespace sees it), or None when there is none."""
    files: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, group = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):  # v1
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        at = base / group.strip("/")
        while True:
            files.append(at / name)
            if at == base:
                break
            at = at.parent
    files += [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    limits = []
    for path in files:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:  # v1 says "no limit" with a huge number, v2 with "max"
            limits.append(int(raw))
    return min(limits) if limits else None


def system_memory() -> tuple[int, int]:
    """(total, used) bytes of RAM as Triton's nv_cpu_memory_* report them: MemTotal and
    MemTotal - MemAvailable of /proc/meminfo (system-wide)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    info[key] = int(rest.split()[0]) * 1024
    except OSError:
        return 0, 0
    total = info.get("MemTotal", 0)
    return total, max(0, total - info.get("MemAvailable", total))


def default_budget() -> int:
    """--memory-budget's default: DEFAULT_BUDGET_SHARE of the cgroup limit, or of physical memory."""
    physical = system_memory()[0]
    limit = cgroup_limit()
    base = min(limit, physical) if limit and physical else (limit or physical)
    return int(base * DEFAULT_BUDGET_SHARE)


def budget_argument(text: str) -> int:
    """--memory-budget's value: bytes (``parse_bytes``), or a share of the default base as ``NN%``."""
    text = text.strip()
    if text.endswith("%"):
        share = float(text[:-1]) / 100
        if not 0 < share <= 1:
            raise ValueError(f"--memory-budget {text}: a share must be in (0%, 100%]")
        return int(default_budget() / DEFAULT_BUDGET_SHARE * share)
    value = parse_bytes(text)
    if value <= 0:
        raise ValueError("--memory-budget must be > 0")
    return value


def grace_argument(text: str) -> float:
    """--eviction-grace's value: seconds in [0, MAX_EVICTION_GRACE_S] (0: no grace)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--eviction-grace: not a number of seconds: {text!r}") from None
    if not 0 <= value <= MAX_EVICTION_GRACE_S:  # (also NaN)
        raise ValueError(f"--eviction-grace must be between 0 and {MAX_EVICTION_GRACE_S:g} seconds")
    return value


# ---- measuring ------------------------------------------------------------------------------
def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (/proc/<pid>/statm: one read, no parsing of smaps)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (its private pages plus its share of shared ones):
    what a worker process costs beside the others (falls back to its RSS)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss_bytes(pid)


def files_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (a version directory), or of ``path`` itself."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if os.name == "posix" else None
# glibc only (not musl); MESHSERVE_MALLOC_TRIM=0 leaves it out (how docs/perf/memory-return.md measures without it)
_malloc_trim = getattr(_libc, "malloc_trim", None) if os.environ.get("MESHSERVE_MALLOC_TRIM", "1") != "0" else None


def trim() -> None:
    """Hand the heap's free pages back to the kernel (glibc malloc_trim; a no-op elsewhere)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def collect() -> None:
    """Free an unloaded version's objects now (called on the event loop after an unload, before
    ``trim``). The adapters' close() drops the runtime's session or module, so the weights go at
    once; the rest of a version (its Python objects, its batcher, which calls back into it: a
    reference cycle) waits for a garbage collection, which the raised young threshold
    (meshserve/server/process.py:GEN0_THRESHOLD) makes rare. Only what was not frozen at start
    (gc.freeze) is scanned."""
    gc.collect()


@runtime_checkable
class ProcessBound(Protocol):
    """An instance that runs its model in a process of its own (the python kind's workers)."""

    def resident_bytes(self) -> int: ...


def measure_base() -> int:
    """The service's base at start: its RSS after a collection and trim, before any load."""
    collect()
    trim()
    return rss_bytes()


def prime_cost(adapter: object) -> int:
    """Run an adapter's optional ``prime()`` (its runtime's one-time start) and return the bytes
    it added to the RSS (0 without one)."""
    prime = getattr(adapter, "prime", None)
    if not callable(prime):
        return 0
    before = measure_base()
    prime()
    return max(0, measure_base() - before)


def version_bytes(rss_change: int, instances: Iterable[object], files: int) -> int:
    """A loaded version's size: the service process's resident change during its load, plus what
    its instances' own processes hold, and at least its files' size."""
    own = sum(i.resident_bytes() for i in instances if isinstance(i, ProcessBound))
    return max(files, max(0, rss_change) + own)


# ---- device memory (KIND_GPU instances) -------------------------------------------------------
@functools.cache
def _nvml() -> Any:
    """pynvml, initialised once (None: not installed, or no driver)."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]  # optional: nvidia-ml-py
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, no driver, no device: device memory is estimated
        return None


def _torch_cuda() -> Any:
    """torch.cuda when torch is already loaded in this process and sees a device (never imports
    torch: an onnx service does not pay for it)."""
    torch = sys.modules.get("torch")
    try:
        cuda = getattr(torch, "cuda", None)
        return cuda if cuda is not None and cuda.is_available() else None
    except Exception:
        return None


def gpu_totals() -> dict[int, int]:
    """Each GPU's memory in bytes (NVML, else torch when loaded); {} without a way to read them."""
    nvml = _nvml()
    try:
        if nvml is not None:
            n = nvml.nvmlDeviceGetCount()
            return {d: int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(d)).total)
                    for d in range(n)}
        cuda = _torch_cuda()
        if cuda is not None:
            return {d: int(cuda.get_device_properties(d).total_memory)
                    for d in range(cuda.device_count())}
    except Exception:
        pass
    return {}


GpuMeter = Callable[[int, Iterable[int]], "int | None"]


def gpu_meter() -> GpuMeter | None:
    """How a load's device memory is read, chosen once per load (the same meter before and after
    it): torch's allocator when torch is loaded in this process and sees a device (the bytes of
    its tensors, without the CUDA context: the torchscript kind; this process's only), else NVML's
    per-process figure of the given processes (every allocator: onnxruntime's, a python worker's;
    the CUDA context a runtime's first GPU load creates is in it); None: the caller estimates."""
    cuda = _torch_cuda()
    if cuda is not None:
        return lambda device, pids: int(cuda.memory_reserved(device))
    nvml = _nvml()
    if nvml is not None:
        def per_process(device: int, pids: Iterable[int]) -> int | None:
            wanted = set(pids)
            try:
                running = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(device))
            except Exception:  # a device NVML cannot read: estimated
                return None
            return sum(int(p.usedGpuMemory or 0) for p in running if p.pid in wanted)
        return per_process
    return None


def gpu_read(meter: GpuMeter | None, device: int, pids: Iterable[int]) -> int | None:
    """Device memory ``pids`` hold on GPU ``device`` by ``meter`` (None: none, or it cannot tell)."""
    try:
        return meter(device, pids) if meter is not None else None
    except Exception:  # a device the meter cannot read: the caller estimates
        return None


def gpu_process_bytes(device: int, pids: Iterable[int]) -> int | None:
    """``gpu_read`` with the meter a load would choose now."""
    return gpu_read(gpu_meter(), device, pids)


def gpu_trim() -> None:
    """Hand the device memory torch's caching allocator keeps for freed tensors back to the
    device after an unload (torch.cuda.empty_cache; a no-op without torch loaded or a device):
    other processes on the GPU, and NVML's figures, see it free."""
    cuda = _torch_cuda()
    if cuda is not None:
        cuda.empty_cache()


def gpu_version_bytes(before: Mapping[int, int | None], after: Mapping[int, int | None],
                      devices: Mapping[int, int], files: int) -> dict[int, int]:
    """A version's device size on each GPU it has instances on (``devices``: GPU -> instances):
    the measured change, at least its files per instance there; files x ESTIMATE_FACTOR per
    instance where the device could not be read."""
    out: dict[int, int] = {}
    for d, n in devices.items():
        b, a = before.get(d), after.get(d)
        floor = n * files
        out[d] = max(floor, a - b) if a is not None and b is not None else n * math.ceil(files * ESTIMATE_FACTOR)
    return out


def gpu_budget_argument(text: str) -> tuple[int | None, int | str]:
    """One --gpu-memory-budget value: ``SIZE`` or ``NN%`` (every GPU), or ``GPU=SIZE`` / ``GPU=NN%``
    (that one) -> (GPU or None, bytes or the share as "NN%"). ValueError otherwise."""
    device, sep, value = text.strip().rpartition("=")
    if sep and not device.isdigit():
        raise ValueError(f"--gpu-memory-budget {text}: expected SIZE, NN%, GPU=SIZE or GPU=NN%")
    value = value.strip()
    if value.endswith("%"):
        share = float(value[:-1]) / 100
        if not 0 < share <= 1:
            raise ValueError(f"--gpu-memory-budget {text}: a share must be in (0%, 100%]")
        amount: int | str = value
    else:
        amount = parse_bytes(value)
        if amount <= 0:
            raise ValueError("--gpu-memory-budget must be > 0")
    return (int(device) if sep else None), amount


def gpu_budgets(values: Sequence[tuple[int | None, int | str]], totals: Mapping[int, int]) -> dict[int, int]:
    """Each GPU's budget: the last value given for it, else the last given for every GPU, else
    DEFAULT_BUDGET_SHARE of its memory (``totals``); a share is of its memory. GPUs named but not
    seen in ``totals`` get their byte value (a share of an unknown size: ValueError)."""
    every: int | str = f"{DEFAULT_BUDGET_SHARE * 100:g}%"
    own: dict[int, int | str] = {}
    for device, amount in values:
        if device is None:
            every = amount
        else:
            own[device] = amount
    out: dict[int, int] = {}
    for d in sorted({*totals, *own}):
        amount = own.get(d, every)
        if isinstance(amount, str):
            if d not in totals:
                raise ValueError(f"--gpu-memory-budget {d}={amount}: the memory of GPU {d} cannot be read here")
            out[d] = int(totals[d] * float(amount[:-1]) / 100)
        else:
            out[d] = amount
    return out


# ---- the ledger ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A loaded version the planner may unload: (model, version), when last used, its size."""

    model: str
    version: int
    last_used: float
    size: int
    busy: bool = False
    fresh: bool = False  # loaded within the grace and not used yet (is_fresh)
    gpu: tuple[tuple[int, int], ...] = ()  # (device, bytes) it holds on each GPU

    def holds(self, resource: int) -> int:
        """Bytes it holds of ``resource``: HOST, or a GPU's index."""
        return self.size if resource == HOST else dict(self.gpu).get(resource, 0)


def is_fresh(last_inference_ms: float, failures: int, loaded_ms: float, grace_s: float, now_ms: float) -> bool:
    """Whether a version is still in its grace: it has not run a request (no inference, no failed
    request) and was loaded less than ``grace_s`` ago. A clock that stepped back ends the grace."""
    return last_inference_ms == 0 and failures == 0 and 0 <= now_ms - loaded_ms < grace_s * 1000


HOST = -1  # the host memory budget's key among plan_room's resources (GPUs: their index)


def plan_room(needed: Mapping[int, int], used: Mapping[int, int], budgets: Mapping[int, int],
              candidates: Sequence[Candidate]) -> list[Candidate] | None:
    """``plan_evictions`` over several budgets at once (HOST and each GPU a load needs room on):
    least recently used first, skipping versions that hold nothing of a budget still passed; []
    when everything fits, None when unloading every idle, unfresh candidate would not make room.
    A resource without a budget in ``budgets`` is not bounded."""
    left = {r: used.get(r, 0) for r in needed}

    def passed() -> set[int]:
        return {r for r, n in needed.items() if r in budgets and left[r] + n > budgets[r]}

    over = passed()
    if not over:
        return []
    chosen: list[Candidate] = []
    for c in sorted((c for c in candidates if not (c.busy or c.fresh)), key=lambda c: (c.last_used, c.model, c.version)):
        if not any(c.holds(r) > 0 for r in over):
            continue  # frees nothing that is short
        chosen.append(c)
        for r in left:
            left[r] -= c.holds(r)
        over = passed()
        if not over:
            return chosen
    return None


def plan_evictions(needed: int, used: int, budget: int, candidates: Sequence[Candidate]
                   ) -> list[Candidate] | None:
    """The versions to unload, least recently used first, so that ``needed`` more bytes fit
    under ``budget``; [] when they fit already; None when unloading every idle candidate would
    not make room. Busy and fresh candidates are never chosen."""
    if used + needed <= budget:
        return []
    chosen: list[Candidate] = []
    for c in sorted((c for c in candidates if not (c.busy or c.fresh)), key=lambda c: (c.last_used, c.model, c.version)):
        chosen.append(c)
        used -= c.size
        if used + needed <= budget:
            return chosen
    return None


@dataclass
class MemoryBook:
    """A service's budget, pins, the sizes last measured per version (the next load's estimate)
    and its load / eviction counters (per model: /metrics)."""

    budget: int
    pinned: frozenset[str] = frozenset()
    enforced: bool = True  # explicit model control: loads evict and may be refused
    grace_s: float = EVICTION_GRACE_S  # --eviction-grace: a version unused since its load stays this long
    gpu_budgets: dict[int, int] = field(default_factory=dict)  # --gpu-memory-budget per device (none: unbounded)
    gpu_sizes: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)  # last measured, per device
    base: int = 0  # the service's RSS before its first load (measure_base) + its runtimes' starts, on /metrics
    primed: set[str] = field(default_factory=set)  # the backends whose one-time start is in the base
    sizes: dict[tuple[str, int], int] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    load_seconds: dict[str, Histogram] = field(default_factory=dict)

    def estimate(self, model: str, version: int, files: int, instances: int, processes: bool) -> int:
        """Bytes a version is expected to take before it is loaded."""
        known = self.sizes.get((model, version))
        if known is not None:
            return known
        per_instance = math.ceil(files * ESTIMATE_FACTOR) + (PROCESS_ESTIMATE_BYTES if processes else 0)
        return max(1, instances) * per_instance

    def estimate_gpu(self, model: str, version: int, files: int, devices: Mapping[int, int]) -> dict[int, int]:
        """Device bytes a version is expected to take on each GPU before it is loaded: its size
        there when last loaded, else files x ESTIMATE_FACTOR per instance (``devices``: GPU ->
        instances of the version on it)."""
        known = self.gpu_sizes.get((model, version), {})
        return {d: known[d] if d in known else n * math.ceil(files * ESTIMATE_FACTOR) for d, n in devices.items()}

    def measured_gpu(self, model: str, version: int, sizes: dict[int, int]) -> None:
        if sizes:
            self.gpu_sizes[(model, version)] = sizes
            self._bound(self.gpu_sizes)

    def prime(self, backend: str, adapter: object) -> None:
        """Before the first load of ``backend`` here: pay its runtime's one-time start (``prime_cost``)
        and add it to the base. The builds calling it hold ServiceCore._load_lock, so once per backend."""
        if adapter is None or backend in self.primed:
            return
        self.primed.add(backend)
        self.base += prime_cost(adapter)

    def measured(self, model: str, version: int, size: int) -> None:
        self.sizes[(model, version)] = size
        self._bound(self.sizes)

    def loaded(self, model: str, seconds: float) -> None:
        self.loads[model] = self.loads.get(model, 0) + 1
        hist = self.load_seconds.get(model)
        if hist is None:
            hist = self.load_seconds[model] = Histogram(LOAD_SECONDS_BUCKETS)
        hist.observe(seconds)
        for table in (self.loads, self.load_seconds):
            self._bound(table)

    def evicted(self, model: str) -> None:
        self.evictions[model] = self.evictions.get(model, 0) + 1
        self._bound(self.evictions)

    @staticmethod
    def _bound(table: dict) -> None:  # type: ignore[type-arg]
        while len(table) > MAX_TRACKED_MODELS:  # oldest entries first (dicts keep insertion order)
            del table[next(iter(table))]

    def samples(self, versions: Iterable[tuple[str, str, int]], inflight: int, max_inflight: int,
                gpu_versions: Iterable[tuple[str, str, int, int]] = ()) -> list[Sample]:
        """/metrics samples: ``versions`` are the loaded (model, version, bytes); ``gpu_versions``
        their (model, version, GPU, device bytes) (none on a service without GPU instances: then
        no GPU family is shown)."""
        out: list[Sample] = []
        used = 0
        for model, version, size in versions:
            used += size
            out.append(("model_memory", {"model": model, "version": version}, size))
        out += [("memory_budget", {}, self.budget), ("memory_base", {}, self.base), ("memory_used", {}, used),
                ("memory_pressure", {}, used / self.budget if self.budget else 0.0),
                ("saturation", {}, inflight / max_inflight if max_inflight else 0.0)]
        out += [("model_loads", {"model": m}, n) for m, n in self.loads.items()]
        out += [("model_evictions", {"model": m}, n) for m, n in self.evictions.items()]
        out += [("model_load_seconds", {"model": m}, h) for m, h in self.load_seconds.items()]
        total, in_use = system_memory()
        out += [("cpu_memory_total", {}, total), ("cpu_memory_used", {}, in_use)]
        gpu_used = dict.fromkeys(self.gpu_budgets, 0)
        for model, version, device, size in gpu_versions:
            gpu_used[device] = gpu_used.get(device, 0) + size
            out.append(("model_gpu_memory", {"model": model, "version": version, "gpu": str(device)}, size))
        out += [("gpu_memory_budget", {"gpu": str(d)}, b) for d, b in sorted(self.gpu_budgets.items())]
        out += [("gpu_memory_used", {"gpu": str(d)}, u) for d, u in sorted(gpu_used.items())]
        return out


def now() -> float:
    """The clock last-use times are compared on (wall milliseconds, as the statistics' last_inference)."""
    return time.time() * 1000
