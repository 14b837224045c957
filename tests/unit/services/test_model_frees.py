"""A request that fails in a model version (its run raised, its deadline passed in the queue)
leaves no frame in a reference cycle: the future it awaited holds its error, whose traceback
holds the awaiting frames, so no frame may keep that future, its queue entry or the error in a
local, or the request stays alive until the next collection (tests/support/cycles.py;
docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from services.base.model import ModelVersion
from services.base.validation import ModelTensors
from services.python.instance import ModelWorker, WorkerSpec
from tests.support.cycles import collector_off, cyclic_frames
from tests.unit.services.test_ordering_and_warmup import CONFIG, request


class FailingInstance:
    """Raises on every run."""

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        raise RuntimeError("the model failed")

    def close(self) -> None:
        pass


async def _code(mv: ModelVersion) -> Code:
    try:
        await mv.infer(request(0.0), None)
    except InferError as exc:
        return exc.code  # (the error itself is not kept: pytest.raises' would be a cycle of the test's own)
    raise AssertionError("not failed")


@pytest.mark.parametrize("preserve", [False, True])
async def test_a_failed_run_leaves_no_cycle(preserve: bool, tmp_path: Path) -> None:
    config = text_format.Parse(CONFIG % ("preserve_ordering: true" if preserve else ""), mc.ModelConfig())
    mv = ModelVersion(config, 1, tmp_path, [FailingInstance()], "fake")
    try:
        assert await _code(mv) is Code.INTERNAL  # (the first run: its warm-up)
        with collector_off():
            for _ in range(3):
                assert await _code(mv) is Code.INTERNAL
            assert cyclic_frames() == []
    finally:
        await mv.close()


def test_a_failed_python_warmup_request_leaves_no_cycle(tmp_path: Path) -> None:
    """services/python/instance.py:ModelWorker.run (model_warmup's request) raises the error the
    worker answered without its frame keeping it (the error was a local the traceback held)."""
    class Answers(ModelWorker):
        async def execute(self, payloads, keys, sinks=None):  # type: ignore[no-untyped-def]
            return [InferError(Code.INVALID_ARG, "the model refused it")], 0, frozenset()

    config = text_format.Parse(CONFIG % "", mc.ModelConfig())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        spec = WorkerSpec(model_py=tmp_path / "model.py", args={}, instance="m_0", model=config.name, version="1",
                          decoupled=False, bls_target="", execute_timeout_s=5, load_timeout_s=5,
                          tensors=ModelTensors.from_config(config))
        worker = Answers(spec, loop)
        inputs = {t.name: np.zeros([1, *t.dims], np.float32) for t in config.input}
        with collector_off():
            for _ in range(3):
                try:
                    worker.run(inputs, [t.name for t in config.output])
                except InferError as exc:
                    assert exc.code is Code.INVALID_ARG
                else:
                    raise AssertionError("not failed")
            assert cyclic_frames() == []
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
