"""HTTP/1.1 conformance of the front door (meshserve/server/http1, on httptools' llhttp) on real
processes: an ONNX service and a gateway in front of it. The real
tritonclient (sync with concurrency > 1, and aio) and raw sockets: pipelining, chunked bodies,
`Expect: 100-continue`, keep-alive, HTTP/1.0, idle and header timeouts, malformed requests.

The other HTTP suites (test_http_limits, test_protocol, test_shared_memory, tests/adversarial)
run on the same server (the only one)."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient

from tests.conftest import Proc, _wait_http_ready, start
from tests.support.http1 import Answer, connect, idle_then_ask, read_answer

IDLE_TIMEOUT = 3.0
HEADER_TIMEOUT = 1.0  # the keep-alive test idles past it (+1.2 s), under IDLE_TIMEOUT
FLAGS = ["--idle-timeout-s", str(IDLE_TIMEOUT), "--header-timeout-s",
         str(HEADER_TIMEOUT), "--max-request-bytes", str(1 << 20)]


@pytest.fixture(scope="module")
def procs(model_repo) -> Iterator[dict[str, Proc]]:
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                     "--metrics-port", "0", *FLAGS])
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc, *FLAGS])
    except Exception:
        service.stop()
        raise
    try:
        _wait_http_ready(service.http)
        _wait_http_ready(gateway.http)
        yield {"gateway": gateway, "service": service}
    finally:
        gateway.stop()
        service.stop()


@pytest.fixture(params=["gateway", "service"])
def proc(request: pytest.FixtureRequest, procs: dict[str, Proc]) -> Proc:
    return procs[request.param]


def inputs(a: np.ndarray, b: np.ndarray, binary: bool, mod: object = httpclient) -> list:
    out = [mod.InferInput("INPUT0", list(a.shape), "FP32"), mod.InferInput("INPUT1", list(b.shape), "FP32")]  # type: ignore[attr-defined]
    out[0].set_data_from_numpy(a, binary_data=binary)
    out[1].set_data_from_numpy(b, binary_data=binary)
    return out


def rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.arange(16 * n, dtype=np.float32).reshape(n, 16)
    return a, np.full_like(a, 2.0)


# ---- the real tritonclient -------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_sync_with_concurrency(proc: Proc, binary: bool) -> None:
    with httpclient.InferenceServerClient(proc.http, concurrency=8) as client:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_model_metadata("add_sub")["name"] == "add_sub"
        pending = []
        for i in range(64):
            a, b = rows(1 + i % 4)
            outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
                       httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
            pending.append((a, b, client.async_infer("add_sub", inputs(a, b, binary), outputs=outputs,
                                                     request_id=str(i))))
        for i, (a, b, job) in enumerate(pending):
            result = job.get_result(timeout=60)
            assert result.get_response()["id"] == str(i)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        stats = client.get_inference_statistics("add_sub")
        assert stats["model_stats"][0]["inference_count"] >= 64


def test_tritonclient_aio(proc: Proc) -> None:
    async def main() -> None:
        async with aiohttpclient.InferenceServerClient(proc.http) as client:
            assert await client.is_server_ready()

            async def one(i: int) -> None:
                a, b = rows(1 + i % 3)
                result = await client.infer("add_sub", inputs(a, b, i % 2 == 0, aiohttpclient))
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)

            await asyncio.gather(*(one(i) for i in range(32)))
            with pytest.raises(Exception, match="unknown model|not found"):
                await client.infer("no_such_model", inputs(*rows(1), True, aiohttpclient))

    asyncio.run(main())


def test_tritonclient_errors_keep_their_status(proc: Proc) -> None:
    with httpclient.InferenceServerClient(proc.http) as client:
        a, _ = rows(1)
        bad = [httpclient.InferInput("INPUT0", [1, 16], "FP32")]
        bad[0].set_data_from_numpy(a)
        with pytest.raises(Exception) as info:
            client.infer("add_sub", bad)
        assert "INPUT1" in str(info.value)
        assert client.is_model_ready("add_sub")  # the connection pool goes on


# ---- raw sockets -----------------------------------------------------------------------------------

def infer_bytes(i: int, binary: bool) -> tuple[bytes, dict[str, str], np.ndarray]:
    a, b = rows(1 + i % 3)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        inputs(a, b, binary), outputs=outputs, request_id=str(i))
    headers = {"Inference-Header-Content-Length": str(json_size)} if json_size is not None else {}
    return body, headers, a + b


def request(path: str, body: bytes, headers: dict[str, str], chunked: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if chunked:
        mid = len(body) // 2
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:mid], body[mid:]) if p) + b"0\r\n\r\n"
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + payload
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def output0(answer: Answer) -> tuple[str, np.ndarray]:
    status, _, headers, body = answer
    assert status == 200, body
    n = int(headers.get("inference-header-content-length", len(body)))
    meta = json.loads(body[:n])
    out = meta["outputs"][0]
    data = np.frombuffer(body[n:], np.float32) if n < len(body) else np.array(out["data"], np.float32)
    return meta["id"], data.reshape(out["shape"])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_pipelined_infers_are_answered_in_order(proc: Proc, chunked: bool) -> None:
    jobs = [infer_bytes(i, binary=i % 2 == 0) for i in range(20)]
    with connect(proc.http) as sock:
        sock.sendall(b"".join(request("/v2/models/add_sub/infer", body, headers, chunked) for body, headers, _ in jobs))
        f = sock.makefile("rb")
        for i, (_, _, want) in enumerate(jobs):
            got_id, got = output0(read_answer(f))
            assert got_id == str(i)
            np.testing.assert_array_equal(got, want)
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")  # and the connection is still open
        assert read_answer(f).status == 200


def test_expect_100_continue(proc: Proc) -> None:
    body, headers, want = infer_bytes(7, binary=True)
    with connect(proc.http) as sock:
        head = request("/v2/models/add_sub/infer", body, {**headers, "Expect": "100-continue"}).split(b"\r\n\r\n", 1)[0]
        sock.sendall(head + b"\r\n\r\n")
        f = sock.makefile("rb")
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"  # before the body
        sock.sendall(body)
        np.testing.assert_array_equal(output0(read_answer(f))[1], want)
        # over the limit: no 100 Continue, a 413 at once, and the connection ends
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % (2 << 20))
        status, _, answer_headers, answer = read_answer(f)
        assert status == 413 and answer_headers["connection"] == "close", answer
        assert f.read() == b""


# what curl --http2 sends on an http:// URL (Java's HttpClient asks the same): no upgrade is
# offered, so the request, its body and the requests after it are HTTP/1.1 (RFC 9110 7.8)
H2C_UPGRADE = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA"}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_h2c_upgrade_asked_for_is_ignored_and_the_infer_answered(proc: Proc, chunked: bool) -> None:
    jobs = [infer_bytes(i, binary=i == 1) for i in range(3)]
    with connect(proc.http) as sock:
        sock.sendall(b"".join(request("/v2/models/add_sub/infer", body, {**headers, **H2C_UPGRADE}, chunked)
                              for body, headers, _ in jobs))
        f = sock.makefile("rb")
        for i, (_, _, want) in enumerate(jobs):  # (the body was b"" before: 400 "failed to parse the request JSON")
            got_id, got = output0(read_answer(f))
            assert got_id == str(i)
            np.testing.assert_array_equal(got, want)
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(f).status == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine (the raw test above sends its bytes)")
def test_curl_http2_on_an_http_url(proc: Proc) -> None:
    body, _, want = infer_bytes(5, binary=False)
    done = subprocess.run(["curl", "-sS", "--http2", "--max-time", "30", "-H", "Content-Type: application/json",
                           "--data-binary", "@-", f"http://{proc.http}/v2/models/add_sub/infer"],
                          input=body, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["id"] == "5", answer
    np.testing.assert_array_equal(np.array(answer["outputs"][0]["data"], np.float32).reshape(want.shape), want)


def test_http10_and_connection_close(proc: Proc) -> None:
    with connect(proc.http) as sock:
        # (Accept: JSON asks the health answer's body; Triton's has none: test_health_and_clients.py)
        sock.sendall(b"GET /v2/health/live HTTP/1.0\r\nAccept: application/json\r\n\r\n")
        f = sock.makefile("rb")
        assert f.readline().startswith(b"HTTP/1.0 200")
        assert f.read().endswith(b'{"live":true}')  # then closed
    with connect(proc.http) as sock:
        body, headers, want = infer_bytes(1, binary=False)
        sock.sendall(request("/v2/models/add_sub/infer", body, {**headers, "Connection": "close"}))
        f = sock.makefile("rb")
        answer = read_answer(f)
        np.testing.assert_array_equal(output0(answer)[1], want)
        assert answer.headers["connection"] == "close" and f.read() == b""


def test_keepalive_many_requests_then_the_idle_timeout(proc: Proc) -> None:
    with connect(proc.http) as sock:
        f = sock.makefile("rb")
        for i in range(200):
            sock.sendall(b"GET /v2/models/add_sub/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, headers, _ = read_answer(f)
            assert status == 200, i
            assert "server" not in headers  # (aiohttp's server would name itself: this is the httptools one)
        idle_then_ask(sock, f, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n", HEADER_TIMEOUT + 1.2)
        t0 = time.monotonic()
        sock.settimeout(IDLE_TIMEOUT + 5)
        assert sock.recv(10) == b""  # closed by the idle timeout
        assert time.monotonic() - t0 >= IDLE_TIMEOUT * 0.8


@pytest.mark.parametrize("raw", [
    b"NOT HTTP\r\n\r\n",
    b"GET /v2 HTTP/1.1\r\nno-colon-here\r\n\r\n",
    b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /v2/models/add_sub/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nnot-hex\r\n",
    b"GET /v2 HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
    # request smuggling through an HTTP/1.0 hop (RFC 9112 6.1): the GET after the chunks went unanswered
    b"POST /v2/models/add_sub/infer HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v2/models/mlp HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v2/health/ready HTTP/2.0\r\nHost: x\r\n\r\n",
], ids=["garbage", "no-colon", "two-lengths", "bad-chunk", "long-field", "http10-chunked", "http20"])
def test_malformed_requests_are_400_and_close(proc: Proc, raw: bytes) -> None:
    with connect(proc.http) as sock:
        sock.sendall(raw)
        f = sock.makefile("rb")
        status, _, headers, body = read_answer(f)
        assert status == 400 and headers["connection"] == "close", body
        assert "error" in json.loads(body)
        assert f.read() == b""
    with httpclient.InferenceServerClient(proc.http) as client:  # the process serves on
        assert client.is_server_ready()


def test_metrics_port_on_httptools(procs: dict[str, Proc]) -> None:
    hostport = f"127.0.0.1:{procs['service'].ports['metrics']}"
    with connect(hostport) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        f = sock.makefile("rb")
        status, _, _, body = read_answer(f)
        assert status == 200 and b"nv_inference_request_success" in body
        assert read_answer(f).status == 404
