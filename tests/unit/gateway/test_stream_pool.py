"""gateway.upstream.stream.StreamPool against an H2GrpcServer on 127.0.0.1 port 0.

The pool's first requests go out while its connection is still opening; they must reach the
service in the order they were handed to the pool (a sequence's START ... END sent back to
back), and requests that come in once the connection is up must not overtake them.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.upstream.stream import NotSent, StreamPool
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from tests.support.net import refused_address
from tests.unit.gateway.support import stream_service


def _request(i: int) -> bytes:
    return pb.ModelInferRequest(model_name=f"m{i}", id=f"client-{i}").SerializeToString()


@pytest.fixture
async def service() -> AsyncIterator[tuple[str, list[str]]]:
    """A ModelStreamInfer that answers every request at once and records the arrival order."""
    seen: list[str] = []

    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:
            req = pb.ModelInferRequest.FromString(raw)
            seen.append(req.model_name)
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(
                id=req.id, model_name=req.model_name)).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        yield endpoint, seen


async def test_requests_keep_their_order_across_the_first_connect(service: tuple[str, list[str]]) -> None:
    endpoint, seen = service
    pool = StreamPool(endpoint)
    try:
        calls = []
        for i in range(60):  # one per loop turn: some while connecting, some once connected
            calls.append(asyncio.ensure_future(pool.infer(_request(i), f"client-{i}", 10, affinity="1001")))
            await asyncio.sleep(0)
        responses = await asyncio.gather(*calls)
    finally:
        await pool.close()
    assert [r.id for r in responses] == [f"client-{i}" for i in range(60)]  # the client's ids restored
    assert seen == [f"m{i}" for i in range(60)]


async def test_a_refused_connect_fails_the_waiting_requests_as_not_sent() -> None:
    address = refused_address()
    pool = StreamPool(address)
    try:
        calls = [asyncio.ensure_future(pool.infer(_request(i), f"client-{i}", 10)) for i in range(3)]
        for call in calls:
            with pytest.raises(NotSent, match=f"service {address}: cannot connect: .+"):
                await call
    finally:
        await pool.close()


async def test_requests_fail_at_their_own_deadlines() -> None:
    """One timer per stream fails each request at its own deadline (a later request with a
    shorter timeout first); an answered request's deadline is forgotten."""
    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:  # answers only "answer", and never the others
            req = pb.ModelInferRequest.FromString(raw)
            if req.model_name == "answer":
                yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(
                    id=req.id, model_name=req.model_name)).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        pool = StreamPool(endpoint, streams=1)
        loop = asyncio.get_running_loop()
        ended: dict[str, float] = {}

        async def infer(name: str, timeout: float) -> None:
            raw = pb.ModelInferRequest(model_name=name, id=name).SerializeToString()
            try:
                with pytest.raises(InferError) as info:
                    await pool.infer(raw, name, timeout)
                assert info.value.code is Code.DEADLINE_EXCEEDED
                assert info.value.message == f"deadline exceeded waiting for service {endpoint}"
            finally:
                ended[name] = loop.time() - t0

        try:
            t0 = loop.time()
            assert (await pool.infer(pb.ModelInferRequest(model_name="answer", id="a").SerializeToString(),
                                     "a", 3.0)).id == "a"  # its 3 s deadline stays set, unused
            await asyncio.gather(infer("long", 1.5), infer("short", 0.3))
        finally:
            await pool.close()
    assert 0.25 < ended["short"] < 1.2, ended
    assert 1.45 < ended["long"] < 2.9, ended
