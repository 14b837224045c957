"""Decoupled models through a real gateway process, with the real tritonclient: a client's
ModelStreamInfer gets every response of each request with its own id; the empty final
response only when asked for; a unary call gets Triton's error; generate and generate_stream
(server-sent events); a sequence's next request waits for the last answer of the one before;
a client that leaves stops the request at the service. The service is the stand-in
tests.integration.decoupled_service (the python service runs the real models:
tests/e2e/test_decoupled_python.py)."""
from __future__ import annotations

import json
import queue
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.support import eventually

SERVICE = "tests.integration.decoupled_service"


@pytest.fixture(scope="module")
def mesh() -> Iterator[tuple[Proc, Proc]]:
    with service_and_gateway("", [], module=SERVICE, timeout=60) as procs:
        yield procs


def repeat_inputs(values: list[int], delays: list[int] | None = None, wait: int = 0,
                  client: Any = grpcclient) -> list[Any]:
    """repeat_int32's inputs for tritonclient.grpc or .http (JSON data)."""
    delays = [0] * len(values) if delays is None else delays
    out = []
    for name, dt, arr in (("IN", "INT32", np.array(values, np.int32)), ("DELAY", "UINT32", np.array(delays, np.uint32)),
                          ("WAIT", "UINT32", np.array([wait], np.uint32))):
        t = client.InferInput(name, [arr.size], dt)
        if client is httpclient:
            t.set_data_from_numpy(arr, binary_data=False)
        else:
            t.set_data_from_numpy(arr)
        out.append(t)
    return out


