"""ServiceCore model control with a fake runtime (no processes): the index lists model
directories added after start, `file:` overrides go to a fresh directory under the repository
and are removed when retired, and load errors carry Triton's texts."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from meshserve import examples
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from services.base.control import ModelControl
from services.base.core import OVERRIDES_DIR, ServiceCore
from services.base.runtime import InstancePlacement

CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
CONFIG_JSON = ('{{"name": "{name}", "platform": "onnxruntime_onnx", "max_batch_size": 8, "input": [{{"name": "INPUT0", '
               '"data_type": "TYPE_FP32", "dims": [4]}}], "output": [{{"name": "OUTPUT0", "data_type": "TYPE_FP32", '
               '"dims": [4]}}]}}')


class Echo:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        return {"OUTPUT0": inputs["INPUT0"] * self.factor}

    def close(self) -> None:
        pass


class FakeAdapter:
    """Runs examples.scale models without onnxruntime: the factor is the model's initializer."""

    def load(self, model_file: Path, config: object, placement: InstancePlacement) -> Echo:
        model = onnx.load(str(model_file))
        return Echo(float(numpy_helper.to_array(model.graph.initializer[0])[0]))


def _scale(factor: float) -> bytes:
    return examples.scale(factor).SerializeToString()  # type: ignore[attr-defined]


def _model(repo: Path, name: str, content: bytes | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (repo / name / "1" / "model.onnx").write_bytes(_scale(2.0) if content is None else content)


def _load_params(name: str | None, files: dict[str, bytes]) -> dict[str, pb.ModelRepositoryParameter]:
    """A load request's parameters: the config override of model ``name`` (None: no config) and files."""
    out = {f"file:{k}": pb.ModelRepositoryParameter(bytes_param=v) for k, v in files.items()}
    if name is not None:
        out["config"] = pb.ModelRepositoryParameter(string_param=CONFIG_JSON.format(name=name))
    return out


@pytest.fixture()
async def core(tmp_path: Path) -> AsyncIterator[ServiceCore]:
    repo = tmp_path / "repo"
    repo.mkdir()
    _model(repo, "m")
    (repo / "ens" / "1").mkdir(parents=True)
    (repo / "ens" / "config.pbtxt").write_text('name: "ens" platform: "ensemble"')
    c = ServiceCore("onnx", repo, {"onnxruntime": FakeAdapter()})  # type: ignore[dict-item]
    c.control = ModelControl("explicit", frozenset({"m"}))
    await c.start()
    yield c
    await c.stop(drain=False)


def _states(index: pb.RepositoryIndexResponse) -> dict[tuple[str, str], tuple[str, str]]:
    return {(m.name, m.version): (m.state, m.reason) for m in index.models}


async def test_index_lists_directories_added_after_start(core: ServiceCore) -> None:
    _model(core.repository, "late")
    states = _states(await core.repository_index(False))
    assert states[("late", "")] == ("UNAVAILABLE", "not loaded (explicit model control)")
    assert ("ens", "") not in states  # another kind's model: not this service's
    assert ("late", "") not in _states(await core.repository_index(True))  # ready_only
    await core._load("late", {})
    assert _states(await core.repository_index(True))[("late", "1")] == ("READY", "")
    await core._unload("late")
    assert _states(await core.repository_index(False))[("late", "")] == ("UNAVAILABLE", "unloaded")


async def test_missing_model_is_tritons_poll_error(core: ServiceCore) -> None:
    with pytest.raises(InferError) as err:
        await core._load("nope", {})
    assert err.value.code is Code.NOT_FOUND
    assert err.value.message == "failed to load 'nope', failed to poll from model repository"


async def test_file_overrides_load_from_a_fresh_directory_and_are_removed(core: ServiceCore) -> None:
    repo = core.repository
    params = _load_params("m", {"1/model.onnx": _scale(3.0)})
    await core._load("m", params)
    hosted = core.models["m"]
    assert hosted.path.parent.parent == repo / OVERRIDES_DIR and hosted.path.name == "m"
    assert (repo / "m" / "1" / "model.onnx").read_bytes() == _scale(2.0)  # the repository's files are untouched
    assert hosted.versions[1]._instances[0].factor == 3.0  # type: ignore[attr-defined]
    first = hosted.path
    await core._load("m", params)  # a reload: a fresh directory; the old one goes with the old version
    assert hosted.path != first and not first.exists() and hosted.path.exists()
    await core._load("m", {})  # without files: the repository's model again
    assert hosted.path == repo / "m" and not list((repo / OVERRIDES_DIR).iterdir())
    await core._load("new", _load_params("new", {"1/model.onnx": _scale(5.0)}))
    assert core.models["new"].versions[1].ready
    await core._unload("new")
    assert not list((repo / OVERRIDES_DIR).iterdir())


@pytest.mark.parametrize("bad", ["../evil", "1/../../evil", "/../evil", "1/./evil", "1\\evil", ""])
async def test_file_override_paths_stay_inside(core: ServiceCore, bad: str) -> None:
    with pytest.raises(InferError) as err:
        await core._load("m", _load_params("m", {bad: b"1"}))
    assert err.value.code is Code.INVALID_ARG and "file path" in err.value.message
    assert not list(core.repository.parent.rglob("evil"))
    assert not (core.repository / OVERRIDES_DIR).exists() or not list((core.repository / OVERRIDES_DIR).iterdir())


async def test_an_absolute_file_path_is_the_model_directorys(core: ServiceCore) -> None:
    """As Triton joins it: ``file:/evil`` is the model directory's ``evil`` (never the root's);
    no version directory then, so the load fails in Triton's words and nothing is left."""
    with pytest.raises(InferError) as err:
        await core._load("m", _load_params("m", {"/evil": b"1"}))
    assert err.value.code is Code.INVALID_ARG
    assert err.value.message == "failed to load 'm': at least one version must be available under the version " \
                                "policy of model 'm'"
    assert not list(core.repository.parent.rglob("evil"))
    assert not (core.repository / OVERRIDES_DIR).exists() or not list((core.repository / OVERRIDES_DIR).iterdir())


async def test_files_need_config_and_a_failed_load_is_in_the_index(core: ServiceCore) -> None:
    with pytest.raises(InferError, match="'config'") as err:
        await core._load("m", _load_params(None, {"1/model.onnx": _scale(3.0)}))
    assert err.value.code is Code.INVALID_ARG
    _model(core.repository, "broken", b"not a model")
    with pytest.raises(InferError) as err:
        await core._load("broken", {})
    assert err.value.message.startswith("failed to load 'broken': ")
    state, reason = _states(await core.repository_index(False))[("broken", "")]
    assert state == "UNAVAILABLE" and reason.startswith("failed to load 'broken': ")


async def test_index_shows_loading_while_a_first_load_runs(core: ServiceCore) -> None:
    release = threading.Event()
    entered = threading.Event()

    class Slow(FakeAdapter):
        def load(self, model_file: Path, config: object, placement: InstancePlacement) -> Echo:
            entered.set()
            release.wait(10)
            return super().load(model_file, config, placement)

    core.adapters["onnxruntime"] = Slow()  # type: ignore[assignment]
    _model(core.repository, "slow")
    loading = asyncio.ensure_future(core._load("slow", {}))
    try:
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        assert _states(await core.repository_index(False))[("slow", "")] == ("LOADING", "")
        assert ("slow", "") not in _states(await core.repository_index(True))
    finally:
        release.set()
        await loading
    assert _states(await core.repository_index(False))[("slow", "1")] == ("READY", "")
