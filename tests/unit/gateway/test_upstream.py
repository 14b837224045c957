"""gateway.upstream.upstream.Upstream.call: which failures go to another replica.

A request goes to another replica only if it never reached a model; the check looks at the
channel that carried it (for infer, the stream's connection), never at the replica's control
channel, which an infer does not use.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from gateway.routing.table import RoutingTable, pick_pinned
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.protocol.errors import Code, InferError
from tests.support import eventually_async, loop_passes
from tests.support.net import refused_address
from tests.unit.gateway.support import stream_service


@pytest.fixture
async def unavailable() -> AsyncIterator[str]:
    """A service whose ModelStreamInfer answers every request: UNAVAILABLE (in band)."""

    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:
            resp = pb.ModelInferResponse(id=pb.ModelInferRequest.FromString(raw).id)
            resp.parameters[hop.ERROR_CODE].string_param = Code.UNAVAILABLE.value
            yield pb.ModelStreamInferResponse(error_message="model 'm' is not ready",
                                              infer_response=resp).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        yield endpoint


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
    async with _upstream(unavailable, refused_address()) as upstream:
        err = await _send_pinned(upstream, unavailable)
        # the service's own answer, from the replica that gave it; the other was never tried
        assert err.code is Code.UNAVAILABLE and err.message == "model 'm' is not ready"
        answered, untried = upstream.replicas
        assert answered.healthy and answered.errors == 1
        assert untried.healthy and untried.errors == 0
        # the replica's control channel was never used (not READY): it did not decide
        assert answered.channel.get_state() != grpc.ChannelConnectivity.READY


async def test_a_request_never_written_goes_to_another_replica(unavailable: str) -> None:
    refused = refused_address()
    async with _upstream(refused, unavailable) as upstream:
        err = await _send_pinned(upstream, refused)
        assert err.message == "model 'm' is not ready"  # the second replica's answer
        dead, answered = upstream.replicas
        assert not dead.healthy and dead.errors == 1  # ejected: the request was never written to it
        assert answered.healthy and answered.errors == 1


@asynccontextmanager
async def _answering(tag: str) -> AsyncIterator[str]:
    """A service whose ModelStreamInfer answers every request, its model_name set to ``tag``."""

    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:
            resp = pb.ModelInferResponse(id=pb.ModelInferRequest.FromString(raw).id, model_name=tag)
            yield pb.ModelStreamInferResponse(infer_response=resp).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        yield endpoint


async def test_a_connect_begun_before_the_replica_rejoined_does_not_eject_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica left the pool and came back (a new process on the same port) while a stream to
    it was still connecting. That connect then fails (the old process died after the TCP
    handshake): its requests go to another replica, but the failure is not the new process's,
    so the replica stays in the pool, and requests sent after it came back never joined that
    stream (the fresh-clone CI flake of test_killed_replica_fails_fast_then_pool_heals)."""
    from meshserve.server.h2 import client

    real_connect = client.connect
    old_process_dies = asyncio.Event()
    connects = 0

    async def connect(endpoint: str, timeout: float = 5.0) -> client.H2ClientConnection:
        nonlocal connects
        connects += 1
        if connects == 1:  # the first connect reaches the old process, which dies before its SETTINGS
            await old_process_dies.wait()
            raise ConnectionError(f"{endpoint} closed the connection before its HTTP/2 SETTINGS")
        return await real_connect(endpoint, timeout)

    monkeypatch.setattr(client, "connect", connect)
    async with _answering("a") as a_endpoint, _answering("b") as b_endpoint, \
            _upstream(a_endpoint, b_endpoint) as upstream:
        a = upstream.replicas[0]
        key = next(k for n in range(1000) if pick_pinned(upstream.replicas, k := f"i:{n}") is a)
        before = asyncio.ensure_future(upstream.send(pb.ModelInferRequest(model_name="m", id="r1"), None, 5, key))
        await eventually_async(lambda: connects == 1, what="r1 waits on a's stream, whose connect hangs")
        assert not before.done()
        a.set_healthy(False)  # the health watch: a left the pool ...
        assert a.set_healthy(True)  # ... and came back
        after = asyncio.ensure_future(upstream.send(pb.ModelInferRequest(model_name="m", id="r2"), None, 5, key))
        await loop_passes()  # r2 reaches a new stream to a (no I/O on the way)
        old_process_dies.set()
        first, second = await asyncio.wait_for(asyncio.gather(before, after), 5)
        assert first.model_name == "b"  # never sent to a: it went to the other replica
        assert second.model_name == "a" and second.id == "r2"  # on a new stream to the process that came back
        assert a.healthy, "a failure of the old connect ejected the replica that came back"
