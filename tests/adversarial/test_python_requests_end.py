"""Issue 29, finding 2: every admitted request to a decoupled python model ends exactly once, with
all of its responses.

10,000 requests go to a decoupled python model through a gateway, and 10,000 straight to the
python service, over many concurrent ``ModelStreamInfer`` calls (each keeping a window of
requests in flight, so the waves stay under both processes' admission bound). The model sends
``n`` responses per request, checking ``request.is_cancelled()`` before each (a request that
wrongly starts out cancelled, or is cancelled after its final, loses responses), then the final.
Every request must get its ``n`` responses, its own data in each, and exactly one final.

Before the fix, about one request in three lost its responses: the stream's end cancelled a
request whose final had already arrived, the cancel reached the worker after the batch, stayed
in its cancelled set, and a later request that got the same ``id()`` key started out cancelled.
"""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import Proc, service_and_gateway

REQUESTS = 10_000
STREAMS = 20  # concurrent ModelStreamInfer calls per target
WINDOW = 5  # requests in flight per call: 100 at once, under --max-inflight's default 128
RESPONSES = 2  # per request, before the final

COUNTDOWN_CONFIG = """
name: "countdown"
backend: "python"
max_batch_size: 16
model_transaction_policy { decoupled: true }
dynamic_batching { }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# IN = [[tag, n]]: n responses OUT = [[tag, i]] from execute(), each only while the request is
# not cancelled, then the final flag alone.
COUNTDOWN = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            tag, n = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0].tolist()
            sender = request.get_response_sender()
            for i in range(n):
                if request.is_cancelled():
                    break
                out = pb_utils.Tensor("OUT", np.array([[tag, i]], np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


@pytest.fixture(scope="module")
def python_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    repo = tmp_path_factory.mktemp("countdown")
    (repo / "countdown" / "1").mkdir(parents=True)
    (repo / "countdown" / "config.pbtxt").write_text(COUNTDOWN_CONFIG)
    (repo / "countdown" / "1" / "model.py").write_text(COUNTDOWN)
    with service_and_gateway("python", ["--repository", str(repo)], timeout=180) as procs:
        yield procs


def _request(tag: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="countdown", id=str(tag))
    req.inputs.add(name="IN", datatype="INT32", shape=[1, 2])
    req.raw_input_contents.append(np.array([[tag, RESPONSES]], np.int32).tobytes())
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


async def _one_call(stub: pb_grpc.GRPCInferenceServiceStub, tags: range,
                    seen: dict[int, list[int]], finals: collections.Counter[int], errors: list[str]) -> None:
    window = asyncio.Semaphore(WINDOW)
    call = stub.ModelStreamInfer()

    async def write() -> None:
        for tag in tags:
            await window.acquire()
            await call.write(_request(tag))
        # (no done_writing: the server ends the call once we cancel it after the last final)

    writer = asyncio.ensure_future(write())
    left = len(tags)
    try:
        while left:
            msg = await call.read()
            assert msg is not grpc.aio.EOF, f"the call ended with {left} requests open"
            resp = msg.infer_response
            tag = int(resp.id)
            if msg.error_message:
                errors.append(f"{tag}: {msg.error_message}")
            elif resp.raw_output_contents:
                got_tag, index = np.frombuffer(resp.raw_output_contents[0], np.int32).tolist()
                assert got_tag == tag, f"request {tag} got request {got_tag}'s response"
                seen[tag].append(index)
            if resp.parameters["triton_final_response"].bool_param or msg.error_message:
                finals[tag] += 1
                left -= 1
                window.release()
    finally:
        writer.cancel()
        call.cancel()


async def _drive(target: str) -> tuple[dict[int, list[int]], collections.Counter[int], list[str]]:
    seen: dict[int, list[int]] = collections.defaultdict(list)
    finals: collections.Counter[int] = collections.Counter()
    errors: list[str] = []
    per_call = REQUESTS // STREAMS
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        await asyncio.gather(*(_one_call(stub, range(i * per_call, (i + 1) * per_call), seen, finals, errors)
                               for i in range(STREAMS)))
    return seen, finals, errors


def _check(target: str) -> float:
    t0 = time.monotonic()
    seen, finals, errors = asyncio.run(asyncio.wait_for(_drive(target), 120))
    elapsed = time.monotonic() - t0
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[:3]}"
    assert sorted(finals) == list(range(REQUESTS)), "a request got no final"
    assert set(finals.values()) == {1}, f"requests with several finals: {[t for t, c in finals.items() if c > 1][:5]}"
    short = {tag: got for tag in range(REQUESTS) if (got := seen.get(tag, [])) != list(range(RESPONSES))}
    assert not short, f"{len(short)} of {REQUESTS} requests lost responses, e.g. {list(short.items())[:5]}"
    return elapsed


def test_every_decoupled_request_through_the_gateway_gets_all_its_responses_and_one_final(
        python_mesh: tuple[Proc, Proc]) -> None:
    _, gateway = python_mesh
    _check(gateway.grpc)


def test_every_decoupled_request_straight_to_the_service_gets_all_its_responses_and_one_final(
        python_mesh: tuple[Proc, Proc]) -> None:
    service, _ = python_mesh
    _check(service.grpc)
