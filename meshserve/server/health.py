"""grpc.health.v1 Health service (Check + Watch) backed by a small status table."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from meshserve._proto import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthState:
    """Serving status per service name ("" = the whole server), with change notification."""

    def __init__(self) -> None:
        self._status: dict[str, Any] = {"": NOT_SERVING}
        self._changed = asyncio.Event()

    def set(self, service: str, status: Any) -> None:
        if self._status.get(service) != status:
            self._status[service] = status
            self._changed.set()
            self._changed = asyncio.Event()

    def get(self, service: str) -> Any:
        return self._status.get(service, SERVICE_UNKNOWN)

    async def wait_change(self) -> None:
        await self._changed.wait()


def health_handler(state: HealthState) -> grpc.GenericRpcHandler:
    async def check(request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        status = state.get(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    async def watch(request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = state.get(request.service)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await state.wait_change()

    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString),
    })
