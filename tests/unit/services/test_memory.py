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
    memory.collect()
    memory.trim()  # as measure_base does: what earlier tests freed is not counted either side
    before = memory.rss_bytes()
    base = memory.measure_base([Primes(), Plain()])
    assert primed == ["yes"]
    assert base >= before + (56 << 20)  # the start's memory is in the base, not in a first model's size
    book = MemoryBook(budget=1000, base=base)
    samples = {k: v for k, labels, v in book.samples([], 0, 0) if not labels}
    assert samples["memory_base"] == base


def test_onnx_adapter_prime_pays_onnxruntimes_start() -> None:
    pytest.importorskip("onnxruntime")
    from services.onnx.runtime import OnnxRuntimeAdapter

    OnnxRuntimeAdapter.prime()  # a session made and dropped: no error, and again is cheap
    after_first = memory.rss_bytes()
    OnnxRuntimeAdapter.prime()
    assert memory.rss_bytes() - after_first < 8 << 20
