"""services/base/memory.py: sizes, the default budget, the eviction plan, the ledger."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.base import memory
from services.base.memory import Candidate, MemoryBook, plan_evictions


@pytest.mark.parametrize(("text", "value"), [
    ("536870912", 536870912), ("512Mi", 512 << 20), ("2G", 2_000_000_000), ("1.5GiB", 3 << 29),
    ("64k", 64_000), ("1Ti", 1 << 40), (" 100 M ", 100_000_000), ("7b", 7)])
def test_sizes(text: str, value: int) -> None:
    assert memory.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "-1", "12Q", "Mi", "1.2.3", "2 GB GB"])
def test_not_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        memory.parse_bytes(text)


def test_budget_argument() -> None:
    assert memory.budget_argument("1Gi") == 1 << 30
    assert memory.budget_argument("100%") == pytest.approx(memory.default_budget() / memory.DEFAULT_BUDGET_SHARE,
                                                          rel=0.01)
    for bad in ("0", "0%", "150%"):
        with pytest.raises(ValueError):
            memory.budget_argument(bad)


def test_cgroup_limit(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    assert memory.cgroup_limit(tmp_path, proc) is None
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.cgroup_limit(tmp_path, proc) is None
    (tmp_path / "memory.max").write_text("1073741824\n")
    assert memory.cgroup_limit(tmp_path, proc) == 1 << 30
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1: no limit
    assert memory.cgroup_limit(tmp_path, proc) is None


def test_cgroup_limit_of_a_nested_group(tmp_path: Path) -> None:
    """The process's own group is read from /proc/self/cgroup; the smallest limit on its path wins."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "memory.max").write_text("max\n")
    (tmp_path / "a" / "memory.max").write_text("2147483648\n")
    assert memory.cgroup_limit(tmp_path, proc) == 2 << 30
    (tmp_path / "a" / "b" / "memory.max").write_text("1073741824\n")
    assert memory.cgroup_limit(tmp_path, proc) == 1 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "svc").mkdir(parents=True)
    (v1 / "memory" / "svc" / "memory.limit_in_bytes").write_text("536870912\n")
    proc.write_text("4:memory:/svc\n1:cpu:/\n0::/\n")
    assert memory.cgroup_limit(v1, proc) == 512 << 20


def test_default_budget_is_a_share_of_physical_memory() -> None:
    total, used = memory.system_memory()
    assert 0 < used < total
    assert 0 < memory.default_budget() <= total * memory.DEFAULT_BUDGET_SHARE


def test_version_bytes_is_at_least_the_files_and_adds_worker_processes() -> None:
    class Worker:
        def resident_bytes(self) -> int:
            return 30

    assert memory.version_bytes(-5, [], 100) == 100  # a load into freed heap: the files at least
    assert memory.version_bytes(150, [object()], 100) == 150
    assert memory.version_bytes(10, [Worker(), Worker()], 50) == 70
    assert memory.rss_bytes() > 0 and memory.pss_bytes(1 << 30) == 0  # no such process


def _c(model: str, last: float, size: int, busy: bool = False) -> Candidate:
    return Candidate(model, 1, last, size, busy)


def test_plan_least_recently_used_first() -> None:
    cs = [_c("b", 20, 30), _c("a", 10, 30), _c("c", 30, 30)]
    assert plan_evictions(10, 50, 100, cs) == []  # fits already
    assert [c.model for c in plan_evictions(40, 90, 100, cs) or []] == ["a"]
    assert [c.model for c in plan_evictions(70, 90, 100, cs) or []] == ["a", "b"]


def test_plan_skips_busy_versions_and_says_when_nothing_can_make_room() -> None:
    cs = [_c("a", 10, 30, busy=True), _c("b", 20, 30)]
    assert [c.model for c in plan_evictions(40, 90, 100, cs) or []] == ["b"]
    assert plan_evictions(70, 90, 100, cs) is None  # a is busy: not enough
    assert plan_evictions(200, 0, 100, []) is None  # more than the whole budget


def test_book_estimates_from_files_then_from_the_last_measurement() -> None:
    book = MemoryBook(budget=1000)
    assert book.estimate("m", 1, files=100, instances=2, processes=False) == 240
    assert book.estimate("m", 1, files=100, instances=1, processes=True) == 120 + memory.PROCESS_ESTIMATE_BYTES
    book.measured("m", 1, 130)
    assert book.estimate("m", 1, files=100, instances=2, processes=False) == 130


def test_book_counters_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "MAX_TRACKED_MODELS", 3)
    book = MemoryBook(budget=1000)
    for i in range(5):
        book.loaded(f"m{i}", 0.5)
        book.evicted(f"m{i}")
    assert list(book.loads) == ["m2", "m3", "m4"] and list(book.evictions) == ["m2", "m3", "m4"]
    assert list(book.load_seconds) == ["m2", "m3", "m4"]
    samples = {(k, tuple(sorted(labels.items()))): v for k, labels, v in book.samples([("m4", "1", 200)], 4, 8)}
    assert samples[("memory_used", ())] == 200 and samples[("memory_pressure", ())] == 0.2
    assert samples[("saturation", ())] == 0.5 and samples[("model_memory", (("model", "m4"), ("version", "1")))] == 200


