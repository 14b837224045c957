"""A request the gateway sends again (it was never written: NotSent) carries its inputs.

The two ways a forwarded request is sent a second time after a replica failed it before it was
written: ``Upstream.infer``'s loop (a client's bytes) and ``Upstream._finish`` (a merged request
the coalescer's flush wrote through ``Upstream.start``). Both resend the bytes they first wrote
(immutable ``bytes``): the service gets every input of every member. (The case of
docs/perf/side-by-side-round-3.md, "What remains", whose cause was the load generator's.)
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from gateway.routing.table import RoutingTable
from gateway.upstream import upstream as upstream_module
from gateway.upstream.merging import merge
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from tests.support.net import refused_address
from tests.unit.gateway.support import stream_service


def _request(value: float, rid: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m", id=rid)
    for name in ("INPUT0", "INPUT1"):
        r.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        r.raw_input_contents.append(np.full((1, 4), value, np.float32).tobytes())
    return r


def _tensors(r: pb.ModelInferRequest) -> list[tuple[str, list[int], bytes]]:
    return [(t.name, list(t.shape), raw) for t, raw in zip(r.inputs, r.raw_input_contents, strict=True)]


@pytest.fixture
async def recording() -> AsyncIterator[tuple[str, list[pb.ModelInferRequest]]]:
    """A service whose ModelStreamInfer answers every request (its id) and keeps what it got."""
    got: list[pb.ModelInferRequest] = []

    async def stream_infer(requests: AsyncIterator[bytes], ctx: object) -> AsyncIterator[bytes]:
        async for raw in requests:
            request = pb.ModelInferRequest.FromString(raw)
            got.append(request)
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id)).SerializeToString()

    async with stream_service(stream_infer) as endpoint:
        yield endpoint, got


async def _two_replicas(dead: str, alive: str, monkeypatch: pytest.MonkeyPatch) -> Upstream:
    """An Upstream over ``dead`` (refuses connections) and ``alive``; the first pick is ``dead``."""
    upstream = Upstream(ReplicaPool([dead, alive]))
    await upstream.pool.resolve()
    for r in upstream.replicas:
        r.healthy = True
    upstream.discovery.table = RoutingTable(("m", 1, r) for r in upstream.replicas)
    first = upstream.replicas[0]
    picks = [0]

    def pick(replicas: list[Any]) -> Any:
        picks[0] += 1
        return first if picks[0] == 1 else next(r for r in replicas if r is not first)

    monkeypatch.setattr(upstream_module, "pick", pick)
    return upstream


async def test_a_client_request_sent_again_keeps_its_inputs(
        recording: tuple[str, list[pb.ModelInferRequest]], monkeypatch: pytest.MonkeyPatch) -> None:
    alive, got = recording
    upstream = await _two_replicas(refused_address(), alive, monkeypatch)
    try:
        request = _request(3.0, "c1")
        raw = request.SerializeToString()
        answer = await upstream.send(request, raw, 5)
        assert answer.id == "c1"
        assert not upstream.replicas[0].healthy  # the refused one was tried first, and ejected
        (sent,) = got
        assert _tensors(sent) == _tensors(request)
    finally:
        for r in upstream.replicas:
            await r.close()


async def test_a_merged_request_sent_again_keeps_every_member_s_inputs(
        recording: tuple[str, list[pb.ModelInferRequest]], monkeypatch: pytest.MonkeyPatch) -> None:
    alive, got = recording
    upstream = await _two_replicas(refused_address(), alive, monkeypatch)
    try:
        members = [_request(float(i), f"r{i}") for i in range(3)]
        merged = merge(members, [1, 1, 1])
        written = upstream.start(merged, merged.SerializeToString(), 5)  # (the coalescer's flush)
        assert written is not None
        answer = await written
        assert not upstream.replicas[0].healthy  # written to the refused replica's stream first
        (sent,) = got
        assert [t[:2] for t in _tensors(sent)] == [("INPUT0", [3, 4]), ("INPUT1", [3, 4])]
        for i, (_, _, raw) in enumerate(_tensors(sent)):
            assert raw == b"".join(m.raw_input_contents[i] for m in members)
        assert answer is not None
    finally:
        for r in upstream.replicas:
            await r.close()
