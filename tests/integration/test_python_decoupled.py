"""Decoupled python models through ServiceCore.infer_stream (the contract the front ends call),
with real worker processes: every response in order, the final flag, Triton's unary error, and a
worker that dies mid-stream. The gateway's streaming of them is tested end to end once the
front ends route ModelStreamInfer to infer_stream (branch gwstream)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import UNARY_DECOUPLED_GRPC, UNARY_DECOUPLED_HTTP, RequestContext
from services.base.control import ModelControl
from services.python.core import PythonServiceCore
from services.python.model import PythonModelVersion
from tests.models import python_models
from tests.support.waiting import eventually

MODELS = frozenset({"repeat_int32", "square_int32", "py_add_sub"})


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return python_models.build(tmp_path_factory.mktemp("decoupled"), instances=1)


@contextlib.contextmanager
def started(repo: Path) -> Iterator[tuple[PythonServiceCore, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    c = PythonServiceCore("python", repo, {})
    c.control = ModelControl("explicit", MODELS)
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