def test_service_flags() -> None:
    import argparse

    from services.base.main import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    shown = " ".join(ap.format_help().split())  # argparse formats help with %: a stray one raises here
    assert "--memory-budget" in shown and "default 80% of the cgroup memory limit" in shown
    args = ap.parse_args(["--repository", "r", "--memory-budget", "512Mi", "--pin", "a", "--pin", "b"])
    assert args.memory_budget == 512 << 20 and args.pin == ["a", "b"]
    assert ap.parse_args(["--repository", "r"]).memory_budget is None  # main(): memory.default_budget()
    with pytest.raises(SystemExit):
        ap.parse_args(["--repository", "r", "--memory-budget", "lots"])


def test_base_is_measured_after_the_runtimes_start() -> None:
    primed: list[str] = []

    class Primes:
        def prime(self) -> None:
            primed.append("yes")
            held.append(bytearray(b"\x01") * (64 << 20))  # a runtime's one-time start, kept for good

    class Plain:  # no prime(): nothing to start
        pass

    held: list[bytearray] = []
    base = memory.measure_base()
    book = MemoryBook(budget=1000, base=base)
    book.prime("plain", Plain())
    assert book.base == base and primed == []
    book.prime("primes", Primes())
    assert primed == ["yes"]
    assert book.base >= base + (56 << 20)  # the start's memory is in the base, not in a first model's size
    book.prime("primes", Primes())  # once per backend
    assert primed == ["yes"] and book.primed == {"plain", "primes"}
    samples = {k: v for k, labels, v in book.samples([], 0, 0) if not labels}
    assert samples["memory_base"] == book.base


# In a fresh interpreter (a runtime starts once per process): prime the runtime or not, then load
# a small model through its adapter and run it once; print the prime's cost and what the load and
# first run added to the RSS (what a first model is charged, and what stays after its load).
_FIRST_LOAD = """
import json, sys, tempfile
from pathlib import Path
import numpy as np
from google.protobuf import text_format
from meshserve._proto import model_config_pb2 as mc
from services.base import memory
from services.base.runtime import InstancePlacement
runtime, primed = sys.argv[1], sys.argv[2] == "1"
d = Path(tempfile.mkdtemp())
if runtime == "pytorch":
    import torch
    from services.torchscript.runtime import TorchScriptAdapter as Adapter
    torch.jit.save(torch.jit.script(torch.nn.Linear(256, 256)), str(d / "model"))
else:
    from onnx import TensorProto, helper, numpy_helper, save
    from services.onnx.runtime import OnnxRuntimeAdapter as Adapter
    w = numpy_helper.from_array(np.ones((256, 256), np.float32), "w")
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 256]) for n in ("x", "y")]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "m", io[:1], io[1:], [w])
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(d / "model"))
config = text_format.Parse(f'name: "m" backend: "{runtime}" input {{ name: "x" data_type: TYPE_FP32 dims: [1, 256] }} '
                           'output { name: "y" data_type: TYPE_FP32 dims: [1, 256] }', mc.ModelConfig())
start = memory.measure_base()
book = memory.MemoryBook(budget=1 << 30, base=start)
if primed:
    book.prime(runtime, Adapter())
before = memory.measure_base()
Adapter().load(d / "model", config, InstancePlacement(0, "m", "cpu")).run({"x": np.ones((1, 256), np.float32)}, ["y"])
print(json.dumps({"prime": book.base - start, "first": memory.measure_base() - before}))
"""


def first_load(runtime: str, primed: bool) -> dict[str, int]:
    """(prime's cost, the first model's load and first run) in bytes, in a fresh interpreter."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_LOAD, runtime, "1" if primed else "0"], check=True,
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[3]).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("runtime", "module", "start"), [("onnxruntime", "onnxruntime", 8 << 20),
                                                          ("pytorch", "torch", 4 << 20)])
def test_prime_moves_the_runtimes_start_from_the_first_model_to_the_base(runtime: str, module: str,
                                                                         start: int) -> None:
    pytest.importorskip(module)
    cold, primed = first_load(runtime, False), first_load(runtime, True)
    print(f"{runtime}: first model charged {cold['first'] >> 10} KiB unprimed, {primed['first'] >> 10} KiB "
          f"primed; the prime added {primed['prime'] >> 10} KiB to the base")
    assert primed["prime"] >= start  # the one-time start is paid by the prime, into the base ...
    assert cold["first"] - primed["first"] >= start // 2  # ... and no longer by the first model


def test_a_service_primes_only_the_runtimes_its_models_load(tmp_path: Path) -> None:
    """A kind with several runtimes (sequence: onnxruntime and pytorch) pays the start of those its
    loads use, once each, before the load is measured: a TorchScript-only service no onnxruntime."""
    from meshserve._proto import model_config_pb2 as mc
    from services.base.core import ServiceCore

    primed: list[str] = []

    class Instance:
        def run(self, inputs: dict[str, object], names: list[str]) -> dict[str, object]:
            return {}

        def close(self) -> None:
            pass

    class Adapter:
        def __init__(self, name: str) -> None:
            self.name = name

        def prime(self) -> None:
            primed.append(self.name)

        def load(self, model_file: Path, config: mc.ModelConfig, placement: object) -> Instance:
            return Instance()

    core = ServiceCore("sequence", tmp_path, {n: Adapter(n) for n in ("onnxruntime", "pytorch")})  # type: ignore[misc]
    (tmp_path / "1").mkdir()
    for _ in range(2):
        core._measured_build(tmp_path, mc.ModelConfig(name="t", backend="pytorch"), 1)
    assert primed == ["pytorch"] and core.memory.primed == {"pytorch"}
