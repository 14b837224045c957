"""grpc.health.v1 Health service (Check + Watch) backed by a small status table."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from meshserve._proto import health_pb2
from meshserve.server.h2.call import Call, Status

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthState:
    """Serving status per service name ("" = the whole server), with change notification."""

    def __init__(self) -> None:
        self._status: dict[str, Any] = {"": NOT_SERVING}
        self._changed = asyncio.Event()
        self.closed = False  # draining: every service NOT_SERVING for good, and watches end

    def set(self, service: str, status: Any) -> None:
        if self.closed:
            return
        if self._status.get(service) != status:
            self._status[service] = status
            self._changed.set()
            self._changed = asyncio.Event()

    def close(self) -> None:
        """The process drains: every service NOT_SERVING from now on (as grpc's own servicer's
        ``enter_graceful_shutdown``), and each Watch call ends once it has said so, so that an
        open watch (a gateway's) does not hold the drain for its whole grace."""
        for service in self._status:
            self._status[service] = NOT_SERVING
        self.closed = True
        self._changed.set()

    def get(self, service: str) -> Any:
        return self._status.get(service, SERVICE_UNKNOWN)

    async def wait_change(self) -> None:
        await self._changed.wait()


class HealthServicer:
    """grpc.health.v1.Health over a HealthState (access.HEALTH_METHODS: both open)."""

    def __init__(self, state: HealthState) -> None:
        self.state = state

    async def Check(self, request: health_pb2.HealthCheckRequest, call: Call) -> health_pb2.HealthCheckResponse:
        status = self.state.get(request.service)
        if status == SERVICE_UNKNOWN:
            await call.abort(Status.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, call: Call
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.state.get(request.service)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            if self.state.closed:  # (its last word said: the call ends, OK)
                return
            await self.state.wait_change()
