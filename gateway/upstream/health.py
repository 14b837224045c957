"""grpc.health.v1 Watch per replica: a replica leaves the pool the moment its service says
NOT_SERVING or the watch stream breaks (the process died), and comes back when it says SERVING."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from meshserve._proto import health_pb2

log = logging.getLogger("meshserve.gateway.health")

_WATCH = "/grpc.health.v1.Health/Watch"
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


class HealthWatch:
    """Keeps one Watch(service="") call open to a replica; reports SERVING / not SERVING changes."""

    def __init__(self, channel: grpc.aio.Channel, endpoint: str, on_change: Callable[[bool], None]):
        self.endpoint = endpoint
        self._watch = channel.unary_stream(_WATCH, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                           response_deserializer=health_pb2.HealthCheckResponse.FromString)
        self._on_change = on_change
        self.serving: bool | None = None  # None until the first answer
        self.supported = True
        self._task = asyncio.ensure_future(self._run())

    def _report(self, serving: bool) -> None:
        if serving != self.serving:
            self.serving = serving
            self._on_change(serving)

    async def _run(self) -> None:
        delay = RETRY_MIN_S
        while True:
            call = self._watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for resp in call:
                    delay = RETRY_MIN_S
                    self._report(resp.status == health_pb2.HealthCheckResponse.SERVING)
                # A clean end (a proxy's stream timeout, say) is no verdict: watch again; a dead
                # server fails the next Watch and is reported then.
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("replica %s has no grpc.health.v1 Watch; relying on probes", self.endpoint)
                    self.supported = False
                    return
                self._report(False)
            except asyncio.CancelledError:
                call.cancel()
                raise
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    async def stop(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # stopping, nothing to report
            pass
