"""A merged request that fails leaves no frame in a reference cycle: every member's future fails
with the one error, whose traceback holds the frame that delivered it (holding the members,
their futures and bytes) and each member's awaiting frame (tests/support/cycles.py;
docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

import asyncio

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.protocol.errors import Code, InferError
from tests.support import loop_passes
from tests.support.cycles import collector_off, cyclic_frames
from tests.unit.gateway.test_coalesce import SHAPE, Coalescer, fake_service, merge_key, request, upstream


async def test_a_failed_merged_send_leaves_no_cycle() -> None:
    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None) -> pb.ModelInferResponse:
        await loop_passes()  # in flight while the others queue up and merge
        if hop.MERGED in req.parameters:
            raise InferError(Code.UNAVAILABLE, "the merge failed")
        return fake_service(req)

    c = Coalescer(upstream(send), 1)
    assert SHAPE is not None

    async def codes() -> list[Code | None]:
        reqs = [request(np.zeros((1, 16)), np.zeros((1, 16)), f"r{i}") for i in range(3)]
        results = await asyncio.gather(*(c.submit(merge_key(r, SHAPE)[0], r, None, 1, SHAPE, None) for r in reqs),
                                       return_exceptions=True)
        return [r.code if isinstance(r, InferError) else None for r in results]

    await codes()
    with collector_off():
        for _ in range(3):
            assert await codes() == [None, Code.UNAVAILABLE, Code.UNAVAILABLE]
        assert cyclic_frames() == []
