"""Decoupled python models through ServiceCore.infer_stream (the contract the front ends call),
with real worker processes: every response in order, the final flag, Triton's unary error, and a
worker that dies mid-stream. The gateway's streaming of them is tested end to end once the
front ends route ModelStreamInfer to infer_stream (branch gwstream)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import UNARY_DECOUPLED_GRPC, UNARY_DECOUPLED_HTTP, RequestContext
from services.base.control import ModelControl
from services.python.core import PythonServiceCore
from services.python.model import PythonModelVersion
from tests.conftest import Proc, _wait_http_ready, start
from tests.models import python_models
from tests.support.metrics import metric
from tests.support.waiting import eventually

MODELS = frozenset({"repeat_int32", "square_int32", "py_add_sub"})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return python_models.build(tmp_path_factory.mktemp("decoupled"), instances=1)


@contextlib.contextmanager
def started(repo: Path, models: frozenset[str] = MODELS) -> Iterator[tuple[PythonServiceCore, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    c = PythonServiceCore("python", repo, {})
    c.control = ModelControl("explicit", models)
    loop.run_until_complete(c.start())
    try:
        yield c, loop
    finally:
        loop.run_until_complete(c.stop())
        loop.close()


@pytest.fixture
def core(repo: Path) -> Iterator[tuple[PythonServiceCore, asyncio.AbstractEventLoop]]:
    with started(repo) as running:
        yield running


def request(model: str, **inputs: np.ndarray) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model)
    for name, arr in inputs.items():
        req.inputs.add(name=name, datatype={np.int32: "INT32", np.uint32: "UINT32", np.float32: "FP32"}[arr.dtype.type],
                       shape=list(arr.shape))
        req.raw_input_contents.append(arr.tobytes())
    return req


def collect(c: PythonServiceCore, loop: asyncio.AbstractEventLoop, req: pb.ModelInferRequest) -> list:
    async def run() -> list:
        return [(None if r is None else r.message(), final)
                async for r, final in c.infer_stream(req, RequestContext("grpc"))]
    return loop.run_until_complete(run())


def ints(msg: pb.ModelInferResponse, name: str) -> list[int]:
    i = [o.name for o in msg.outputs].index(name)
    dtype = np.int32 if msg.outputs[i].datatype == "INT32" else np.uint32
    return np.frombuffer(msg.raw_output_contents[i], dtype=dtype).tolist()


def test_repeat_int32_streams_each_response_then_the_empty_final(core) -> None:
    c, loop = core
    answers = collect(c, loop, request("repeat_int32", IN=np.array([4, 5, 6], np.int32),
                                       DELAY=np.array([5, 5, 5], np.uint32)))
    assert [(ints(m, "OUT"), ints(m, "IDX"), final) for m, final in answers[:-1]] == \
        [([4], [0], False), ([5], [1], False), ([6], [2], False)]
    assert answers[-1] == (None, True)


def test_square_int32_responds_from_execute(core) -> None:
    c, loop = core
    answers = collect(c, loop, request("square_int32", IN=np.array([3], np.int32)))
    assert [ints(m, "OUT") for m, _ in answers[:-1]] == [[3], [3], [3]]
    assert answers[-1] == (None, True)
    assert collect(c, loop, request("square_int32", IN=np.array([0], np.int32))) == [(None, True)]


def test_unary_on_a_decoupled_model_is_tritons_error_and_a_plain_model_streams_once(core) -> None:
    c, loop = core
    assert c.is_decoupled("square_int32", "") and not c.is_decoupled("py_add_sub", "")
    with pytest.raises(InferError) as err:
        c.is_decoupled("nope", "")
    assert err.value.code == Code.NOT_FOUND
    with pytest.raises(InferError) as err:
        loop.run_until_complete(c.infer(request("square_int32", IN=np.array([3], np.int32)), RequestContext("grpc")))
    assert err.value.code == Code.INVALID_ARG and err.value.message == UNARY_DECOUPLED_GRPC  # Triton: UNIMPLEMENTED
    with pytest.raises(InferError) as err:
        loop.run_until_complete(c.infer(request("square_int32", IN=np.array([3], np.int32)), RequestContext("http")))
    assert err.value.code == Code.INVALID_ARG and err.value.message == UNARY_DECOUPLED_HTTP  # Triton: 501
    x = np.ones((1, 16), np.float32)
    (answer,) = collect(c, loop, request("py_add_sub", INPUT0=x, INPUT1=x))
    assert answer[1] is True and np.frombuffer(answer[0].raw_output_contents[0], np.float32).tolist() == [2.0] * 16


def test_a_worker_that_dies_mid_stream_ends_the_stream_with_unavailable(core) -> None:
    c, loop = core
    mv = c.models["repeat_int32"].versions[1]
    assert isinstance(mv, PythonModelVersion)
    pid = mv.workers[0].pid
    assert pid is not None

    async def run() -> tuple[list, InferError]:
        got = []
        stream = c.infer_stream(request("repeat_int32", IN=np.arange(5, dtype=np.int32),
                                        DELAY=np.array([1, 2000, 1, 1, 1], np.uint32)), RequestContext("grpc"))
        with pytest.raises(InferError) as err:
            async for _, final in stream:
                got.append(final)
                os.kill(pid, signal.SIGKILL)  # after the first response
        return got, err.value

    got, err = loop.run_until_complete(run())
    assert got == [False]
    assert err.code == Code.UNAVAILABLE and "Stub process 'repeat_int32_0_0' is not healthy" in err.message


def test_a_stream_closed_early_cancels_the_request_in_the_model(repo: Path, capfd: pytest.CaptureFixture[str]) -> None:
    with started(repo) as (c, loop):  # started here: its workers' stderr is the captured one
        cancelled_early(c, loop, capfd)


def cancelled_early(c: PythonServiceCore, loop: asyncio.AbstractEventLoop, capfd: pytest.CaptureFixture[str]) -> None:
    async def first_only() -> bool:
        stream = c.infer_stream(request("repeat_int32", IN=np.arange(10, dtype=np.int32),
                                        DELAY=np.array([1] + [1000] * 9, np.uint32)), RequestContext("grpc"))
        final = True
        async for _, final in stream:  # noqa: B007 (the last value is the point)
            break  # the client goes away after the first response
        await stream.aclose()  # type: ignore[attr-defined]
        return final

    assert loop.run_until_complete(first_only()) is False
    seen: list[str] = []  # the worker logs to the service's stderr (here: this process's)

    def logged() -> bool:
        seen.append(capfd.readouterr().err)
        return "repeat_int32: request cancelled after" in "".join(seen)  # (a model not told runs 9 s more)

    eventually(logged, timeout=10, what="the model saw request.is_cancelled()")


# ---- statistics, through a running service (and a gateway) with the real tritonclient ---------------


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[tuple[Proc, Proc]]:
    procs: list[Proc] = []
    try:
        procs.append(start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                            "--model-control-mode", "explicit", "--load-model", "repeat_int32"]))
        procs.append(start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", procs[0].grpc]))
        _wait_http_ready(procs[1].http)
        yield procs[0], procs[1]
    finally:
        for p in reversed(procs):
            p.stop()


def _stats(service: Proc) -> tuple[int, int, float]:
    """(success count, fail count) of repeat_int32 from the statistics extension, and its CANCELED
    failures from /metrics: the service's own."""
    with urllib.request.urlopen(f"http://{service.http}/v2/models/repeat_int32/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    return (stats["success"]["count"], stats["fail"]["count"],
            metric(service.http, "nv_inference_request_failure", reason="CANCELED", model="repeat_int32", version="1"))


