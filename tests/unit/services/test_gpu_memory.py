"""Device memory in the mesh's budget (services/base/memory.py, "device memory"; docs/model-mesh.md,
"GPU memory"): a version's KIND_GPU instances are counted per GPU against that GPU's budget, in the
figures a gateway reads (gateway/placement.py:ReplicaFacts). The pure parts and ServiceCore's use of
them run here without a GPU (device figures stand in for measured ones); what needs a device is
tests/integration/test_gpu_memory_budget.py, skipped without one."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.placement import Placement, Policy, ReplicaFacts
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from services.base import memory
from services.base.core import HostedModel, ServiceCore
from services.base.memory import HOST, Candidate, MemoryBook, plan_room
from tests.unit.services.test_eviction_grace import _Version

GPU = mc.ModelInstanceGroup.KIND_GPU


def test_gpu_budget_argument() -> None:
    assert memory.gpu_budget_argument("8G") == (None, 8_000_000_000)
    assert memory.gpu_budget_argument("512Mi") == (None, 512 << 20)
    assert memory.gpu_budget_argument("90%") == (None, "90%")
    assert memory.gpu_budget_argument("1=4Gi") == (1, 4 << 30)
    assert memory.gpu_budget_argument("0=50%") == (0, "50%")
    for bad in ("x=1G", "0=", "0%", "101%", "lots", "0"):
        with pytest.raises(ValueError, match="gpu-memory-budget|not a size"):
            memory.gpu_budget_argument(bad)


def test_gpu_budgets_default_share_every_gpu_and_one() -> None:
    totals = {0: 1000, 1: 2000}
    assert memory.gpu_budgets([], totals) == {0: 800, 1: 1600}  # DEFAULT_BUDGET_SHARE of each
    assert memory.gpu_budgets([(None, 500)], totals) == {0: 500, 1: 500}
    assert memory.gpu_budgets([(None, "50%"), (1, 300)], totals) == {0: 500, 1: 300}
    assert memory.gpu_budgets([(2, 700)], {}) == {2: 700}  # named, its size unreadable: its bytes
    with pytest.raises(ValueError, match="GPU 2"):
        memory.gpu_budgets([(2, "50%")], {})
    assert memory.gpu_budgets([], {}) == {}  # no GPU seen, none named: nothing bounded


def test_the_flag() -> None:
    import argparse

    from services.base.main import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--repository", "r", "--gpu-memory-budget", "8G", "--gpu-memory-budget", "1=50%"])
    assert args.gpu_memory_budget == [(None, 8_000_000_000), (1, "50%")]
    assert ap.parse_args(["--repository", "r"]).gpu_memory_budget == []
    assert "--gpu-memory-budget" in " ".join(ap.format_help().split())
    with pytest.raises(SystemExit):
        ap.parse_args(["--repository", "r", "--gpu-memory-budget", "a=1G"])


def test_a_versions_device_size() -> None:
    devices = {0: 2, 1: 1}  # two instances on GPU 0, one on GPU 1
    measured = memory.gpu_version_bytes({0: 1000, 1: 500}, {0: 1900, 1: 520}, devices, files=100)
    assert measured == {0: 900, 1: 100}  # GPU 1 changed by less than its files: the files
    unreadable = memory.gpu_version_bytes({0: None, 1: None}, {0: None, 1: None}, devices, files=100)
    assert unreadable == {0: 240, 1: 120}  # estimated: files x ESTIMATE_FACTOR per instance


def test_the_estimate_before_a_load() -> None:
    book = MemoryBook(budget=10_000)
    assert book.estimate_gpu("m", 1, files=100, devices={0: 2}) == {0: 240}
    book.measured_gpu("m", 1, {0: 150})
    assert book.estimate_gpu("m", 1, files=100, devices={0: 2, 1: 1}) == {0: 150, 1: 120}
    assert book.estimate_gpu("m", 1, files=100, devices={}) == {}


def test_plan_room_frees_the_budget_that_is_short() -> None:
    cpu_old = Candidate("cpu", 1, 1, 300)  # the least recently used, but it holds no device memory
    gpu_a = Candidate("a", 1, 2, 100, gpu=((0, 600),))
    gpu_b = Candidate("b", 1, 3, 100, gpu=((0, 300),))
    cs = [gpu_b, cpu_old, gpu_a]
    # GPU 0 short by 500: the LRU holder of GPU 0 goes, not the older CPU-only version
    assert plan_room({HOST: 50, 0: 500}, {HOST: 500, 0: 900}, {HOST: 1000, 0: 900}, cs) == [gpu_a]
    # both short: the CPU one for host memory, then GPU holders
    assert plan_room({HOST: 600, 0: 500}, {HOST: 500, 0: 900}, {HOST: 1000, 0: 900}, cs) == [cpu_old, gpu_a]
    assert plan_room({HOST: 50, 0: 1000}, {HOST: 500, 0: 900}, {HOST: 1000, 0: 900}, cs) is None
    assert plan_room({HOST: 50, 0: 10_000}, {HOST: 0, 0: 0}, {HOST: 1000}, cs) == []  # GPU 0 not bounded
    busy = [Candidate("a", 1, 2, 100, busy=True, gpu=((0, 600),)), gpu_b]
    assert plan_room({HOST: 0, 0: 500}, {HOST: 0, 0: 900}, {HOST: 1000, 0: 900}, busy) is None


def test_plan_room_of_host_memory_alone_is_plan_evictions() -> None:
    cs = [Candidate("b", 1, 20, 30), Candidate("a", 1, 10, 30), Candidate("c", 1, 30, 30, busy=True)]
    for needed, used in ((10, 50), (40, 90), (70, 90), (80, 90)):
        assert plan_room({HOST: needed}, {HOST: used}, {HOST: 100}, cs) == memory.plan_evictions(needed, used, 100, cs)


def test_samples_show_gpu_figures_only_where_there_are_gpus() -> None:
    names = {name for name, _, _ in MemoryBook(budget=100).samples([("m", "1", 10)], 0, 0)}
    assert not any("gpu" in n for n in names)  # the CPU path's exposition is unchanged
    book = MemoryBook(budget=100, gpu_budgets={0: 1000, 1: 2000})
    got = {(n, tuple(sorted(labels.items()))): v
           for n, labels, v in book.samples([("m", "1", 10)], 0, 0, [("m", "1", 0, 300), ("n", "2", 0, 100)])}
    assert got[("gpu_memory_budget", (("gpu", "0"),))] == 1000 and got[("gpu_memory_budget", (("gpu", "1"),))] == 2000
    assert got[("gpu_memory_used", (("gpu", "0"),))] == 400 and got[("gpu_memory_used", (("gpu", "1"),))] == 0
    assert got[("model_gpu_memory", (("gpu", "0"), ("model", "m"), ("version", "1")))] == 300


def test_without_a_gpu_nothing_is_read() -> None:
    if memory.gpu_totals():
        pytest.skip("this host has a GPU")
    assert memory.gpu_process_bytes(0, [1]) is None


# ---- ServiceCore: a GPU host's loads under a device budget (device figures stand in) -------------
def _gpu_core(tmp_path: Path, **versions: _Version) -> ServiceCore:
    core = ServiceCore("onnx", tmp_path, {}, gpu_available=True)
    core.memory = MemoryBook(10_000_000, grace_s=0.0, gpu_budgets={0: 1000})
    for name, mv in versions.items():
        core.models[name] = HostedModel(name, tmp_path / name, mc.ModelConfig(name=name),
                                        versions={1: mv}, state="READY")  # type: ignore[dict-item]
    return core


def _gpu_version(name: str, host: int, device: int) -> _Version:
    mv = _Version(name, host, served=True)
    mv.gpu_bytes = {0: device} if device else {}
    return mv


def _load_room(core: ServiceCore, name: str, files: int, kind: int = GPU) -> None:
    (core.repository / name / "1").mkdir(parents=True, exist_ok=True)
    (core.repository / name / "1" / "model.onnx").write_bytes(b"\0" * files)
    hosted = core.models.setdefault(name, HostedModel(name, core.repository / name))
    config = mc.ModelConfig(name=name, instance_group=[mc.ModelInstanceGroup(count=1, kind=kind, gpus=[0])])
    asyncio.run(core._make_room(hosted, config, [1], hosted.path, evict=True))


def test_a_gpu_load_evicts_device_memory_not_the_older_cpu_model(tmp_path: Path) -> None:
    cpu_only, on_gpu = _gpu_version("cpu_only", 100, 0), _gpu_version("on_gpu", 100, 700)
    on_gpu.stats.last_inference_ms += 10  # used after cpu_only: cpu_only is the least recently used
    core = _gpu_core(tmp_path, cpu_only=cpu_only, on_gpu=on_gpu)
    _load_room(core, "new", 400)  # GPU 0: 700 held + 480 estimated > 1000
    assert on_gpu.closed and not cpu_only.closed


def test_a_cpu_load_on_a_gpu_host_leaves_device_memory_alone(tmp_path: Path) -> None:
    on_gpu = _gpu_version("on_gpu", 100, 900)
    core = _gpu_core(tmp_path, on_gpu=on_gpu)
    _load_room(core, "cpu_model", 400, kind=mc.ModelInstanceGroup.KIND_CPU)
    assert not on_gpu.closed


def test_no_room_on_the_gpu_is_refused_naming_it(tmp_path: Path) -> None:
    pinned = _gpu_version("pinned", 100, 700)
    core = _gpu_core(tmp_path, pinned=pinned)
    core.memory.pinned = frozenset({"pinned"})
    with pytest.raises(InferError) as err:
        _load_room(core, "new", 400)
    assert err.value.code is Code.RESOURCE_EXHAUSTED
    assert err.value.message.startswith("failed to load 'new': not enough room in the memory budget of GPU 0 of "
                                        "the onnx service: it needs about 480 bytes and 700 of 1000 bytes")
    with pytest.raises(InferError) as whole:
        _load_room(core, "huge", 2000)
    assert "more than the whole memory budget of GPU 0" in whole.value.message


def test_after_a_load_a_passed_gpu_budget_is_settled(tmp_path: Path) -> None:
    older, other = _gpu_version("older", 100, 400), _gpu_version("other", 100, 0)
    core = _gpu_core(tmp_path, older=older, other=other, loaded=_gpu_version("loaded", 100, 700))
    asyncio.run(core._settle("loaded"))
    assert older.closed and not other.closed  # other holds nothing on the GPU


# ---- what the gateway reads --------------------------------------------------------------------
GPU_EXPOSITION = "\n".join([
    "meshserve_memory_budget_bytes 1000", "meshserve_memory_used_bytes 250",
    'meshserve_gpu_memory_budget_bytes{gpu="0"} 8000', 'meshserve_gpu_memory_budget_bytes{gpu="1"} 4000',
    'meshserve_gpu_memory_used_bytes{gpu="0"} 2000', 'meshserve_gpu_memory_used_bytes{gpu="1"} 0',
    'meshserve_model_gpu_memory_bytes{model="a",version="1",gpu="0"} 1500',
    'meshserve_model_gpu_memory_bytes{model="a",version="2",gpu="0"} 500',
    'meshserve_model_memory_bytes{model="a",version="1"} 100', ""])


def test_replica_facts_read_the_gpu_figures() -> None:
    facts = ReplicaFacts.parse(GPU_EXPOSITION)
    assert facts.gpu_budget == {"0": 8000.0, "1": 4000.0} and facts.gpu_used == {"0": 2000.0, "1": 0.0}
    assert facts.gpu_sizes == {"a": 2000.0} and facts.sizes == {"a": 100.0}
    cpu = ReplicaFacts.parse("meshserve_memory_budget_bytes 1000\n")
    assert (cpu.gpu_budget, cpu.gpu_used, cpu.gpu_sizes) == ({}, {}, {})


def test_the_placement_view_and_metrics_show_each_gpu() -> None:
    replica = SimpleNamespace(endpoint="r1:1", kind="onnx", healthy=True)
    cpu_replica = SimpleNamespace(endpoint="r2:1", kind="onnx", healthy=True)
    upstream = SimpleNamespace(replicas=[replica, cpu_replica],
                               discovery=SimpleNamespace(table=SimpleNamespace(models={})))
    placement = Placement(upstream, Policy(lazy_all=True))  # type: ignore[arg-type]
    placement.facts = {"r1:1": ReplicaFacts.parse(GPU_EXPOSITION),
                       "r2:1": ReplicaFacts.parse("meshserve_memory_budget_bytes 1000\n")}
    replicas = {r["endpoint"]: r for r in placement.view()["replicas"]}  # type: ignore[attr-defined]
    assert replicas["r1:1"]["gpus"] == {"0": {"budget_bytes": 8000.0, "used_bytes": 2000.0},
                                        "1": {"budget_bytes": 4000.0, "used_bytes": 0.0}}
    assert replicas["r2:1"]["gpus"] == {}
    pressure = {tuple(sorted(labels.items())): v for name, labels, v in placement.metric_samples()
                if name == "replica_gpu_memory_pressure"}
    assert pressure == {(("gpu", "0"), ("replica", "r1:1")): 0.25, (("gpu", "1"), ("replica", "r1:1")): 0.0}


# ---- the meters, on stand-ins for torch.cuda and pynvml (the code a GPU host runs) ---------------
class _FakeCuda:
    def __init__(self) -> None:
        self.reserved = {0: 1000, 1: 50}
        self.emptied = 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def get_device_properties(self, d: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=(d + 1) * 10_000)

    def memory_reserved(self, d: int) -> int:
        return self.reserved[d]

    def empty_cache(self) -> None:
        self.emptied += 1


def test_torch_meters_this_process_when_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(memory, "_nvml", lambda: None)
    assert memory.gpu_totals() == {0: 10_000, 1: 20_000}
    meter = memory.gpu_meter()
    assert meter is not None and memory.gpu_read(meter, 0, [1]) == 1000 and memory.gpu_read(meter, 1, []) == 50
    assert memory.gpu_read(meter, 7, [1]) is None  # a device it cannot read: estimated, not a failed load
    memory.gpu_trim()
    assert cuda.emptied == 1


def test_nvml_meters_the_given_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    procs = [SimpleNamespace(pid=10, usedGpuMemory=300), SimpleNamespace(pid=11, usedGpuMemory=None),
             SimpleNamespace(pid=12, usedGpuMemory=200), SimpleNamespace(pid=99, usedGpuMemory=5000)]
    nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda d: f"h{d}",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80_000),
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs if h == "h0" else [])
    monkeypatch.setitem(sys.modules, "torch", None)  # not loaded here
    monkeypatch.setattr(memory, "_nvml", lambda: nvml)
    assert memory.gpu_totals() == {0: 80_000}
    assert memory.gpu_process_bytes(0, [10, 11, 12]) == 500  # another process's memory is not ours
    assert memory.gpu_process_bytes(1, [10]) == 0
    memory.gpu_trim()  # no torch: nothing to hand back, no failure
