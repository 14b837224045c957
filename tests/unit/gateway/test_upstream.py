"""gateway.upstream.upstream.Upstream.call: which failures go to another replica.

A request goes to another replica only if it never reached a model; the check looks at the
channel that carried it (for infer, the stream's connection), never at the replica's control
channel, which an infer does not use.
"""
from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from gateway.routing.table import RoutingTable, pick_pinned
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import wire
from meshserve.protocol.errors import Code, InferError
from tests.unit.gateway.support import stream_service


@pytest.fixture
async def unavailable() -> AsyncIterator[str]:
    """A service whose ModelStreamInfer answers every request: UNAVAILABLE (in band)."""

    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:
            resp = pb.ModelInferResponse(id=pb.ModelInferRequest.FromString(raw).id)
            resp.parameters[wire.ERROR_CODE_PARAMETER].string_param = Code.UNAVAILABLE.value
            yield pb.ModelStreamInferResponse(error_message="model 'm' is not ready",
                                              infer_response=resp).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        yield endpoint


def _refused() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@asynccontextmanager
async def _upstream(*endpoints: str) -> AsyncIterator[Upstream]:
    """An Upstream over ``endpoints``, each a healthy replica hosting model 'm' version 1."""
    upstream = Upstream(ReplicaPool(list(endpoints)))
    await upstream.pool.resolve()
    for r in upstream.replicas:
        r.healthy = True
    upstream.discovery.table = RoutingTable(("m", 1, r) for r in upstream.replicas)
    try:
        yield upstream
    finally:
        for r in upstream.replicas:
            await r.close()


async def _send_pinned(upstream: Upstream, endpoint: str) -> InferError:
    """Send a request whose sequence key pins it to ``endpoint`` first; the error it gets."""
    key = next(k for n in range(1000) if pick_pinned(upstream.replicas, k := f"i:{n}").endpoint == endpoint)
    with pytest.raises(InferError) as err:
        await upstream.send(pb.ModelInferRequest(model_name="m", id="r1"), None, 5, key)
    return err.value


async def test_an_answer_on_the_stream_is_not_retried_and_keeps_the_replica(unavailable: str) -> None:
    async with _upstream(unavailable, _refused()) as upstream:
        err = await _send_pinned(upstream, unavailable)
        # the service's own answer, from the replica that gave it; the other was never tried
        assert err.code is Code.UNAVAILABLE and err.message == "model 'm' is not ready"
        answered, untried = upstream.replicas
        assert answered.healthy and answered.errors == 1
        assert untried.healthy and untried.errors == 0
        # the replica's control channel was never used (not READY): it did not decide
        assert answered.channel.get_state() != grpc.ChannelConnectivity.READY


async def test_a_request_never_written_goes_to_another_replica(unavailable: str) -> None:
    refused = _refused()
    async with _upstream(refused, unavailable) as upstream:
        err = await _send_pinned(upstream, refused)
        assert err.message == "model 'm' is not ready"  # the second replica's answer
        dead, answered = upstream.replicas
        assert not dead.healthy and dead.errors == 1  # ejected: the request was never written to it
        assert answered.healthy and answered.errors == 1
