"""The front ends on a core with decoupled models (tests/integration/decoupled_service.py, in
process): gRPC ModelStreamInfer with several responses per request, Triton's
triton_final_response / triton_enable_empty_final_response, the gateway hop's marking and
cancel; HTTP generate and generate_stream (server-sent events). The expected texts and bodies
are the ones Triton 2.51 answered for the same models (tests/e2e/triton_reference.md)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import aiohttp
import grpc
import numpy as np
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import generate_codec, hop
from meshserve.server import grpc_frontend
from meshserve.server.http_frontend import start_http_server
from tests.integration.decoupled_service import DecoupledCore
from tests.support import eventually_async
from tests.support.h2 import inference_service

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
INFER = "/inference.GRPCInferenceService/ModelInfer"
FINAL = "triton_final_response"


@dataclass
class Servers:
    core: DecoupledCore
    grpc: str
    http: str


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    core = DecoupledCore()
    async with inference_service(grpc_frontend.inference_methods(core)) as endpoint:  # type: ignore[arg-type]
        runner, http_port = await start_http_server(core, "127.0.0.1", 0)  # type: ignore[arg-type]
        try:
            yield Servers(core, endpoint, f"http://127.0.0.1:{http_port}")
        finally:
            await runner.cleanup()


def repeat(rid: str, values: list[int], delays: list[int] | None = None, wait: int = 0,
           empty_final: bool | None = None, model: str = "repeat_int32") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model, id=rid)
    delays = [0] * len(values) if delays is None else delays
    for name, dt, arr in (("IN", "INT32", np.array(values, np.int32)), ("DELAY", "UINT32", np.array(delays, np.uint32)),
                          ("WAIT", "UINT32", np.array([wait], np.uint32))):
        r.inputs.add(name=name, datatype=dt, shape=[arr.size])
        r.raw_input_contents.append(arr.tobytes())
    if empty_final is not None:
        r.parameters["triton_enable_empty_final_response"].bool_param = empty_final
    return r


def one_int(model: str, rid: str, n: int, empty_final: bool | None = None) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=model, id=rid)
    r.inputs.add(name="IN", datatype="INT32", shape=[1])
    r.raw_input_contents.append(np.array([n], np.int32).tobytes())
    if empty_final is not None:
        r.parameters["triton_enable_empty_final_response"].bool_param = empty_final
    return r


def text(rid: str, value: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="text_echo", id=rid)
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    r.raw_input_contents.append(len(value).to_bytes(4, "little") + value.encode())
    return r


async def stream(target: str, requests: Iterable[pb.ModelInferRequest],
                 metadata: tuple[tuple[str, str], ...] = ()) -> list[pb.ModelStreamInferResponse]:
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_stream(STREAM)(iter([r.SerializeToString() for r in requests]), metadata=metadata)
        return [pb.ModelStreamInferResponse.FromString(raw) async for raw in call]


def outs(response: pb.ModelInferResponse) -> dict[str, list[int]]:
    return {o.name: np.frombuffer(raw, np.int32 if o.datatype == "INT32" else np.uint32).tolist()
            for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}


def final(response: pb.ModelInferResponse) -> bool:
    assert FINAL in response.parameters, response
    return response.parameters[FINAL].bool_param


# ---- gRPC ModelStreamInfer ----------------------------------------------------------------------

async def test_a_decoupled_model_answers_every_response_in_order_none_final(servers: Servers) -> None:
    answers = await stream(servers.grpc, [repeat("r1", [4, 2, 0, 1])])
    assert [a.error_message for a in answers] == [""] * 4
    assert [outs(a.infer_response) for a in answers] == [{"OUT": [v], "IDX": [i]} for i, v in enumerate([4, 2, 0, 1])]
    assert [(a.infer_response.id, a.infer_response.model_version, final(a.infer_response)) for a in answers] == \
        [("r1", "1", False)] * 4  # Triton: no empty final response unless asked for


async def test_the_empty_final_response_comes_only_when_asked_for(servers: Servers) -> None:
    answers = await stream(servers.grpc, [repeat("r2", [4, 2], empty_final=True)])
    assert [final(a.infer_response) for a in answers] == [False, False, True]
    last = answers[-1].infer_response  # Triton's: the request's name, version and id, the flag only
    assert last == pb.ModelInferResponse(model_name="repeat_int32", model_version="", id="r2",
                                         parameters={FINAL: pb.InferParameter(bool_param=True)})
    assert len(await stream(servers.grpc, [repeat("r3", [4, 2], empty_final=False)])) == 2
    assert await stream(servers.grpc, [one_int("square_int32", "s0b", 0)]) == []  # no response at all
    (only,) = await stream(servers.grpc, [one_int("square_int32", "s0", 0, empty_final=True)])
    assert only.infer_response == pb.ModelInferResponse(model_name="square_int32", id="s0",
                                                        parameters={FINAL: pb.InferParameter(bool_param=True)})


async def test_a_model_that_is_not_decoupled_answers_once_marked_final(servers: Servers) -> None:
    (answer,) = await stream(servers.grpc, [text("t1", "hi")])
    assert answer.infer_response.id == "t1" and final(answer.infer_response)
    assert answer.infer_response.raw_output_contents[0] == b"\x02\x00\x00\x00hi"


async def test_errors_travel_in_band_and_end_their_request(servers: Servers) -> None:
    faulty, unknown = await asyncio.gather(stream(servers.grpc, [one_int("faulty_stream", "f1", 3)]),
                                           stream(servers.grpc, [one_int("nope", "n1", 3)]))
    assert outs(faulty[0].infer_response) == {"OUT": [3]} and not final(faulty[0].infer_response)
    assert faulty[1].error_message == "faulty_stream failed on 3"
    assert faulty[1].infer_response.id == "f1" and final(faulty[1].infer_response) and len(faulty) == 2
    assert [(a.error_message, a.infer_response.id) for a in unknown] == \
        [("Request for unknown model: 'nope' is not found", "n1")]


async def test_requests_on_one_call_interleave_each_in_order(servers: Servers) -> None:
    answers = await stream(servers.grpc, [repeat("a", [1, 2, 3], [30, 30, 30]), repeat("b", [7, 8], [5, 5])])
    by_id = {rid: [outs(a.infer_response)["OUT"][0] for a in answers if a.infer_response.id == rid] for rid in "ab"}
    assert by_id == {"a": [1, 2, 3], "b": [7, 8]}
    assert [a.infer_response.id for a in answers][-1] == "a"  # b's shorter delays finish first


async def test_a_unary_call_on_a_decoupled_model_gets_tritons_error(servers: Servers) -> None:
    async with grpc.aio.insecure_channel(servers.grpc) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary(INFER)(repeat("u", [1]).SerializeToString())
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "ModelInfer RPC doesn't support models with decoupled transaction policy"


async def test_a_heavy_streamed_message_ends_the_stream_with_the_workers_own_status(
        servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message the body worker reads (infer_checks.heavy) and cannot answer for: the stream ends
    with the worker's status, UNAVAILABLE where its process is gone (INVALID_ARGUMENT was every
    such end's status before), and INVALID_ARGUMENT for a malformed message, as before."""
    from meshserve.protocol.errors import InferError
    from meshserve.protocol.infer_checks import HEAVY_FROM, heavy

    heavy_request = repeat("h", [1])
    heavy_request.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor() for _ in range(HEAVY_FROM))
    assert heavy(heavy_request.SerializeToString())
    for error, code in ((InferError.unavailable("the HTTP body decoder process exited; retry the request"),
                         grpc.StatusCode.UNAVAILABLE),
                        (InferError.invalid("malformed ModelInferRequest: x"), grpc.StatusCode.INVALID_ARGUMENT)):
        async def worker(*args: object, error: InferError = error) -> object:
            raise error

        monkeypatch.setattr(grpc_frontend, "_in_worker", worker)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream(servers.grpc, [heavy_request])
        assert (err.value.code(), err.value.details()) == (code, error.message)


