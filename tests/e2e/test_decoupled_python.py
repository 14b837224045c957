"""Decoupled Python-backend models (Triton's repeat_int32 and square_int32 examples, written in
tests/e2e/decoupled_models.py) served by the python service behind a gateway, driven by the real
tritonclient (gRPC streaming) and an SSE client (generate_stream). Every expected body and text
is what Triton 2.51 answered for the same repository and requests (tests/e2e/triton_reference.md);
where meshserve differs on purpose the test says so."""
from __future__ import annotations

import asyncio
import csv
import json
import queue
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

pytest.importorskip("services.python")

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.e2e.decoupled_models import build

NOT_ONE = ("generate expects model to produce exactly 1 response, use generate stream for model that generates "
           "various number of responses")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    repo = build(tmp_path_factory.mktemp("decoupled") / "repo")
    with service_and_gateway("python", ["--repository", str(repo)], timeout=180) as procs:
        yield procs


def ints(name: str, dt: str, values: list[int], module: object = grpcclient) -> object:
    arr = np.array(values, np.int32 if dt == "INT32" else np.uint32)
    t = module.InferInput(name, [arr.size], dt)  # type: ignore[attr-defined]
    t.set_data_from_numpy(arr)
    return t


def repeat_inputs(values: list[int], delays: list[int] | None = None, wait: int = 0) -> list[object]:
    return [ints("IN", "INT32", values), ints("DELAY", "UINT32", delays or [0] * len(values)),
            ints("WAIT", "UINT32", [wait])]


def test_grpc_streaming_through_the_gateway_gets_every_response(mesh: tuple[Proc, Proc]) -> None:
    _, gateway = mesh
    got: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(gateway.grpc)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("repeat_int32", repeat_inputs([4, 2, 0, 1], [10, 10, 10, 10]), request_id="r1")
        client.async_stream_infer("square_int32", [ints("IN", "INT32", [3])], request_id="s3",
                                  enable_empty_final_response=True)
        items = [got.get(timeout=60) for _ in range(8)]
    finally:
        client.stop_stream()
    assert all(error is None for _, error in items), items
    by_id: dict[str, list[tuple[object, bool]]] = {}
    for result, _ in items:
        response = result.get_response()  # type: ignore[attr-defined]
        out = result.as_numpy("OUT")  # type: ignore[attr-defined]
        by_id.setdefault(response.id, []).append(
            (None if out is None else out.tolist(), response.parameters["triton_final_response"].bool_param))
    assert by_id == {"r1": [([4], False), ([2], False), ([0], False), ([1], False)],
                     "s3": [([3], False), ([3], False), ([3], False), (None, True)]}


def test_a_unary_call_on_a_decoupled_model_gets_tritons_error(mesh: tuple[Proc, Proc]) -> None:
    service, gateway = mesh
    for target in (gateway, service):
        with pytest.raises(InferenceServerException) as grpc_err:
            grpcclient.InferenceServerClient(target.grpc).infer("square_int32", [ints("IN", "INT32", [1])])
        # Triton: StatusCode.UNIMPLEMENTED; meshserve: INVALID_ARGUMENT (the call, not the server, is wrong)
        assert grpc_err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert grpc_err.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
        with pytest.raises(InferenceServerException) as http_err:
            httpclient.InferenceServerClient(target.http).infer("square_int32",
                                                                 [ints("IN", "INT32", [1], httpclient)])
        assert http_err.value.status() == "400"  # Triton: 501
        assert http_err.value.message() == "HTTP end point doesn't support models with decoupled transaction policy"


async def _post(url: str, body: object) -> tuple[int, str, list[bytes]]:
    """(status, content type, the body's server-sent events or its one JSON document)."""
    async with aiohttp.ClientSession() as session, session.post(url, data=json.dumps(body).encode()) as resp:
        ctype = resp.headers["Content-Type"]
        if not ctype.startswith("text/event-stream"):
            return resp.status, ctype, [await resp.read()]
        events = []
        while not resp.content.at_eof():
            event = await resp.content.readuntil(b"\n\n")
            if event:
                events.append(event)
        return resp.status, ctype, events


def post(proc: Proc, path: str, body: object) -> tuple[int, str, list[bytes]]:
    return asyncio.run(_post(f"http://{proc.http}{path}", body))


SSE = "text/event-stream; charset=utf-8"


