"""Binary-tensor HTTP requests (the real tritonclient HTTP client) through a running gateway
whose pipeline forwards a templated request's bytes without making its message
(meshserve/protocol/http_codec.py:ForwardedRequest): every request gets its own answer and id
on one keep-alive connection while its layout changes (values, ids, rows, model versions), the
gateway's and the service's counts see every request once, a bad body after good ones is the
same 400 as the first time, an unknown model the same error every time, and concurrent clients
whose requests the gateway merges get their own rows."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

from tests.integration import test_http_json_template as json_template
from tests.support.metrics import metric


def f32(seed: int, rows: int = 1, width: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def add_sub(client: httpclient.InferenceServerClient, a: np.ndarray, b: np.ndarray, request_id: str = ""
            ) -> httpclient.InferResult:
    return json_template.add_sub(client, a, b, binary=True, request_id=request_id)


def test_each_request_of_a_changing_layout_gets_its_own_answer_and_id(stack: Any) -> None:
    with httpclient.InferenceServerClient(stack.gateway.http) as client:  # (one keep-alive connection)
        steps = [("r1", 1)] * 4 + [("r2", 1)] * 3 + [("", 2)] * 3 + [("r1", 1), ("", 1), ("r3", 3), ("r1", 1)]
        for k, (request_id, rows) in enumerate(steps):
            a, b = f32(2 * k, rows), f32(2 * k + 1, rows)
            result = add_sub(client, a, b, request_id)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
            answer = result.get_response()
            assert answer.get("id", "") == request_id and answer["model_name"] == "add_sub"
        for version, factor in (("1", 1.0), ("2", 2.0), ("1", 1.0), ("2", 2.0), ("2", 2.0)):  # another version each
            x = f32(version == "2", 1, 4)
            t = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            t.set_data_from_numpy(x, binary_data=True)
            result = client.infer("scale", [t], model_version=version,
                                  outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
            np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x * factor, rtol=1e-6)
            assert result.get_response()["model_version"] == version


def _service_count(service: str) -> int:
    with httpclient.InferenceServerClient(service) as client:
        stats = client.get_inference_statistics("add_sub")["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def test_the_gateway_and_the_service_count_every_request_once(stack: Any) -> None:
    gateway_before = metric(stack.gateway.http, "meshserve_gateway_requests_total", model="add_sub", outcome="OK")
    service_before = _service_count(stack.service.http)
    with httpclient.InferenceServerClient(stack.gateway.http) as client:
        for k in range(12):
            add_sub(client, f32(k), f32(k + 100), "counted")
    assert metric(stack.gateway.http, "meshserve_gateway_requests_total", model="add_sub",
                  outcome="OK") == gateway_before + 12
    assert _service_count(stack.service.http) == service_before + 12


def _body(a: np.ndarray, b: np.ndarray, request_id: str = "") -> tuple[bytes, int]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        t = httpclient.InferInput(name, list(value.shape), "FP32")
        t.set_data_from_numpy(value, binary_data=True)
        inputs.append(t)
    data, json_size = _get_inference_request(
        inputs=inputs, request_id=request_id, outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)],
        sequence_id=0, sequence_start=False, sequence_end=False, priority=0, timeout=None, custom_parameters=None)
    assert json_size is not None
    return data if isinstance(data, bytes) else data.encode(), json_size


def _post(url: str, model: str, body: bytes, header_length: int) -> tuple[int, bytes]:
    """(status, the answer's JSON: an error's body, or a binary answer's JSON header)."""
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=body,
                                 headers={"Content-Type": "application/octet-stream",
                                          "Inference-Header-Content-Length": str(header_length)})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            answer = resp.read()
            return resp.status, answer[:int(resp.headers["Inference-Header-Content-Length"])]
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_bad_body_or_model_after_good_requests_is_the_same_error(stack: Any) -> None:
    url = stack.gateway.http
    good, header_length = _body(f32(1), f32(2), "bad-after-good")
    for _ in range(3):  # the template, then requests made from it
        status, answer = _post(url, "add_sub", good, header_length)
        assert status == 200 and json.loads(answer)["id"] == "bad-after-good"
    short = (good[:-1], "input 'INPUT1': binary_data_size is 64 bytes but only 63 bytes of binary data are left "
                        "in the request body (truncated body?)")
    long = (good + b"\x00", "the request body has 1 bytes after the binary data of the last binary input 'INPUT1'; "
                            "the binary_data_size values do not add up to the body")
    for body, message in (short, long, short):
        status, answer = _post(url, "add_sub", body, header_length)
        assert (status, json.loads(answer)) == (400, {"error": message})
        assert _post(url, "add_sub", good, header_length)[0] == 200  # and the next good one is answered
    # a model the service does not have: the same error for the first request of its template and the rest
    errors = {_post(url, "no_such_model", good, header_length) for _ in range(3)}
    assert len(errors) == 1
    (status, answer), = errors
    assert status in (400, 404) and b"no_such_model" in answer
    with httpclient.InferenceServerClient(url) as client:  # tritonclient reads the 400 as Triton's error
        t0 = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        t0.set_data_from_numpy(f32(3), binary_data=True)
        t1 = httpclient.InferInput("INPUT1", [1, 16], "FP32")
        t1.set_data_from_numpy(f32(4), binary_data=True)
        for _ in range(2):
            assert client.infer("add_sub", [t0, t1]).as_numpy("OUTPUT0") is not None
        t1._raw_data = t1._raw_data[:60]  # (the client's own check passed: 60 bytes on the wire)
        try:
            client.infer("add_sub", [t0, t1])
        except InferenceServerException as exc:
            assert "binary_data_size is 64 bytes but only 60 bytes" in str(exc)
        else:
            raise AssertionError("a truncated tensor was answered")


