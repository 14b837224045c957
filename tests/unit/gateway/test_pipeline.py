"""The gateway's infer path as stages (gateway/pipeline.py): the order ``assemble`` builds, a
flag that is off leaves its stage out, and every request that passed the name check is counted
exactly once, whichever stage ends it, on the unary and the streamed path."""
from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from gateway import pipeline
from gateway.core import GatewayCore
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import InferResult, RequestContext


def _chain(head: pipeline.Names) -> list[str]:
    out: list[str] = []
    stage: Any = head
    while stage is not None:
        out.append(type(stage).__name__)
        stage = getattr(stage, "next", None)
    return out


def test_the_chain_has_a_stage_only_for_the_policies_that_are_on() -> None:
    core = GatewayCore(["127.0.0.1:1"])
    assert _chain(core.pipeline) == ["Names", "Outcomes", "Turns", "Forward"]
    every = pipeline.assemble(core.request_counts, core.turns, core.forward, core.is_decoupled, core.is_decoupled,
                              admission=object(), routes=object(), ensembles=object())  # type: ignore[arg-type]
    assert _chain(every) == ["Names", "Outcomes", "Turns", "Admit", "ABRoutes", "Ensembles", "Forward"]


class _Router:
    """An ABRouter with one route, ``r``, whose one arm ``a`` points at model ``m``."""

    def __init__(self) -> None:
        self.route = SimpleNamespace(name="r", targets=[SimpleNamespace(name="a", model="m", version="")])
        self.arm_counts: Counter[tuple[str, str, str]] = Counter()

    def lookup(self, name: str) -> Any:
        return self.route if name == "r" else None

    def choose(self, route: Any, request: pb.ModelInferRequest, ctx: RequestContext, sequence: Any) -> Any:
        request.model_name = "m"
        return route.targets[0]

    def failed(self, route: Any, target: Any, exc: InferError) -> None:
        self.arm_counts[(route.name, target.name, exc.code.value)] += 1

    def answered(self, route: Any, target: Any, result: InferResult) -> InferResult:
        return result

    @staticmethod
    def marked(target: Any, response: pb.ModelInferResponse) -> pb.ModelInferResponse:
        return response


def _routed_core(fail: bool) -> GatewayCore:
    core = GatewayCore(["127.0.0.1:1"])

    async def forward(request: pb.ModelInferRequest, ctx: RequestContext, sequence: Any) -> InferResult:
        if fail:
            raise InferError.unavailable("no replica")
        return InferResult(message=pb.ModelInferResponse(model_name=request.model_name))

    core.forward.infer = forward  # type: ignore[method-assign]  # the service is not under test here
    router: Any = _Router()
    core.pipeline = pipeline.assemble(core.request_counts, core.turns, core.forward, lambda n, v: n == "r",
                                      lambda n, v: False, routes=router)
    return core


@pytest.mark.parametrize("fail", [False, True])
async def test_a_request_is_counted_once_under_the_model_it_went_to(fail: bool) -> None:
    core = _routed_core(fail)
    ctx = RequestContext("grpc", {})
    outcome = "UNAVAILABLE" if fail else "OK"
    for _ in range(2):  # unary, then a streaming call (the route has a decoupled target: the streamed path)
        core.request_counts.clear()
        try:
            if _ == 0:
                await core.infer(pb.ModelInferRequest(model_name="r"), ctx)
            else:
                answers: AsyncGenerator[Any, None] = core.infer_stream(pb.ModelInferRequest(model_name="r"), ctx)
                assert [final async for _, final in answers] == [True]
        except InferError as exc:
            assert fail and exc.code is Code.UNAVAILABLE
        assert dict(core.request_counts) == {("m", outcome): 1}


async def test_a_refused_name_is_neither_routed_nor_counted() -> None:
    core = _routed_core(False)
    with pytest.raises(InferError) as caught:
        await core.infer(pb.ModelInferRequest(model_name="../etc"), RequestContext("grpc", {}))
    assert caught.value.code is Code.INVALID_ARG
    request = pb.ModelInferRequest(model_name="r")
    request.parameters["meshserve_merged_requests"].int64_param = 4
    with pytest.raises(InferError):
        await core.infer(request, RequestContext("grpc", {}))
    assert not core.request_counts
