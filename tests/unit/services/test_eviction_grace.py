"""The grace of a fresh version (services/base/memory.py:is_fresh, docs/model-mesh.md "Loading
under the budget"): a version loaded less than --eviction-grace ago that has not served a request
is not evicted by another load; a load that could only make room by evicting fresh versions is
refused at once (never waits on them); after a load the budget comes before the grace. The
processes end to end: tests/integration/test_mesh_fresh_loads.py."""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.telemetry.model_stats import ModelStats
from services.base import memory
from services.base.core import EVICTED, HostedModel, ServiceCore
from services.base.memory import Candidate, is_fresh, plan_evictions


def test_is_fresh_until_used_or_the_grace_is_over() -> None:
    assert is_fresh(0, 0, loaded_ms=1000, grace_s=2, now_ms=2999)
    assert not is_fresh(0, 0, loaded_ms=1000, grace_s=2, now_ms=3000)  # the grace is over
    assert not is_fresh(2500, 0, loaded_ms=1000, grace_s=2, now_ms=2600)  # it ran a request
    assert not is_fresh(0, 1, loaded_ms=1000, grace_s=2, now_ms=2600)  # a request failed on it: it was reached
    assert not is_fresh(0, 0, loaded_ms=1000, grace_s=0, now_ms=1000)  # no grace
    assert not is_fresh(0, 0, loaded_ms=1000, grace_s=2, now_ms=900)  # the clock stepped back: no grace


def test_plan_skips_fresh_versions() -> None:
    cs = [Candidate("a", 1, 10, 30, fresh=True), Candidate("b", 1, 20, 30)]
    assert [c.model for c in plan_evictions(40, 90, 100, cs) or []] == ["b"]  # a is older, but fresh
    assert plan_evictions(70, 90, 100, cs) is None


@pytest.mark.parametrize("text,value", [("0", 0.0), ("2", 2.0), ("0.25", 0.25), ("60", 60.0)])
def test_grace_argument(text: str, value: float) -> None:
    assert memory.grace_argument(text) == value


@pytest.mark.parametrize("text", ["-1", "60.5", "nan", "inf", "soon", ""])
def test_grace_argument_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="--eviction-grace"):
        memory.grace_argument(text)


def test_the_flag() -> None:
    from services.base.main import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args(["--repository", "r"]).eviction_grace == memory.EVICTION_GRACE_S
    assert ap.parse_args(["--repository", "r", "--eviction-grace", "0"]).eviction_grace == 0
    assert "--eviction-grace" in " ".join(ap.format_help().split())
    with pytest.raises(SystemExit):
        ap.parse_args(["--repository", "r", "--eviction-grace", "-1"])


# ---- ServiceCore's use of it, on versions that stand in for loaded ones -------------------------
class _Version:
    def __init__(self, name: str, size: int, served: bool = False, busy: bool = False) -> None:
        self.name, self.memory_bytes, self._busy, self.ready = name, size, busy, True
        self.loaded_ms = memory.now()
        self.stats = ModelStats(name, 1)
        if served:
            self.stats.last_inference_ms = int(self.loaded_ms) + 1
        self.gpu_bytes: dict[int, int] = {}  # (test_gpu_memory.py sets it)
        self.closed = False

    def last_used_ms(self) -> float:
        return max(self.stats.last_inference_ms, self.loaded_ms)

    def busy(self) -> bool:
        return self._busy

    async def close(self, drain: bool = True) -> None:
        self.closed = True


def _core(tmp_path: Path, budget: int, grace_s: float, **versions: _Version) -> ServiceCore:
    core = ServiceCore("onnx", tmp_path, {})
    core.memory = memory.MemoryBook(budget, grace_s=grace_s)
    for name, mv in versions.items():
        core.models[name] = HostedModel(name, tmp_path / name, mc.ModelConfig(name=name),
                                        versions={1: mv}, state="READY")  # type: ignore[dict-item]
    return core


def _room(core: ServiceCore, name: str, needed_files: int) -> None:
    """ServiceCore._make_room for a model ``name`` whose version 1 has ``needed_files`` bytes."""
    (core.repository / name / "1").mkdir(parents=True, exist_ok=True)
    (core.repository / name / "1" / "model.onnx").write_bytes(b"\0" * needed_files)
    hosted = core.models.setdefault(name, HostedModel(name, core.repository / name))
    config = mc.ModelConfig(name=name, instance_group=[mc.ModelInstanceGroup(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)])
    asyncio.run(core._make_room(hosted, config, [1], hosted.path, evict=True))


def test_a_load_that_could_only_evict_fresh_versions_is_refused_at_once(tmp_path: Path) -> None:
    core = _core(tmp_path, 1000, 2.0, a=_Version("a", 600))
    started = time.monotonic()
    with pytest.raises(InferError) as err:
        _room(core, "b", 500)
    assert time.monotonic() - started < 1.0  # not EVICTION_WAIT_S: nothing to wait for
    assert err.value.code is Code.RESOURCE_EXHAUSTED and "not served a request yet" in err.value.message
    assert core.models["a"].versions  # still loaded


def test_a_version_that_served_is_evicted_and_a_fresh_one_is_not(tmp_path: Path) -> None:
    old, fresh = _Version("old", 400, served=True), _Version("fresh", 400)
    fresh.loaded_ms = old.loaded_ms - 10  # loaded before the other served: the older of the two by use
    core = _core(tmp_path, 1000, 2.0, old=old, fresh=fresh)
    _room(core, "b", 300)
    assert old.closed and not fresh.closed
    assert core.models["old"].reason == EVICTED and core.models["fresh"].versions


def test_a_busy_fresh_version_is_waited_for(tmp_path: Path) -> None:
    """Its first request is running: once it ends the version is used, so the load waits for it
    (bounded by EVICTION_WAIT_S) rather than being refused."""
    running = _Version("running", 600, busy=True)
    core = _core(tmp_path, 1000, 2.0, running=running)

    async def scenario() -> None:
        async def finish() -> None:
            await asyncio.sleep(0.2)
            running.stats.last_inference_ms = int(memory.now())
            running._busy = False
        done = asyncio.ensure_future(finish())
        hosted = core.models["b"] = HostedModel("b", tmp_path / "b")
        (tmp_path / "b" / "1").mkdir(parents=True)
        (tmp_path / "b" / "1" / "model.onnx").write_bytes(b"\0" * 500)
        config = mc.ModelConfig(name="b", instance_group=[mc.ModelInstanceGroup(count=1)])
        await core._make_room(hosted, config, [1], hosted.path, evict=True)
        await done

    asyncio.run(scenario())
    assert running.closed


def test_after_a_load_the_budget_comes_before_the_grace(tmp_path: Path) -> None:
    """A load whose measured size came out over its estimate: the budget is passed; fresh
    versions go when the used ones are not enough (never a budget passed to keep a grace)."""
    for loaded, both in ((700, False), (800, True)):  # 300 over: the used one is enough; 400: not
        used, fresh = _Version("used", 300, served=True), _Version("fresh", 300)
        core = _core(tmp_path, 1000, 2.0, used=used, fresh=fresh, loaded=_Version("loaded", loaded))
        asyncio.run(core._settle("loaded"))
        assert used.closed and fresh.closed is both and core.used_bytes() <= 1000


def test_the_gateways_retry_window_covers_the_default_grace() -> None:
    """A load refused for a fresh version whose request never comes succeeds within the window
    the gateway tries again in (gateway/placement.py:PLACE_RETRY_S) once the grace is over."""
    from gateway.placement import PLACE_RETRY_S

    assert memory.EVICTION_GRACE_S <= PLACE_RETRY_S
