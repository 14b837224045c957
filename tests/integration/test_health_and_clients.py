"""Health endpoints as Triton answers them (and with a JSON body for clients that read one), --server-name, and the KServe Python SDK's clients
(`kserve.InferenceRESTClient` / `InferenceGRPCClient`) against a real gateway."""
from __future__ import annotations

import http.client
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import Proc, Stack, _wait_http_ready, start


@pytest.fixture(scope="module")
def triton_named(stack: Stack) -> Iterator[Proc]:
    """A gateway called "triton" (NVIDIA's examples check the name) in front of the session's service."""
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc,
               "--server-name", "triton"])
    _wait_http_ready(g.http)
    yield g
    g.stop()


def _probe(hostport: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
    """GET PATH as curl sends it (no Content-Type, Accept */*): (status, body, Content-Type)."""
    host, port = hostport.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path, headers={"Accept": "*/*", "User-Agent": "curl/8.5.0", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("Content-Type") or ""
    finally:
        conn.close()


JSON = {"Accept": "application/json"}
KSERVE = {"User-Agent": "python-httpx/0.28.1"}  # the KServe SDK's InferenceRESTClient (Accept */*)


def test_health_answers_as_triton_and_json_to_clients_that_read_it(stack: Stack) -> None:
    """Triton's health answer is its status, 200 or 400, with an empty body: NVIDIA's QA waits for
    ``curl -s -w %{http_code}`` to print exactly 200 (qa/common/util.sh). A client that reads a body
    (Accept: application/json, the KServe SDK) gets {"ready": true} with the same status."""
    for hostport in (stack.gateway.http, stack.service.http):
        for probe in ("live", "ready"):
            path = f"/v2/health/{probe}"
            assert _probe(hostport, path) == (200, b"", "text/plain"), (hostport, probe)
            for headers in (JSON, KSERVE):
                status, body, ctype = _probe(hostport, path, headers)
                assert (status, json.loads(body), ctype) == (200, {probe: True}, "application/json"), (hostport, headers)
    # a gateway whose only upstream is not there: live, not ready (Triton: 400, "4xx is false")
    lonely = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", "127.0.0.1:9"])
    try:
        assert _probe(lonely.http, "/v2/health/live") == (200, b"", "text/plain")
        assert _probe(lonely.http, "/v2/health/ready") == (400, b"", "text/plain")
        for headers in (JSON, KSERVE):
            status, body, _ = _probe(lonely.http, "/v2/health/ready", headers)
            assert (status, json.loads(body)) == (400, {"ready": False})
        with httpclient.InferenceServerClient(lonely.http) as c:
            assert c.is_server_live() and not c.is_server_ready()
        with grpcclient.InferenceServerClient(lonely.grpc) as g:
            assert g.is_server_live() and not g.is_server_ready()
    finally:
        lonely.stop()


def test_server_name(stack: Stack, triton_named: Proc) -> None:
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        assert c.get_server_metadata()["name"] == "meshserve"
    with httpclient.InferenceServerClient(triton_named.http) as c:
        assert c.get_server_metadata()["name"] == "triton"
    with grpcclient.InferenceServerClient(triton_named.grpc) as g:
        assert g.get_server_metadata().name == "triton"


def test_service_server_name(model_repo) -> None:
    svc = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0",
                 "--server-name", "triton", "--model-control-mode", "explicit"])  # no model loaded: quick
    try:
        with grpcclient.InferenceServerClient(svc.grpc) as g:
            assert g.get_server_metadata().name == "triton"
    finally:
        svc.stop()


# Run in its own interpreter: kserve's protos define the `inference.*` messages again under another
# file name, which the protobuf registry refuses next to tritonclient's (imported by this module).
# kserve is not a dependency (pip install kserve: 70 packages, 451 MB, ~1 min; it pins psutil<6 and
# moves pydantic/orjson): the test runs where this interpreter has it, or with the Python that
# MESHSERVE_KSERVE_PYTHON names (a venv with kserve), and skips elsewhere.
KSERVE_CLIENTS = """
import asyncio, sys
import numpy as np
import kserve

http, grpc_url = sys.argv[1], sys.argv[2]
a = np.arange(16, dtype=np.float32).reshape(1, 16)
b = np.full((1, 16), 2, dtype=np.float32)


def request():
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        inp = kserve.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    return kserve.InferRequest(model_name="add_sub", infer_inputs=inputs)


def check(response):
    out = {o.name: o.as_numpy() for o in response.outputs}
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


async def main():
    base = f"http://{http}"
    rest = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0, timeout=30))
    try:
        assert await rest.is_server_live(base) is True
        assert await rest.is_server_ready(base) is True
        assert await rest.is_model_ready(base, "add_sub") is True
        check(await rest.infer(base, request(), model_name="add_sub"))
    finally:
        await rest.close()
    client = kserve.InferenceGRPCClient(grpc_url, retries=0, timeout=30)
    try:
        assert await client.is_server_live() is True
        assert await client.is_server_ready() is True
        assert await client.is_model_ready("add_sub") is True
        check(await client.infer(request()))
    finally:
        await client.close()
    print("KSERVE CLIENTS OK")


asyncio.run(main())
"""


def test_kserve_sdk_rest_and_grpc_clients(triton_named: Proc) -> None:
    python = os.environ.get("MESHSERVE_KSERVE_PYTHON") or \
        (sys.executable if importlib.util.find_spec("kserve") is not None else None)
    if python is None:
        pytest.skip("the kserve package is not installed (pip install kserve, or MESHSERVE_KSERVE_PYTHON=<a "
                    "python with kserve>)")
    proc = subprocess.run([python, "-c", KSERVE_CLIENTS, triton_named.http, triton_named.grpc],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "KSERVE CLIENTS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
