"""Answers: the gateway's side of one streamed request on a hop stream (gateway/upstream/stream.py)."""
from __future__ import annotations

import asyncio

import pytest

from gateway.upstream import stream as stream_mod
from gateway.upstream.stream import Answers, NotSent
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError


class _Stream:
    name = "service test"

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, cid: str) -> None:
        self.cancelled.append(cid)


def answer(value: int | None, final: bool, empty: bool = False) -> pb.ModelStreamInferResponse:
    msg = pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id="~gw1", model_name="m"))
    params = msg.infer_response.parameters
    params["triton_final_response"].bool_param = final
    if empty:
        params["meshserve_empty_final"].bool_param = True
    if value is not None:
        msg.infer_response.outputs.add(name="OUT", datatype="INT32", shape=[1])
        msg.infer_response.raw_output_contents.append(value.to_bytes(4, "little"))
    return msg


async def test_answers_come_in_order_with_the_clients_id_and_end_at_the_final_one() -> None:
    answers = Answers(_Stream(), "~gw1", "client-7", None)
    assert answers.push(answer(1, False)) is False
    assert answers.push(answer(2, False)) is False
    assert answers.push(answer(None, True, empty=True)) is True
    first, f1 = await answers.next()
    second, f2 = await answers.next()
    assert first is not None and first.id == "client-7" and not f1
    assert second is not None and second.id == "client-7" and not f2
    assert await answers.next() == (None, True)


async def test_an_in_band_error_is_raised_with_its_code() -> None:
    answers = Answers(_Stream(), "~gw1", "c", None)
    err = pb.ModelStreamInferResponse(error_message="boom", infer_response=pb.ModelInferResponse(id="~gw1"))
    err.infer_response.parameters["meshserve_error_code"].string_param = "INVALID_ARG"
    assert answers.push(err) is True
    with pytest.raises(InferError) as exc:
        await answers.next()
    assert (exc.value.code, exc.value.message) == (Code.INVALID_ARG, "boom")


async def test_a_stream_that_never_answered_fails_the_first_wait_as_not_sent() -> None:
    answers = Answers(_Stream(), "~gw1", "c", None)
    answers.push(NotSent("service test: cannot connect"))
    with pytest.raises(NotSent):
        await answers.first()


async def test_a_client_that_reads_too_slowly_fails_and_the_service_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_mod, "MAX_WAITING_ANSWERS", 3)
    hop = _Stream()
    answers = Answers(hop, "~gw1", "c", None)
    assert [answers.push(answer(i, False)) for i in range(4)] == [False, False, False, True]
    assert hop.cancelled == ["~gw1"]
    for _ in range(3):
        await answers.next()
    with pytest.raises(InferError) as exc:
        await answers.next()
    assert exc.value.code is Code.RESOURCE_EXHAUSTED


async def test_answers_waiting_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-stream-backlog-bytes: one answer of any size waits; beyond the bound the request
    ends (RESOURCE_EXHAUSTED, its one end) and the service is told; reading gives bytes back."""
    monkeypatch.setattr(stream_mod.STREAMS, "backlog_bytes", 2500)
    hop = _Stream()
    answers = Answers(hop, "~gw1", "c", None)
    assert answers.push(answer(0, False), 4000) is False  # alone: any size
    await answers.next()
    assert answers.waiting_bytes == 0
    assert [answers.push(answer(i, False), 1000) for i in range(3)] == [False, False, True]
    assert hop.cancelled == ["~gw1"] and answers.waiting_bytes == 2000
    for _ in range(2):
        await answers.next()
    with pytest.raises(InferError) as exc:
        await answers.next()
    assert exc.value.code is Code.RESOURCE_EXHAUSTED and "--max-stream-backlog-bytes" in exc.value.message
    assert answers.waiting_bytes == 0


async def test_leaving_early_cancels_at_the_service_once() -> None:
    hop = _Stream()
    answers = Answers(hop, "~gw1", "c", None)
    answers.push(answer(1, False))
    answers.close()
    answers.close()
    assert hop.cancelled == ["~gw1"]
    done = Answers(hop, "~gw2", "c", None)
    done.push(answer(1, True))
    done.close()  # its last answer came: nothing to cancel
    assert hop.cancelled == ["~gw1"]


async def test_the_deadline_bounds_the_wait_for_the_next_answer() -> None:
    hop = _Stream()
    answers = Answers(hop, "~gw1", "c", asyncio.get_running_loop().time() + 0.05)
    with pytest.raises(InferError) as exc:
        await answers.next()
    assert exc.value.code is Code.DEADLINE_EXCEEDED and hop.cancelled == ["~gw1"]
