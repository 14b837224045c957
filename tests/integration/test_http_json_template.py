"""All-JSON infer requests (tritonclient's HTTP client with binary_data=False, and
perf_analyzer's form with Inference-Header-Content-Length = the body's length) through a running
gateway and directly to the service: the JSON request template and the kept JSON answer pieces
(meshserve/protocol/http_codec.py) give every request its own numbers (a stale value from a
template would show), for every datatype, with the shapes changing between requests, from
concurrent clients whose requests the gateway merges, and a bad request after good ones gets
the same 400 as without a template."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

TARGETS = ["gateway", "service"]


def url_of(stack: Any, target: str) -> str:
    return stack.gateway.http if target == "gateway" else stack.service.http


def add_sub(client: httpclient.InferenceServerClient, a: np.ndarray, b: np.ndarray, binary: bool = False,
            request_id: str = "") -> httpclient.InferResult:
    """add_sub of a and b, its tensors as JSON (``binary``: binary, both ways)."""
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        t = httpclient.InferInput(name, list(value.shape), "FP32")
        t.set_data_from_numpy(value, binary_data=binary)
        inputs.append(t)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    return client.infer("add_sub", inputs, outputs=outputs, request_id=request_id)


@pytest.mark.parametrize("target", TARGETS)
def test_repeated_json_requests_each_get_their_own_answer(stack: Any, target: str) -> None:
    rng = np.random.default_rng(1)
    with httpclient.InferenceServerClient(url_of(stack, target)) as client:
        for i in range(30):
            rows = 1 + i % 3  # the shape changes between requests (another template each)
            a = rng.standard_normal((rows, 16)).astype(np.float32)
            b = rng.standard_normal((rows, 16)).astype(np.float32)
            result = add_sub(client, a, b)
            for out in result.get_response()["outputs"]:
                assert "data" in out and "parameters" not in out  # JSON data, as asked
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


IDENTITY: dict[str, Any] = {
    "BOOL": lambda rng, n: rng.random(n) > 0.5,
    "INT8": lambda rng, n: rng.integers(-128, 128, n, dtype=np.int8),
    "INT16": lambda rng, n: rng.integers(-(2**15), 2**15, n, dtype=np.int16),
    "INT32": lambda rng, n: rng.integers(-(2**31), 2**31, n, dtype=np.int32),
    "INT64": lambda rng, n: rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
    "UINT8": lambda rng, n: rng.integers(0, 256, n, dtype=np.uint8),
    "UINT16": lambda rng, n: rng.integers(0, 2**16, n, dtype=np.uint16),
    "UINT32": lambda rng, n: rng.integers(0, 2**32, n, dtype=np.uint32),
    "UINT64": lambda rng, n: rng.integers(0, 2**64 - 1, n, dtype=np.uint64),
    "FP16": lambda rng, n: rng.standard_normal(n).astype(np.float16),
    "FP32": lambda rng, n: rng.standard_normal(n).astype(np.float32),
    "FP64": lambda rng, n: rng.standard_normal(n),
    "BYTES": lambda rng, n: np.array([f"s{v}\u00e9".encode() for v in rng.integers(0, 10**6, n)], dtype=np.object_),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("datatype", sorted(IDENTITY))
def test_every_datatype_round_trips_as_json_with_changing_shapes(stack: Any, target: str, datatype: str) -> None:
    rng = np.random.default_rng(7)
    model = f"identity_{datatype.lower()}"
    with httpclient.InferenceServerClient(url_of(stack, target)) as client:
        for shape in [(1, 3), (1, 3), (2, 5), (1, 3), (1, 1), (2, 5), (1, 3)]:
            value = IDENTITY[datatype](rng, int(np.prod(shape))).reshape(shape)
            t = httpclient.InferInput("INPUT0", list(shape), datatype)
            t.set_data_from_numpy(value, binary_data=False)
            result = client.infer(model, [t], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
            got = result.as_numpy("OUTPUT0")
            assert got.shape == shape
            if datatype == "BYTES":  # (tritonclient gives JSON strings as str)
                value = np.vectorize(lambda v: v.decode(), otypes=[object])(value)
            np.testing.assert_array_equal(got, value)


def clients_get_their_own_rows(url: str, answered: Callable[[Any, int, np.ndarray, np.ndarray], bool],
                               requests: int = 10) -> None:
    """8 concurrent clients of ``url`` (their requests merged by a gateway), ``requests`` each
    with their own rows: ``answered(client, i, a, b)`` says whether client i's request of inputs
    a, b got its own answer."""
    results: dict[int, Any] = {}
    start = threading.Barrier(8)

    def client(i: int) -> None:
        with httpclient.InferenceServerClient(url) as c:
            start.wait()
            got = []
            for k in range(requests):
                a = np.full((1, 16), i * 100 + k, np.float32)
                b = np.arange(16, dtype=np.float32).reshape(1, 16) * (k + 1)
                got.append(answered(c, i, a, b))
            results[i] = got

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: [True] * requests for i in range(8)}


def test_concurrent_json_clients_through_the_gateway_get_their_own_rows(stack: Any) -> None:
    def answered(c: Any, i: int, a: np.ndarray, b: np.ndarray) -> bool:
        r = add_sub(c, a, b)
        return bool(np.array_equal(r.as_numpy("OUTPUT0"), a + b)) and bool(np.array_equal(r.as_numpy("OUTPUT1"), a - b))

    clients_get_their_own_rows(stack.gateway.http, answered)


def post(url: str, body: bytes, header_length: bool) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if header_length:  # as perf_analyzer sends every request
        headers["Inference-Header-Content-Length"] = str(len(body))
    req = urllib.request.Request(f"http://{url}/v2/models/add_sub/infer", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def body_of(a: list[Any], b: list[Any]) -> bytes:
    return json.dumps({"id": "", "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": a},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": b}],
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1"}]}, separators=(",", ":")).encode()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("header_length", [True, False])
def test_bad_numbers_after_good_requests_get_the_same_400(stack: Any, target: str, header_length: bool) -> None:
    url = url_of(stack, target)
    for k in range(3):  # the template, then hits with their own numbers
        a, b = [float(k + i) for i in range(16)], [0.5] * 16
        status, doc = post(url, body_of(a, b), header_length)
        assert status == 200
        assert doc["outputs"][0]["data"] == [x + 0.5 for x in a] and doc["outputs"][1]["data"] == [x - 0.5 for x in a]
    cases = [
        (body_of([1.0] * 15, [0.5] * 16), "input 'INPUT0': shape [1,16] needs 16 elements, got 15 in 'data'"),
        (body_of([1.0] * 15 + ["x"], [0.5] * 16),
         "input 'INPUT0': element 15 of 'data' is \"x\"; FP32 data must be numbers"),
        (body_of([1.0] * 16, [0.5] * 15 + [1e39]), "input 'INPUT1': element 15 of 'data' (1e+39) is out of range for FP32"),
        (body_of([1.0] * 16, [[0.5] * 8, [0.5] * 7]), "input 'INPUT1': shape [1,16] needs 16 elements, got 15 in 'data'"),
        (body_of([True] * 16, [0.5] * 16), "input 'INPUT0': element 0 of 'data' is true; FP32 data must be numbers"),
    ]
    for body, message in cases:
        status, doc = post(url, body, header_length)
        assert (status, doc) == (400, {"error": message})
    # and tritonclient reads that 400 as Triton's error
    with httpclient.InferenceServerClient(url) as client:
        t0 = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        t0.set_data_from_numpy(np.zeros((1, 16), np.float32), binary_data=False)
        t1 = httpclient.InferInput("INPUT1", [1, 16], "FP32")
        t1.set_data_from_numpy(np.zeros((1, 16), np.float32), binary_data=False)
        t1._data = t1._data[:10]  # (the client's own check passed: a short list on the wire)
        with pytest.raises(InferenceServerException, match="needs 16 elements, got 10"):
            client.infer("add_sub", [t0, t1])
