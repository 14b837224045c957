"""A sequence's requests leave the gateway in the order they arrived, whatever they wait on
inside it (tenant admission in Redis, a discovery refresh): gateway/turns.py and its
use in GatewayCore.infer."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.core import GatewayCore
from gateway.turns import SequenceTurns
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server.core import InferResult, RequestContext
from tests.support import loop_passes


class _Steps:
    """Requests' calls: each records its name in ``order`` when it runs, after ``gate`` if
    given, then returns it (or raises ``error``)."""

    def __init__(self) -> None:
        self.order: list[str] = []

    async def __call__(self, name: str, gate: asyncio.Event | None = None, error: Exception | None = None) -> str:
        if gate is not None:
            await gate.wait()
        self.order.append(name)
        if error is not None:
            raise error
        return name


async def test_a_slow_first_request_is_not_overtaken() -> None:
    turns, step, slow = SequenceTurns(), _Steps(), asyncio.Event()
    results = asyncio.gather(turns.run("s", lambda: step("start", slow)), turns.run("s", lambda: step("mid")),
                             turns.run("s", lambda: step("end")))
    await loop_passes()
    assert step.order == []  # mid and end, ready at once, wait for the slow start
    slow.set()
    assert await results == ["start", "mid", "end"] and step.order == ["start", "mid", "end"]
    assert len(turns) == 0  # nothing kept once the sequence's requests are done


async def test_other_sequences_do_not_wait() -> None:
    turns, step, release = SequenceTurns(), _Steps(), asyncio.Event()
    first = asyncio.ensure_future(turns.run("a", lambda: step("a1", release)))
    await asyncio.sleep(0)
    await asyncio.wait_for(turns.run("b", lambda: step("b1")), 1)  # a's pending turn does not hold b
    release.set()
    await first
    assert step.order == ["b1", "a1"]


async def test_an_error_or_a_cancelled_waiter_keeps_the_order() -> None:
    turns, step, release = SequenceTurns(), _Steps(), asyncio.Event()
    one = asyncio.ensure_future(turns.run("s", lambda: step("1", release, RuntimeError("request 1 failed"))))
    await asyncio.sleep(0)
    two = asyncio.ensure_future(turns.run("s", lambda: step("2")))  # its client goes away while it waits
    three = asyncio.ensure_future(turns.run("s", lambda: step("3")))
    await loop_passes()
    two.cancel()
    await loop_passes()
    assert step.order == [] and not three.done()  # 3 still waits for 1, although 2 is gone
    release.set()
    with pytest.raises(RuntimeError):
        await one
    await three
    assert step.order == ["1", "3"] and two.cancelled()
    assert len(turns) == 0


class _SlowFirstAdmission:
    """Tenant admission whose first call takes longest (a slow Redis round trip), counted in
    event-loop passes: the order in which the calls finish is fixed, whatever the machine's speed."""

    def __init__(self) -> None:
        self.passes = [20, 0, 10]

    async def admit(self, request: pb.ModelInferRequest, ctx: RequestContext, *sequence: Any) -> Any:
        await loop_passes(self.passes.pop(0))
        return None

    async def release(self, admitted: Any) -> None:
        return None


def _request(sequence_id: int, flags: str) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="acc", id=flags)
    req.parameters["sequence_id"].int64_param = sequence_id
    return req


async def test_gateway_forwards_a_sequence_in_arrival_order_despite_admission_delays() -> None:
    core = GatewayCore(["127.0.0.1:1"], admission=_SlowFirstAdmission())  # type: ignore[arg-type]
    sent: list[str] = []

    async def dispatch(request: pb.ModelInferRequest, ctx: RequestContext, affinity: str | None) -> InferResult:
        sent.append(request.id)
        return InferResult(message=pb.ModelInferResponse(id=request.id))

    core.forward.infer = dispatch  # type: ignore[method-assign]  # the upstream half is not under test here
    ctx = RequestContext("grpc", {})
    out = await asyncio.gather(*(core.infer(_request(7, flags), ctx) for flags in ("start", "mid", "end")))
    assert sent == ["start", "mid", "end"]
    assert [r.message().id for r in out] == ["start", "mid", "end"]
    # without a sequence id nothing is held: the fast admission overtakes the slow one
    core = GatewayCore(["127.0.0.1:1"], admission=_SlowFirstAdmission())  # type: ignore[arg-type]
    core.forward.infer = dispatch  # type: ignore[method-assign]
    sent.clear()
    await asyncio.gather(*(core.infer(pb.ModelInferRequest(model_name="acc", id=i), ctx) for i in ("a", "b", "c")))
    assert sent == ["b", "c", "a"]
