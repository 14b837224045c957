"""The body worker process: same results and errors as decoding in place; survives its own end."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import http_codec
from meshserve.protocol.errors import Code, InferError
from meshserve.server.body_worker import BodyWorker


@pytest.fixture
async def worker():
    w = BodyWorker()
    yield w
    w.close()


def infer_body(n: int) -> bytes:
    return json.dumps({"id": "r1", "inputs": [{"name": "IN", "shape": [1, n], "datatype": "FP32",
                                               "data": np.arange(n, dtype=np.float32).tolist()}]}).encode()


async def test_results_match_in_place_decoding(worker: BodyWorker) -> None:
    body = infer_body(50_000)
    got = await worker.call("parse_infer_request", bytearray(body), None, "m", "2")
    assert isinstance(got, pb.ModelInferRequest)
    assert got == http_codec.parse_infer_request(body, None, "m", "2")
    load = json.dumps({"parameters": {"config": "{}", "file:1/model.onnx": "AAEC"}}).encode()
    params = await worker.call("parse_load_request", load)
    assert params["file:1/model.onnx"].bytes_param == b"\0\1\2" and params["config"].string_param == "{}"
    assert await worker.call("parse_json_object", b'{"log_info": true}', "log settings") == {"log_info": True}
    assert await worker.call("parse_index_request", b'{"ready": true}') is True


async def test_errors_keep_their_code_and_message(worker: BodyWorker) -> None:
    with pytest.raises(InferError) as info:
        await worker.call("parse_infer_request", rb'{"inputs": [{"name": "\ud800"}]}', None, "m", "")
    assert info.value.code == Code.INVALID_ARG and "at 'inputs[0].name'" in info.value.message
    with pytest.raises(InferError) as info:
        await worker.call("parse_json_object", b"[1]", "log settings")
    assert info.value.code == Code.INVALID_ARG


async def test_a_worker_that_died_is_replaced(worker: BodyWorker) -> None:
    assert await worker.call("parse_index_request", b"") is False
    proc = worker._procs[0]
    assert proc is not None
    proc.kill()
    proc.wait()
    assert await worker.call("parse_index_request", b'{"ready": 1}') is True  # a fresh process


async def test_a_tenant_at_its_share_of_the_workers_leaves_the_other_to_another_tenant(worker: BodyWorker) -> None:
    """Six large bodies of one tenant (share 0.5: one of the two workers), then a small one of
    another: the other's is decoded at once beside the first large one, and answered first
    (before: it waited for that one, one worker serving a line per tenant round-robin); each
    tenant's bodies in order; without tenants (None) the bodies take both workers."""
    ready = b'{"ready": true}'
    assert await asyncio.gather(*[worker.call("parse_index_request", ready) for _ in range(2)]) == [True, True]
    assert worker._procs[0] is not None and worker._procs[1] is not None  # (both started: no start-up below)
    large = infer_body(300_000)
    order: list[tuple[object, int]] = []

    async def one(tenant: object, i: int, body: bytes, fn: str, *args: object) -> None:
        assert await worker.call(fn, body, *args, tenant=tenant, share=0.5) is not None
        order.append((tenant, i))

    await asyncio.gather(*[one("mallory", i, large, "parse_infer_request", None, "m", "") for i in range(6)],
                         one("acme", 0, ready, "parse_index_request"))
    assert order[0] == ("acme", 0), order
    assert [i for t, i in order if t == "mallory"] == list(range(6))  # in order within a tenant
    order.clear()
    await asyncio.gather(*[one(None, i, ready, "parse_index_request") for i in range(4)])
    assert sorted(order) == [(None, i) for i in range(4)]
