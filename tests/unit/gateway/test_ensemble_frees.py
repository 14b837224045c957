"""An ensemble request whose step fails leaves no frame in a reference cycle: the failed step's
task (or the event that carries its error) holds the error, whose traceback holds the frames it
was raised through, holding the request and its steps' tensors (tests/support/cycles.py;
docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

import numpy as np

from gateway.ensemble.executor import EnsembleExecutor
from gateway.ensemble.plan import compile_plan
from meshserve.protocol.errors import Code, InferError
from tests.support.cycles import collector_off, cyclic_frames
from tests.unit.gateway import test_ensemble, test_ensemble_decoupled


class _Fresh(dict[str, InferError]):
    """A step's failure: a new error each time (one kept here would keep its frames reachable)."""

    def __getitem__(self, model: str) -> InferError:
        return InferError(Code.RESOURCE_EXHAUSTED, "queue full")


async def _unary() -> Code:
    upstream, _ = test_ensemble.fake_upstream(0.0, fail=_Fresh(triple=InferError(Code.UNKNOWN, "")))
    plan = compile_plan(test_ensemble.ensemble(), test_ensemble.lookup)
    try:
        await EnsembleExecutor(upstream).run(plan, test_ensemble.request(np.ones((1, 4))), timeout=5)
    except InferError as exc:
        return exc.code  # (the error itself is not kept: pytest.raises' would be a cycle of the test's own)
    raise AssertionError("not failed")


async def _streamed() -> Code:
    try:
        await test_ensemble_decoupled._run(test_ensemble_decoupled.FakeUpstream(fail_on=3), [1, 2, 3, 4])
    except InferError as exc:
        return exc.code
    raise AssertionError("not failed")


async def test_a_failed_step_leaves_no_cycle() -> None:
    with collector_off():
        for _ in range(3):
            assert await _unary() is Code.RESOURCE_EXHAUSTED
            assert await _streamed() is Code.INVALID_ARG
        assert cyclic_frames() == []