def _stream(url: str, n: int, delay_ms: int, leave_after: int | None) -> list[int]:
    """A gRPC stream of one repeat_int32 request (``n`` responses, ``delay_ms`` apart, from a
    thread of the model: its execute() returns at once); the client stops the stream (cancelling
    the request) after ``leave_after`` responses, or reads them all and the final."""
    got: list[int] = []
    finals: list[bool] = []
    errors: list[object] = []

    def on(result: grpcclient.InferResult | None, error: object) -> None:
        if result is None:  # (stop_stream(cancel_requests=True) reports CANCELLED here)
            errors.append(error)
            return
        resp = result.get_response()
        if resp.outputs:
            got.append(int(result.as_numpy("OUT")[0]))
        if resp.parameters["triton_final_response"].bool_param:
            finals.append(True)

    ins = [grpcclient.InferInput("IN", [n], "INT32"), grpcclient.InferInput("DELAY", [n], "UINT32")]
    ins[0].set_data_from_numpy(np.arange(n, dtype=np.int32))
    ins[1].set_data_from_numpy(np.array([1] + [delay_ms] * (n - 1), dtype=np.uint32))
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=on)
        c.async_stream_infer("repeat_int32", ins, enable_empty_final_response=True)
        if leave_after is None:
            eventually(lambda: bool(finals or errors), timeout=20, what="the final response")
            c.stop_stream()
        else:
            eventually(lambda: len(got) >= leave_after or bool(errors), timeout=20, what=f"{leave_after} responses")
            assert not errors, errors
            c.stop_stream(cancel_requests=True)
    assert leave_after is not None or (finals and not errors), errors
    return got


@pytest.mark.parametrize("where", ["service", "gateway"])
def test_a_decoupled_request_is_counted_once_when_it_ends(served: tuple[Proc, Proc], where: str) -> None:
    """A decoupled request counts once, when it ends, not when its execute() returns (its
    responses come later, from a thread): a success once its final response is out; CANCELED
    when its client leaves before it, execute() long returned (docs/streaming.md)."""
    service, gateway = served
    url = (service if where == "service" else gateway).grpc
    success, fail, canceled = _stats(service)
    assert _stream(url, 3, 0, None) == [0, 1, 2]
    eventually(lambda: _stats(service) == (success + 1, fail, canceled), what="one success")
    # execute() returns at once; the second response comes 1 s after the first: the client leaves between
    assert _stream(url, 10, 1000, 1) == [0]
    eventually(lambda: _stats(service)[1:] == (fail + 1, canceled + 1), what="one CANCELED failure")
    assert _stats(service)[0] == success + 1  # not a success as well
