"""--model-load-thread-count's logic (services/base/load_threads.py, ServiceCore.start and
ServiceCore._make_room): the flag's values, the growth overlapping builds share, the room loads in
flight reserve, and the start's order (pinned first, at most N at once). Through running servers:
tests/integration/test_model_load_threads.py."""
from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

import pytest

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.telemetry.model_stats import ModelStats
from services.base import memory
from services.base.core import HostedModel, ServiceCore
from services.base.load_threads import DEFAULT_LOAD_THREADS, SharedGrowth, thread_count_argument


def test_the_flag() -> None:
    from services.base.main import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args(["--repository", "r"]).model_load_thread_count == DEFAULT_LOAD_THREADS == 4  # Triton's
    assert ap.parse_args(["--repository", "r", "--model-load-thread-count", "1"]).model_load_thread_count == 1
    for bad in ("0", "-1", "2.5", "many", ""):
        with pytest.raises(SystemExit):
            ap.parse_args(["--repository", "r", "--model-load-thread-count", bad])


@pytest.mark.parametrize("text,message", [("0", "at least 1"), ("-3", "at least 1"), ("x", "not a whole number")])
def test_thread_count_argument_refuses(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        thread_count_argument(text)


class _Rss:
    def __init__(self) -> None:
        self.value = 1000

    def __call__(self) -> int:
        return self.value


def test_one_build_alone_gets_its_whole_growth() -> None:
    rss = _Rss()
    growth = SharedGrowth(rss)
    rss.value = 5000  # before the build: not its own
    token = growth.begin()
    rss.value = 8000
    assert growth.end(token) == 3000


def test_overlapping_builds_share_the_growth_and_the_shares_add_up() -> None:
    rss = _Rss()
    growth = SharedGrowth(rss)
    a = growth.begin()
    rss.value += 400  # a alone: 400 to a
    b = growth.begin()
    rss.value += 600  # a and b: 300 each
    a_bytes = growth.end(a)
    rss.value += 100  # b alone
    b_bytes = growth.end(b)
    assert (a_bytes, b_bytes) == (700, 400)
    assert a_bytes + b_bytes == 1100  # the process's real growth, counted once


def test_memory_freed_during_a_build_is_shared_too() -> None:
    rss = _Rss()
    growth = SharedGrowth(rss)
    a, b = growth.begin(), growth.begin()
    rss.value -= 200
    assert growth.end(a) + growth.end(b) == -200


# ---- the room loads in flight reserve ---------------------------------------------------------
def _config(name: str) -> mc.ModelConfig:
    return mc.ModelConfig(name=name, platform="onnxruntime_onnx",
                          instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)])


def _hosted(core: ServiceCore, name: str, files: int) -> HostedModel:
    (core.repository / name / "1").mkdir(parents=True, exist_ok=True)
    (core.repository / name / "1" / "model.onnx").write_bytes(b"\0" * files)
    return core.models.setdefault(name, HostedModel(name, core.repository / name))


def test_a_load_in_flight_holds_its_room_against_another(tmp_path: Path) -> None:
    core = ServiceCore("onnx", tmp_path, {})
    core.memory = memory.MemoryBook(1000, enforced=True)
    a, b = _hosted(core, "a", 500), _hosted(core, "b", 500)  # each estimated at 600 of 1000

    async def run() -> None:
        await core._make_room(a, _config("a"), [1], a.path, False, reservation=1)
        assert core._reserved == {1: {memory.HOST: 600}}
        with pytest.raises(InferError) as err:  # a's 600 are taken while a loads
            await core._make_room(b, _config("b"), [1], b.path, False, reservation=2)
        assert err.value.code == Code.RESOURCE_EXHAUSTED
        assert "600 of 1000 bytes are held" in err.value.message
        assert 2 not in core._reserved
        del core._reserved[1]  # a's load ended (its measured size counts from then on)
        await core._make_room(b, _config("b"), [1], b.path, False, reservation=2)

    asyncio.run(run())


# ---- the start: pinned first, at most N at once, each failure its own ------------------------
class _Version:
    def __init__(self, name: str) -> None:
        self.name, self.memory_bytes, self.ready, self.instances = name, 0, True, []
        self.stats = ModelStats(name, 1)
        self.gpu_bytes: dict[int, int] = {}
        self.loaded_ms = memory.now()

    async def close(self, drain: bool = True) -> None:
        pass


class _SlowCore(ServiceCore):
    """Builds that take a while and record when they ran (on the load threads)."""

    def __init__(self, repository: Path) -> None:
        super().__init__("python", repository, {})  # (a python model's scan reads no model file)
        self.runs: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def _build_version(self, path: Path, config: mc.ModelConfig, version: int):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        time.sleep(0.1)
        with self._lock:
            self.runs.append((config.name, t0, time.monotonic()))
        if config.name == "m_bad":
            raise RuntimeError("no weights here")
        return _Version(config.name)


def _repository(root: Path, names: list[str]) -> Path:
    for name in names:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text("")
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n')
    return root


def _most_at_once(runs: list[tuple[str, float, float]]) -> int:
    events = sorted([(s, 1) for _, s, _ in runs] + [(e, -1) for _, _, e in runs])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


@pytest.mark.parametrize("threads", [1, 3])
def test_start_loads_pinned_models_first_and_at_most_n_at_once(tmp_path: Path, threads: int) -> None:
    names = [f"m_{i}" for i in range(7)] + ["m_bad"]
    core = _SlowCore(_repository(tmp_path, names))
    core.load_threads = threads
    core.memory = memory.MemoryBook(1 << 40, frozenset({"m_5", "m_6"}), enforced=False)
    asyncio.run(core.start())
    assert sorted(n for n, _, _ in core.runs) == sorted(names)
    pinned_end = max(e for n, _, e in core.runs if n in ("m_5", "m_6"))
    assert all(s >= pinned_end for n, s, _ in core.runs if n not in ("m_5", "m_6"))  # pinned first
    assert _most_at_once(core.runs) <= threads
    if threads > 1:
        assert _most_at_once(core.runs) > 1
    assert core.models["m_bad"].state == "UNAVAILABLE" and "no weights here" in core.models["m_bad"].reason
    assert all(core.models[n].state == "READY" for n in names if n != "m_bad")


@pytest.mark.parametrize("processes", [False, True])
def test_under_an_enforced_budget_in_process_builds_go_one_at_a_time(tmp_path: Path, processes: bool) -> None:
    """An in-process runtime's growth can only be told apart alone (measured: 8 ONNX models of
    16 MiB loaded 4 at once were counted 143-158 MiB instead of 129): under an enforced budget
    those builds take turns; a kind whose instances are processes (python) measures them on
    their own and still loads side by side."""
    names = [f"m_{i}" for i in range(6)]
    core = _SlowCore(_repository(tmp_path, names))
    core.instances_are_processes = processes
    core.load_threads = 3
    core.memory = memory.MemoryBook(1 << 40, enforced=True)
    asyncio.run(core.start())
    assert all(core.models[n].state == "READY" for n in names)
    most = _most_at_once(core.runs)
    assert (1 < most <= 3) if processes else most == 1, core.runs