def test_generate_stream_with_an_sse_client(mesh: tuple[Proc, Proc]) -> None:
    service, gateway = mesh
    for target in (gateway, service):  # each service is a full v2 server
        assert post(target, "/v2/models/repeat_int32/generate_stream",
                    {"IN": [4, 2, 0, 1], "DELAY": [0, 0, 0, 0], "WAIT": 0}) == (200, SSE, [
                        b'data: {"IDX":0,"OUT":4,"model_name":"repeat_int32","model_version":"1"}\n\n',
                        b'data: {"IDX":1,"OUT":2,"model_name":"repeat_int32","model_version":"1"}\n\n',
                        b'data: {"IDX":2,"OUT":0,"model_name":"repeat_int32","model_version":"1"}\n\n',
                        b'data: {"IDX":3,"OUT":1,"model_name":"repeat_int32","model_version":"1"}\n\n'])
        assert post(target, "/v2/models/square_int32/generate_stream", {"IN": 2}) == (200, SSE, [
            b'data: {"OUT":2,"model_name":"square_int32","model_version":"1"}\n\n'] * 2)
        assert post(target, "/v2/models/square_int32/generate_stream", {"IN": 0}) == (200, SSE, [])
        status, ctype, events = post(target, "/v2/models/faulty_stream/generate_stream", {"IN": 3})
        assert (status, ctype, events[0]) == (200, SSE, b'data: {"OUT":3,"model_name":"faulty_stream","model_version":"1"}\n\n')
        assert json.loads(events[1].removeprefix(b"data: "))["error"].startswith("faulty_stream failed on 3")
        status, ctype, events = post(target, "/v2/models/repeat_int32/generate_stream",
                                     {"IN": [1, 2], "DELAY": [0], "WAIT": 0})
        # (Triton: 400; here the status of the model error's code)
        assert (status >= 400, ctype, len(events)) == (True, SSE, 1)
        assert "expected IN and DELAY of the same shape" in json.loads(events[0].removeprefix(b"data: "))["error"]


def test_generate(mesh: tuple[Proc, Proc]) -> None:
    service, gateway = mesh
    for target in (gateway, service):
        assert post(target, "/v2/models/text_echo/generate", {"text_input": "hi", "count": 3, "parameters": {"suffix": "!"}}) \
            == (200, "application/json",
                [b'{"lengths":[2,7],"model_name":"text_echo","model_version":"1","text_output":"hihihi!"}'])
        assert post(target, "/v2/models/add_sub_py/generate", {"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 1, 1, 1]}) == (
            200, "application/json",
            [b'{"OUTPUT0":[2.0,3.0,4.0,5.0],"OUTPUT1":[0.0,1.0,2.0,3.0],"model_name":"add_sub_py","model_version":"1"}'])
        assert post(target, "/v2/models/repeat_int32/generate", {"IN": 7, "DELAY": 0, "WAIT": 0}) == (
            200, "application/json", [b'{"IDX":0,"OUT":7,"model_name":"repeat_int32","model_version":"1"}'])
        for body in ({"IN": 3}, {"IN": 0}):  # several responses, or none: Triton answers this with status 200
            status, _, (doc,) = post(target, "/v2/models/square_int32/generate", body)
            assert (status, json.loads(doc)) == (400, {"error": NOT_ONE})
        assert post(target, "/v2/models/nope/generate", {"IN": 1}) == (
            404, "application/json", [b'{"error":"Request for unknown model: \'nope\' is not found"}'])



PERF_ANALYZER = Path(__file__).resolve().parents[3] / "shared" / "tools" / "perf_analyzer"


@pytest.mark.skipif(not PERF_ANALYZER.exists(), reason=f"perf_analyzer wrapper not found at {PERF_ANALYZER}")
def test_perf_analyzer_streams_a_decoupled_model_through_the_gateway(mesh: tuple[Proc, Proc], tmp_path: Path) -> None:
    """Triton's C++ client ends each request on the triton_final_response flag (--async --streaming,
    which it insists on for a decoupled model)."""
    _, gateway = mesh
    data = tmp_path / "square.json"
    data.write_text(json.dumps({"data": [{"IN": [3]}]}))
    report = tmp_path / "pa.csv"
    proc = subprocess.run([str(PERF_ANALYZER), "-m", "square_int32", "-u", gateway.grpc, "-i", "grpc", "--async",
                           "--streaming", "--input-data", str(data), "--concurrency-range", "2",
                           "--measurement-interval", "300", "--stability-percentage", "999", "--max-trials", "8",
                           "-f", str(report)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Detected decoupled model" in proc.stdout
    (row,) = list(csv.DictReader(report.open()))
    assert float(row["Inferences/Second"]) > 10