class Collector:
    """tritonclient's stream callback: every (result, error) in arrival order."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[grpcclient.InferResult | None, InferenceServerException | None]] = queue.Queue()

    def __call__(self, result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        self.items.put((result, error))

    def take(self, n: int, timeout: float = 20) -> list[tuple[grpcclient.InferResult | None,
                                                                InferenceServerException | None]]:
        return [self.items.get(timeout=timeout) for _ in range(n)]


@contextmanager
def streaming(gateway: Proc) -> Iterator[tuple[grpcclient.InferenceServerClient, Collector]]:
    """A tritonclient gRPC stream to the gateway and what its callback receives."""
    client = grpcclient.InferenceServerClient(gateway.grpc)
    got = Collector()
    client.start_stream(callback=got)
    try:
        yield client, got
    finally:
        client.stop_stream()


def final(result: grpcclient.InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def test_a_client_stream_gets_every_response_with_its_id(mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    with streaming(gateway) as (client, got):
        client.async_stream_infer("repeat_int32", repeat_inputs([4, 2, 0, 1]), request_id="req-1")
        client.async_stream_infer("repeat_int32", repeat_inputs([5, 6]), request_id="req-2",
                                  enable_empty_final_response=True)
        items = got.take(7)
    assert all(error is None for _, error in items)
    by_id: dict[str, list[tuple[list[int] | None, bool]]] = {}
    for result, _ in items:
        assert result is not None
        out = result.as_numpy("OUT")
        by_id.setdefault(result.get_response().id, []).append((None if out is None else out.tolist(), final(result)))
    assert by_id == {"req-1": [([4], False), ([2], False), ([0], False), ([1], False)],
                     "req-2": [([5], False), ([6], False), (None, True)]}
    assert got.items.empty()


def test_errors_and_models_that_are_not_decoupled_on_a_client_stream(mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    with streaming(gateway) as (client, got):
        n = grpcclient.InferInput("IN", [1], "INT32")
        n.set_data_from_numpy(np.array([3], np.int32))
        client.async_stream_infer("faulty_stream", [n], request_id="f1")
        (result, error), (none, failure) = got.take(2)
        t = grpcclient.InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([b"hi"], np.object_))
        client.async_stream_infer("text_echo", [t], request_id="t1")
        ((echo, ok),) = got.take(1)
    assert error is None and result is not None and result.as_numpy("OUT").tolist() == [3]
    assert none is None and failure is not None and "faulty_stream failed on 3" in failure.message()
    assert ok is None and echo is not None and echo.as_numpy("text_output").tolist() == [b"hi"] and final(echo)
    assert echo.get_response().id == "t1"


def test_a_unary_call_on_a_decoupled_model_gets_tritons_error(mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    with pytest.raises(InferenceServerException) as grpc_err:
        grpcclient.InferenceServerClient(gateway.grpc).infer("repeat_int32", repeat_inputs([1]))
    assert grpc_err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert grpc_err.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
    with pytest.raises(InferenceServerException) as http_err:
        httpclient.InferenceServerClient(gateway.http).infer("repeat_int32", repeat_inputs([1], client=httpclient))
    assert http_err.value.status() == "400"
    assert http_err.value.message() == "HTTP end point doesn't support models with decoupled transaction policy"


def post(gateway: Proc, path: str, body: object) -> tuple[int, str, bytes]:
    req = urllib.request.Request(f"http://{gateway.http}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_generate_and_generate_stream_through_the_gateway(mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    assert post(gateway, "/v2/models/text_echo/generate", {"text_input": "hi", "parameters": {"suffix": "!"}}) == (
        200, "application/json", b'{"lengths":[2,3],"model_name":"text_echo","model_version":"1","text_output":"hi!"}')
    assert post(gateway, "/v2/models/repeat_int32/generate_stream", {"IN": [4, 2], "DELAY": [0, 0], "WAIT": 0}) == (
        200, "text/event-stream; charset=utf-8",
        b'data: {"IDX":0,"OUT":4,"model_name":"repeat_int32","model_version":"1"}\n\n'
        b'data: {"IDX":1,"OUT":2,"model_name":"repeat_int32","model_version":"1"}\n\n')
    status, _, body = post(gateway, "/v2/models/repeat_int32/generate", {"IN": [4, 2], "DELAY": [0, 0], "WAIT": 0})
    assert status == 400 and json.loads(body) == {"error": "generate expects model to produce exactly 1 response, use "
                                                  "generate stream for model that generates various number of responses"}
    assert post(gateway, "/v2/models/faulty_stream/generate_stream", {"IN": 2})[2] == (
        b'data: {"OUT":2,"model_name":"faulty_stream","model_version":"1"}\n\n'
        b'data: {"error":"faulty_stream failed on 2"}\n\n')
    assert post(gateway, "/v2/models/nope/generate", {"x": 1}) == (
        404, "application/json", b'{"error":"Request for unknown model: \'nope\' is not found"}')


def test_a_sequence_waits_for_the_last_answer_of_its_previous_request(mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    with streaming(gateway) as (client, got):
        client.async_stream_infer("repeat_int32", repeat_inputs([1, 2], [0, 300]), request_id="first",
                                  sequence_id=42, sequence_start=True)
        client.async_stream_infer("repeat_int32", repeat_inputs([9]), request_id="second", sequence_id=42)
        items = got.take(3)
    assert [r.get_response().id for r, _ in items if r is not None] == ["first", "first", "second"]


def metrics(proc: Proc) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{proc.http}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def test_a_client_that_leaves_stops_its_request_at_the_service(mesh: tuple[Proc, Proc]) -> None:
    service, gateway = mesh
    before = metrics(service)["fake_cancelled_total"]
    client = grpcclient.InferenceServerClient(gateway.grpc)
    got = Collector()
    client.start_stream(callback=got)
    client.async_stream_infer("repeat_int32", repeat_inputs([1, 2], [0, 60_000]), request_id="long")
    ((first, _),) = got.take(1)
    assert first is not None and first.as_numpy("OUT").tolist() == [1]
    assert metrics(service)["fake_streaming"] == 1
    client.stop_stream(cancel_requests=True)
    eventually(lambda: metrics(service)["fake_cancelled_total"] == before + 1 and metrics(service)["fake_streaming"] == 0,
               10, "the service stopped the abandoned request")

    # the same for a generate_stream client that closes its connection after the first event
    body = json.dumps({"IN": [1, 2], "DELAY": [0, 60_000], "WAIT": 0}).encode()
    done = threading.Event()

    def read_one_event() -> None:
        req = urllib.request.Request(f"http://{gateway.http}/v2/models/repeat_int32/generate_stream", data=body,
                                     method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.readline().startswith(b"data: ")
        done.set()

    reader = threading.Thread(target=read_one_event)
    reader.start()
    reader.join(30)
    assert done.is_set()
    eventually(lambda: metrics(service)["fake_cancelled_total"] == before + 2 and metrics(service)["fake_streaming"] == 0,
               10, "the service stopped the request of the generate_stream client that left")