# ---- the gateway's hop ---------------------------------------------------------------------------

HOP = ((hop.HEADER, hop.GATEWAY),)


def hop_stream(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    request.parameters["meshserve_stream"].bool_param = True
    return request


async def test_on_the_hop_a_streamed_request_always_ends_with_a_marked_final(servers: Servers) -> None:
    answers = await stream(servers.grpc, [hop_stream(repeat("~gw1", [5])), hop_stream(one_int("square_int32", "~gw2", 0)),
                                          text("~gw3", "hi")], HOP)
    got = {(a.infer_response.id, FINAL in a.infer_response.parameters and a.infer_response.parameters[FINAL].bool_param,
            "meshserve_empty_final" in a.infer_response.parameters) for a in answers}
    assert got == {("~gw1", False, False), ("~gw1", True, True), ("~gw2", True, True),
                   ("~gw3", False, False)}  # a request not marked streamed: one plain answer, as before
    (plain,) = [a for a in answers if a.infer_response.id == "~gw3"]
    assert FINAL not in plain.infer_response.parameters


async def test_the_gateway_cancels_a_streamed_request_on_its_hop(servers: Servers) -> None:
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            yield item

    async with grpc.aio.insecure_channel(servers.grpc) as channel:
        call = channel.stream_stream(STREAM)(requests(), metadata=HOP)
        queue.put_nowait(hop_stream(repeat("~gw7", [1, 2], [0, 60_000])).SerializeToString())
        first = pb.ModelStreamInferResponse.FromString(await call.read())
        assert first.infer_response.id == "~gw7" and servers.core.streaming == 1
        cancel = pb.ModelInferRequest(id="~gw7")
        cancel.parameters["meshserve_cancel"].bool_param = True
        queue.put_nowait(cancel.SerializeToString())
        await eventually_async(lambda: servers.core.cancelled == 1 and servers.core.streaming == 0, 5.0)
        queue.put_nowait(None)
        assert await call.read() is grpc.aio.EOF  # nothing more for it; the call ends


# ---- HTTP generate / generate_stream ---------------------------------------------------------------

async def post(servers: Servers, path: str, body: object) -> tuple[int, str, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.post(servers.http + path, data=data) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


async def test_generate_maps_json_to_inputs_and_outputs_to_json(servers: Servers) -> None:
    assert await post(servers, "/v2/models/text_echo/generate", {"text_input": "hi"}) == (
        200, "application/json", b'{"lengths":[2,2],"model_name":"text_echo","model_version":"1","text_output":"hi"}')
    status, _, body = await post(servers, "/v2/models/text_echo/generate",
                                 {"text_input": "hi", "parameters": {"suffix": "!"}})
    assert status == 200 and json.loads(body)["text_output"] == "hi!"
    status, _, body = await post(servers, "/v2/models/text_echo/generate", {"text_input": "hi", "suffix": 5})
    assert status == 200 and json.loads(body)["text_output"] == "hi5"  # a key that is no input: a parameter
    assert await post(servers, "/v2/models/repeat_int32/versions/1/generate", {"IN": [7], "DELAY": [0], "WAIT": 0}) \
        == (200, "application/json", b'{"IDX":0,"OUT":7,"model_name":"repeat_int32","model_version":"1"}')


async def test_generate_needs_exactly_one_response(servers: Servers) -> None:
    for body in ({"IN": [4, 2, 0, 1], "DELAY": [0, 0, 0, 0], "WAIT": 0}, {"IN": [], "DELAY": [], "WAIT": 0}):
        status, _, got = await post(servers, "/v2/models/repeat_int32/generate", body)
        assert (status, json.loads(got)) == (400, {"error": generate_codec.NOT_ONE_RESPONSE})


async def test_generate_stream_sends_each_response_as_an_event(servers: Servers) -> None:
    assert await post(servers, "/v2/models/repeat_int32/generate_stream",
                      {"IN": [4, 2, 0, 1], "DELAY": [0, 0, 0, 0], "WAIT": 0}) == (
        200, "text/event-stream; charset=utf-8",
        b'data: {"IDX":0,"OUT":4,"model_name":"repeat_int32","model_version":"1"}\n\n'
        b'data: {"IDX":1,"OUT":2,"model_name":"repeat_int32","model_version":"1"}\n\n'
        b'data: {"IDX":2,"OUT":0,"model_name":"repeat_int32","model_version":"1"}\n\n'
        b'data: {"IDX":3,"OUT":1,"model_name":"repeat_int32","model_version":"1"}\n\n')
    assert await post(servers, "/v2/models/square_int32/generate_stream", {"IN": 0}) == (
        200, "text/event-stream; charset=utf-8", b"")
    assert await post(servers, "/v2/models/text_echo/generate_stream", {"text_input": "hi"}) == (
        200, "text/event-stream; charset=utf-8",
        b'data: {"lengths":[2,2],"model_name":"text_echo","model_version":"1","text_output":"hi"}\n\n')


async def test_generate_stream_errors_are_events(servers: Servers) -> None:
    assert await post(servers, "/v2/models/faulty_stream/generate_stream", {"IN": 3}) == (
        200, "text/event-stream; charset=utf-8",
        b'data: {"OUT":3,"model_name":"faulty_stream","model_version":"1"}\n\n'
        b'data: {"error":"faulty_stream failed on 3"}\n\n')
    assert await post(servers, "/v2/models/repeat_int32/generate_stream", {"IN": [1, 2], "DELAY": [0], "WAIT": 0}) \
        == (400, "text/event-stream; charset=utf-8",
            b'data: {"error":"expected IN and DELAY of the same shape, got (2,) and (1,)"}\n\n')


async def test_generate_stream_events_arrive_as_the_model_sends_them(servers: Servers) -> None:
    body = json.dumps({"IN": [1, 2], "DELAY": [0, 60_000], "WAIT": 0}).encode()
    async with aiohttp.ClientSession() as session, \
            session.post(servers.http + "/v2/models/repeat_int32/generate_stream", data=body) as resp:
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first.removeprefix(b"data: ")) == {
            "IDX": 0, "OUT": 1, "model_name": "repeat_int32", "model_version": "1"}
        assert servers.core.streaming == 1  # the second response is a minute away
    await eventually_async(lambda: servers.core.cancelled == 1 and servers.core.streaming == 0, 5.0,
                           "the request stopped when its client left")


@pytest.mark.parametrize(("path", "body", "status", "error"), [
    ("/v2/models/nope/generate", {"text_input": "hi"}, 404, "Request for unknown model: 'nope' is not found"),
    ("/v2/models/nope/generate_stream", {"text_input": "hi"}, 404, "Request for unknown model: 'nope' is not found"),
    ("/v2/models/text_echo/versions/7/generate", {"text_input": "hi"}, 404,
     "Request for unknown model: 'text_echo' version 7 is not found"),
    ("/v2/models/text_echo/generate", {"text_input": "hi", "parameters": {"suffix": [1]}}, 400,
     "Converting keyword: 'parameters': parameter 'suffix' has invalid type. It should be either 'int', 'bool', "
     "or 'string'."),
    ("/v2/models/text_echo/generate", {"text_input": "hi", "extra": None}, 400,
     "parameter 'extra' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ("/v2/models/text_echo/generate", {"text_input": "hi", "parameters": 3}, 400,
     "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object"),
    ("/v2/models/text_echo/generate", {"text_input": ["a", "b"]}, 400,
     "The schema can not convert input 'text_input' to tensor with proper shape"),
    ("/v2/models/text_echo/generate", {"text_input": "hi", "parameters": {"text_input": "x"}}, 400,
     "Converting keyword: 'parameters': input 'text_input' already exists in request"),
])
async def test_generate_refuses_bad_requests_with_tritons_words(servers: Servers, path: str, body: object,
                                                                 status: int, error: str) -> None:
    got_status, ctype, got = await post(servers, path, body)
    assert (got_status, ctype, json.loads(got)) == (status, "application/json", {"error": error})


@pytest.mark.parametrize("body", [b"{bad json", b"[1,2]", b"", b'{"text_input": 5}'])
async def test_generate_answers_malformed_json_with_400(servers: Servers, body: bytes) -> None:
    status, _, got = await post(servers, "/v2/models/text_echo/generate", body)
    assert status == 400 and json.loads(got)["error"]  # Triton: 500 for these


async def test_admission_counts_a_streamed_request_until_its_last_response(servers: Servers,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from meshserve.server import admission
    monkeypatch.setattr(admission.gate, "max_requests", 1)
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            yield item

    async with grpc.aio.insecure_channel(servers.grpc) as channel:
        call = channel.stream_stream(STREAM)(requests())
        queue.put_nowait(repeat("long", [1, 2], [0, 300]).SerializeToString())
        first = pb.ModelStreamInferResponse.FromString(await call.read())
        queue.put_nowait(repeat("refused", [5]).SerializeToString())
        refused = pb.ModelStreamInferResponse.FromString(await call.read())
        assert (first.infer_response.id, refused.infer_response.id) == ("long", "refused")
        assert refused.error_message.startswith("server busy: 1 inference requests in flight")
        last = pb.ModelStreamInferResponse.FromString(await call.read())
        assert last.infer_response.id == "long" and admission.gate.requests == 0
        queue.put_nowait(repeat("later", [6]).SerializeToString())
        later = pb.ModelStreamInferResponse.FromString(await call.read())
        assert later.infer_response.id == "later" and not later.error_message
        queue.put_nowait(None)
        assert await call.read() is grpc.aio.EOF


async def test_generate_bodies_have_the_request_size_limit() -> None:
    from meshserve.server.limits import ServerLimits
    runner, port = await start_http_server(DecoupledCore(), "127.0.0.1", 0,  # type: ignore[arg-type]
                                           ServerLimits(max_request_bytes=64))
    try:
        body = json.dumps({"text_input": "x" * 100}).encode()
        async with aiohttp.ClientSession() as session:
            for action in ("generate", "generate_stream"):
                async with session.post(f"http://127.0.0.1:{port}/v2/models/text_echo/{action}", data=body) as resp:
                    assert resp.status == 413 and "64-byte limit" in (await resp.json())["error"]
            async with session.get(f"http://127.0.0.1:{port}/v2/models/text_echo/generate") as resp:
                assert resp.status == 400  # Triton: 405; a client error either way
    finally:
        await runner.cleanup()
