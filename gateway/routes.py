"""A/B routes at request time: pick the arm (routing/ab.py) and point the request at its target
(the core forwards it), mark the answer with the arm, mirror a share to the shadow target (through
the Upstream) without ever delaying or failing the reply."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from gateway.routing.ab import Route, Routes, parse_routes
from gateway.watched import WatchedFile
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError
from meshserve.protocol.wire import ROUTE_ARM_PARAMETER
from meshserve.server.core import InferResult, RequestContext
from meshserve.telemetry import tracing

if TYPE_CHECKING:
    from gateway.routing.routes_file import Target
    from gateway.upstream.upstream import Upstream

log = logging.getLogger("meshserve.gateway.routes")

MAX_SHADOWS_IN_FLIGHT = 64  # beyond this, shadow copies are dropped (and counted), never queued

class ABRouter:
    """routes.yaml (reloaded when it changes), the arm choice per request, shadow copies, and
    per-arm and shadow counters for /metrics. A routed request goes: ``choose`` (rewrites the
    request to the chosen target), the target's own dispatch by the core, then ``answered``
    or ``failed``."""

    def __init__(self, path: str | Path):
        self.file = WatchedFile(path, lambda text, source: Routes(parse_routes(text, source)))
        self.arm_counts: Counter[tuple[str, str, str]] = Counter()  # (route, arm, outcome)
        self.shadow_counts: Counter[tuple[str, str, str]] = Counter()  # (route, model, outcome)
        self._shadows: set[asyncio.Task[None]] = set()
        self._upstream: Upstream | None = None
        self._decoupled: Callable[[str, str], bool] = lambda model, version: False

    def lookup(self, name: str) -> Route | None:
        return self.file.get().get(name)

    def choose(self, route: Route, request: pb.ModelInferRequest, ctx: RequestContext,
               affinity: str | None = None) -> Target:
        """Pick the arm, start the shadow copy if one is due, and point ``request`` at the arm's
        target (``affinity``: the request's sequence key, for the shadow copy)."""
        if request.model_version:
            raise InferError.invalid(f"route '{route.name}' chooses the model version; "
                                     f"call it without one (got version {request.model_version})")
        choice = route.choose(ctx.headers, random.random(), random.random())
        target = choice.target
        if tracing.enabled and (span := tracing.current_var.get()) is not None:
            # the route decision: gateway.route (gateway/upstream/traced.py) copies these
            span.attributes.update({"meshserve.route": route.name, "meshserve.arm": target.name})
        if choice.shadow is not None:
            self._mirror(route.name, choice.shadow.model, choice.shadow.version, request, ctx, affinity)
        request.model_name = target.model
        request.model_version = target.version
        ctx.raw = None  # the forwarded bytes must name the target
        return target

    def failed(self, route: Route, target: Target, exc: InferError) -> None:
        self.arm_counts[(route.name, target.name, exc.code.value)] += 1

    def answered(self, route: Route, target: Target, result: InferResult) -> InferResult:
        """The target's answer, marked with the arm that gave it."""
        self.arm_counts[(route.name, target.name, "OK")] += 1
        return InferResult(message=self.marked(target, result.message()))

    @staticmethod
    def marked(target: Target, response: pb.ModelInferResponse) -> pb.ModelInferResponse:
        """A response of ``target`` (one of a streamed request's too) marked with its arm."""
        response.parameters[ROUTE_ARM_PARAMETER].string_param = target.name
        return response

    def _mirror(self, route: str, model: str, version: str, request: pb.ModelInferRequest,
                ctx: RequestContext, affinity: str | None) -> None:
        if len(self._shadows) >= MAX_SHADOWS_IN_FLIGHT:
            self.shadow_counts[(route, model, "DROPPED")] += 1
            return
        copy = pb.ModelInferRequest()
        copy.CopyFrom(request)
        copy.model_name = model
        copy.model_version = version
        task = asyncio.ensure_future(self._shadow(route, copy, ctx.time_remaining(), affinity))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(self, route: str, request: pb.ModelInferRequest, timeout: float | None,
                      affinity: str | None) -> None:
        outcome = "OK"
        try:
            assert self._upstream is not None, "ABRouter.bind() was not called"
            if self._decoupled(request.model_name, request.model_version):  # every answer read, then dropped
                answers = cast(AsyncGenerator[object, None], self._upstream.stream(request, None, timeout, affinity))
                async with contextlib.aclosing(answers):
                    async for _ in answers:
                        pass
            else:
                await self._upstream.send(request, None, timeout, affinity)
        except InferError as exc:
            outcome = exc.code.value
        except Exception as exc:  # a shadow never fails anything; count and move on
            log.debug("shadow request for route %s failed: %s", route, exc)
            outcome = "UNKNOWN"
        self.shadow_counts[(route, request.model_name, outcome)] += 1

    def bind(self, upstream: Upstream, decoupled: Callable[[str, str], bool] | None = None) -> None:
        """Where shadow copies go (the gateway's Upstream), and whether a target is decoupled
        (its copy is then a streamed request)."""
        self._upstream = upstream
        if decoupled is not None:
            self._decoupled = decoupled

    async def stop(self) -> None:
        for task in list(self._shadows):
            task.cancel()