def test_concurrent_binary_clients_through_the_gateway_get_their_own_rows(stack: Any) -> None:
    def answered(c: Any, i: int, a: np.ndarray, b: np.ndarray) -> bool:
        r = add_sub(c, a, b, f"c{i}")
        return bool(np.array_equal(r.as_numpy("OUTPUT0"), a + b)) and bool(np.array_equal(r.as_numpy("OUTPUT1"), a - b)) \
            and r.get_response().get("id") == f"c{i}"

    json_template.clients_get_their_own_rows(stack.gateway.http, answered, 15)


def test_repeated_header_fields_and_compression_are_read_as_before(stack: Any) -> None:
    """The infer handler reads Inference-Header-Content-Length, Content-Length and
    Accept-Encoding from the one-value map where no field name is repeated, else the first value
    of the field (Request.header): a repeated field, and a compressed answer, through the gateway."""
    import gzip
    import socket

    from tests.support.http1 import read_answer

    good, header_length = _body(f32(5), f32(6))
    host, port = stack.gateway.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        f = sock.makefile("rb")
        for extra in (b"", b"X-Dup: 1\r\nX-Dup: 2\r\n", b"Accept-Encoding: gzip\r\n",
                      b"Accept-Encoding: gzip\r\nX-Dup: 1\r\nX-Dup: 2\r\n", b""):
            sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: %d\r\n"
                         b"Content-Length: %d\r\n%b\r\n%b" % (header_length, len(good), extra, good))
            answer = read_answer(f)
            assert answer.status == 200, answer.body
            data = gzip.decompress(answer.body) if b"gzip" in extra else answer.body
            assert answer.headers.get("content-encoding") == ("gzip" if b"gzip" in extra else None)
            hl = int(answer.headers["inference-header-content-length"])
            out = np.frombuffer(data[hl:hl + 64], np.float32)
            np.testing.assert_array_equal(out, (f32(5) + f32(6))[0])
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: %d\r\n"
                     b"Inference-Header-Content-Length: 7\r\nContent-Length: %d\r\n\r\n%b" % (header_length, len(good), good))
        answer = read_answer(f)  # a repeated length: its first value is read
        assert answer.status == 200, answer.body
