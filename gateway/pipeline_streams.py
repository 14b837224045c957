"""The streamed paths of the pipeline's stages (gateway/pipeline.py), as async generators, and
``Admit.infer``'s coroutine.

mypyc does not compile async generators ("async generators are unimplemented"), and a compiled
coroutine that awaits in a ``finally`` can leave the error of its cancellation behind (a mypyc
bug: docs/perf/native.md), so these bodies live here, always interpreted, and each stage's method
(a plain one) returns one of them: gateway/pipeline.py can then be compiled with the same
behaviour in pure Python. Each function is the stage's former ``async def``, ``stage`` its ``self``.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from meshserve.protocol.errors import InferError
from meshserve.server.core import InferResult, RequestContext

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Coroutine

    from gateway.pipeline import ABRoutes, Admit, Answers, Names, Outcomes, Place, Turns
    from gateway.routing.ab import Route
    from meshserve._proto import grpc_service_pb2 as pb
    from meshserve.server.core import StreamAnswer


async def names(stage: Names, request: pb.ModelInferRequest, ctx: RequestContext
                ) -> AsyncGenerator[StreamAnswer, None]:
    name, version, params = stage.check(request)
    if not stage._decoupled(name, version):
        yield await stage.next.infer(request, ctx, name, version, params), True
        return
    async with aclosing(stage.next.stream(request, ctx)) as answers:
        async for answer in answers:
            yield answer


async def outcomes(stage: Outcomes, request: pb.ModelInferRequest, ctx: RequestContext
                   ) -> AsyncGenerator[StreamAnswer, None]:
    try:
        async with aclosing(stage.next.stream(request, ctx, None)) as answers:
            async for response, final in answers:
                yield (None if response is None else InferResult(message=response)), final
    except InferError as exc:
        raise stage.failed(request.model_name, exc, ctx.protocol) from None
    stage.counts[(request.model_name, "OK")] += 1


async def turn(stage: Turns, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str) -> Answers:
    """The sequence's next request waits for this one's last answer."""
    async with stage.turns.turn((request.model_name, sequence)), \
            aclosing(stage.next.stream(request, ctx, sequence)) as answers:
        async for answer in answers:
            yield answer


async def admitted_infer(stage: Admit, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
                         ) -> InferResult:
    admitted = await stage._admit(request, ctx, sequence)
    try:
        return await stage.next.infer(request, ctx, sequence)
    finally:
        await stage.admission.release(admitted)


async def admitted(stage: Admit, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
                   ) -> Answers:
    idle_s = stage._sequence_idle_s(request) if sequence is not None else 0.0
    admitted = await stage.admission.admit(request, ctx, sequence, idle_s)
    try:
        async with aclosing(stage.next.stream(request, ctx, sequence)) as answers:
            async for answer in answers:
                yield answer
    finally:
        await stage.admission.release(admitted)


async def routed(stage: ABRoutes, route: Route, request: pb.ModelInferRequest, ctx: RequestContext,
                 sequence: str | None) -> Answers:
    target = stage.routes.choose(route, request, ctx, sequence)
    try:
        if not stage._target_decoupled(request.model_name, request.model_version):
            answers: Answers = once(stage.next.infer(request, ctx, sequence))
        else:
            answers = stage.next.stream(request, ctx, sequence)
        async with aclosing(answers):
            async for response, final in answers:
                yield (None if response is None else stage.routes.marked(target, response)), final
    except InferError as exc:
        stage.routes.failed(route, target, exc)
        raise
    stage.routes.arm_counts[(route.name, target.name, "OK")] += 1


async def placed(stage: Place, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None
                 ) -> Answers:
    await stage.placement.ready(request.model_name, request.model_version, ctx.time_remaining())
    async with aclosing(stage.next.stream(request, ctx, sequence)) as answers:
        async for answer in answers:
            yield answer


async def once(answer: Coroutine[Any, Any, InferResult]) -> Answers:
    yield (await answer).message(), True
