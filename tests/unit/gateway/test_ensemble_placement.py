"""An ensemble's steps in the model mesh (docs/model-mesh.md, "Ensembles over lazy models"): the
executor places a managed step's model through Placement.ready before sending it, sends it
again through Placement.resend when its replica evicted the model meanwhile, and names a failed
load after the step. A Placement whose loads are recorded (no sockets); the diamond ensemble and
fake upstream of test_ensemble.py."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gateway.ensemble.executor import EnsembleExecutor
from gateway.ensemble.plan import compile_plan
from gateway.placement import EVICTED, Placement, Policy
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from tests.unit.gateway.test_ensemble import ensemble, fake_upstream, lookup, request


class RecordedPlacement(Placement):
    """Loads recorded instead of sent; a model is served once "loaded"."""

    def __init__(self, policy: Policy, fail: InferError | None = None) -> None:
        super().__init__(SimpleNamespace(discovery=None), policy)  # type: ignore[arg-type]
        self.served: set[str] = set()
        self.ensured: list[tuple[str, bool]] = []
        self.fail = fail

    def serving(self, name: str, version: str) -> bool:
        return name in self.served

    async def ensure(self, name: str, timeout: float | None, stale: bool = False) -> None:
        self.ensured.append((name, stale))
        if self.fail is not None:
            raise self.fail
        self.served.add(name)


def _y(resp: pb.ModelInferResponse) -> np.ndarray:
    return next(np.frombuffer(raw, np.float32) for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)
                if o.name == "Y")


async def test_cold_steps_are_placed_before_they_are_sent_and_an_evicted_one_again() -> None:
    upstream, calls = fake_upstream(0.0)
    evicted_once = {"triple"}
    send = upstream.send

    async def evicting(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                       affinity: str | None = None) -> pb.ModelInferResponse:
        if req.model_name in evicted_once:  # its replica unloaded it after the table was read
            evicted_once.discard(req.model_name)
            placement.served.discard(req.model_name)
            raise InferError(Code.NOT_FOUND, f"{EVICTED} '{req.model_name}'")
        return await send(req, raw, timeout, affinity)

    executor = EnsembleExecutor(SimpleNamespace(send=evicting))  # type: ignore[arg-type]
    placement = executor.placement = RecordedPlacement(Policy(lazy_models=frozenset({"double", "triple"})))
    placement.served.add("add")  # (not managed: never placed)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    resp = await executor.run(compile_plan(ensemble(), lookup), request(x), timeout=5)
    np.testing.assert_array_equal(_y(resp), (x * 5).ravel())
    assert sorted(placement.ensured) == [("double", False), ("triple", False), ("triple", True)]
    assert [m for m, _, _ in calls].count("triple") == 1  # sent again once after its placement
    placement.ensured.clear()
    await executor.run(compile_plan(ensemble(), lookup), request(x), timeout=5)
    assert placement.ensured == []  # served now: nothing placed


async def test_a_failed_load_answers_with_its_reason_named_after_the_step() -> None:
    upstream, calls = fake_upstream(0.0)
    executor = EnsembleExecutor(upstream)
    reason = InferError(Code.INVALID_ARG, "failed to load 'double': 1/model.onnx: cannot read ONNX model")
    executor.placement = RecordedPlacement(Policy(lazy_all=True), fail=reason)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    try:
        await executor.run(compile_plan(ensemble(), lookup), request(x), timeout=5)
    except InferError as exc:
        err = exc
    else:
        raise AssertionError("the ensemble answered without its step's model")
    assert err.code is Code.INVALID_ARG
    assert err.message.startswith("ensemble 'diamond' step ") and reason.message in err.message, err.message
    assert not calls  # no step was sent to a replica that does not hold its model
