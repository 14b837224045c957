"""A request that fails in a python model (execute() raised, answered an error, a decoupled
model's in-band error) leaves no frame in a reference cycle, with real worker processes: the
futures and queues that carry its error hold it, and its traceback holds the frames it was
raised through, so none of those frames may keep it, or the request stays alive until the next
collection (tests/support/cycles.py; docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import RequestContext
from services.python.core import PythonServiceCore
from tests.integration.test_python_decoupled import request, started
from tests.models import python_models
from tests.support.cycles import collector_off, cyclic_frames

MODELS = frozenset({"faulty_raise", "faulty_error", "repeat_int32"})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return python_models.build(tmp_path_factory.mktemp("frees"), instances=1)


async def _unary(c: PythonServiceCore, model: str) -> Code:
    try:
        await c.infer(request(model, INPUT0=np.ones(python_models.WIDTH, np.float32)), RequestContext("grpc"))
    except InferError as exc:
        return exc.code  # (the error itself is not kept: pytest.raises' would be a cycle of the test's own)
    raise AssertionError("not failed")


async def _streamed(c: PythonServiceCore) -> Code:
    req = request("repeat_int32", IN=np.array([1, 2], np.int32), DELAY=np.array([1], np.uint32))  # (shapes differ)
    try:
        async for _ in c.infer_stream(req, RequestContext("grpc")):
            pass
    except InferError as exc:
        return exc.code
    raise AssertionError("not failed")


def test_failed_python_requests_leave_no_cycle(repo: Path) -> None:
    with started(repo, MODELS) as (c, loop):
        async def failures() -> list[Code]:
            return [await _unary(c, "faulty_raise"), await _unary(c, "faulty_error"), await _streamed(c)]

        first = loop.run_until_complete(failures())
        assert first == [Code.INTERNAL, Code.INVALID_ARG, Code.INTERNAL]  # (raised, answered, in band)
        with collector_off():
            for _ in range(3):
                assert loop.run_until_complete(failures()) == first
            assert cyclic_frames() == []
