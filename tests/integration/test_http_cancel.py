"""A client that leaves cancels its request in the service (issue 30, item 6; Triton has the gap,
server#7077): over HTTP and gRPC, straight to the
python service and through the gateway (which tells its service on the hop). The model
`cancel_probe` marks what it saw in files: `started-T` when its execute() took request T, then
`cancelled-T` once `request.is_cancelled()` turned true (it polls it); a request with a negative T
answers at once. It has one instance and no batching, so a second request waits in the queue.
The statistics count a cancelled request as failed with reason CANCELED (Triton's
nv_inference_request_failure reason), once, whether it was queued or running.

Clients are tritonclient's asyncio clients, cancelled as an application's timeout cancels them
(the HTTP client closes its connection; the gRPC client resets its stream)."""
from __future__ import annotations

import asyncio
import itertools
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio

from tests.conftest import Proc, _wait_http_ready, start
from tests.models import python_models
from tests.support.metrics import metric
from tests.support.waiting import eventually

MODEL = "cancel_probe"

CANCEL_PROBE = python_models.with_helpers('''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marks = os.path.join(args["model_repository"], "marks")

    def mark(self, what, tag):
        open(os.path.join(self.marks, f"{what}-{tag}"), "w").close()

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            tag = int(x.reshape(-1)[0])
            self.mark("started", tag)
            if tag >= 0 and until_cancelled([r], 30):
                self.mark("cancelled", tag)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
''', python_models.UNTIL_CANCELLED)


@dataclass
class Mesh:
    service: Proc
    gateway: Proc
    marks: Path


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    repo = tmp_path_factory.mktemp("cancel_models")
    folder = python_models.write(repo, MODEL, CANCEL_PROBE, python_models.config(
        MODEL, [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")],
        extra="instance_group [ { count: 1 kind: KIND_CPU } ]\n"))
    (folder / "marks").mkdir()
    procs: list[Proc] = []
    try:
        procs.append(start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"]))
        procs.append(start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", procs[0].grpc]))
        _wait_http_ready(procs[-1].http)
        yield Mesh(procs[0], procs[1], folder / "marks")
    finally:
        for p in reversed(procs):
            p.stop()


# (protocol, where): the service's own front door or a gateway's
TARGETS = [("http", "service"), ("http", "gateway"), ("grpc", "service"), ("grpc", "gateway")]
_tags = itertools.count(1)


def _url(mesh: Mesh, proto: str, where: str) -> str:
    proc: Proc = getattr(mesh, where)
    return proc.http if proto == "http" else proc.grpc


async def _infer(proto: str, url: str, tag: int) -> object:
    m = httpaio if proto == "http" else grpcaio
    inp = m.InferInput("X", [1], "FP32")
    inp.set_data_from_numpy(np.array([tag], dtype=np.float32))
    client = m.InferenceServerClient(url)
    try:
        return await client.infer(MODEL, [inp])
    finally:
        await client.close()


def _stats(mesh: Mesh) -> tuple[int, int, float, float]:
    """(success count, fail count) from the statistics extension, and the CANCELED failures and
    pending requests from /metrics: all the service's own."""
    with urllib.request.urlopen(f"http://{mesh.service.http}/v2/models/{MODEL}/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    labels = {"model": MODEL, "version": "1"}
    return (stats["success"]["count"], stats["fail"]["count"],
            metric(mesh.service.http, "nv_inference_request_failure", reason="CANCELED", **labels),
            metric(mesh.service.http, "nv_inference_pending_request_count", **labels))


def _marked(mesh: Mesh, what: str, tag: int) -> bool:
    return (mesh.marks / f"{what}-{tag}").exists()


async def _leave(task: asyncio.Task[object]) -> None:
    """The client gives up on its request (as asyncio.wait_for's timeout would)."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _poll(check: object, what: str, timeout: float = 20) -> None:
    await asyncio.to_thread(eventually, check, timeout, what)


@pytest.mark.parametrize(("proto", "where"), TARGETS)
def test_a_client_that_leaves_cancels_its_running_request(mesh: Mesh, proto: str, where: str) -> None:
    """The model's request.is_cancelled() turns true once its client is gone, and the statistics
    count the request once, as a CANCELED failure (not as a success when execute() returns)."""
    tag = next(_tags)
    url = _url(mesh, proto, where)
    success, fail, canceled, _ = _stats(mesh)

    async def run() -> None:
        task = asyncio.ensure_future(_infer(proto, url, tag))
        await _poll(lambda: _marked(mesh, "started", tag), "the model started the request")
        assert not _marked(mesh, "cancelled", tag)  # (the model waits for the cancellation)
        await _leave(task)
        await _poll(lambda: _marked(mesh, "cancelled", tag), "the model saw request.is_cancelled()")

    asyncio.run(run())
    eventually(lambda: _stats(mesh)[1:3] == (fail + 1, canceled + 1) and _stats(mesh)[3] == 0,
               what="one more CANCELED failure, nothing pending")
    # the model's answer after the cancellation is not counted as a success (nor twice)
    assert asyncio.run(_infer(proto, url, -1)) is not None
    eventually(lambda: _stats(mesh)[0] == success + 1, what="the next request's success")
    assert _stats(mesh)[1:3] == (fail + 1, canceled + 1)


@pytest.mark.parametrize(("proto", "where"), TARGETS)
def test_a_queued_request_whose_client_leaves_leaves_the_queue(mesh: Mesh, proto: str, where: str) -> None:
    """With the one instance busy, a second request waits in the queue; its client leaving takes
    it out (counted as CANCELED): it never reaches execute(), and the request after it runs."""
    running, queued = next(_tags), next(_tags)
    url = _url(mesh, proto, where)
    success, fail, canceled, _ = _stats(mesh)

    async def run() -> None:
        first = asyncio.ensure_future(_infer(proto, url, running))
        await _poll(lambda: _marked(mesh, "started", running), "the first request runs")
        second = asyncio.ensure_future(_infer(proto, url, queued))
        await _poll(lambda: _stats(mesh)[3] == 2, "the second request is queued")
        await _leave(second)
        await _poll(lambda: _stats(mesh)[2:] == (canceled + 1, 1), "the queued request left the queue")
        assert not _marked(mesh, "cancelled", running)  # the running one is not touched
        await _leave(first)
        await _poll(lambda: _marked(mesh, "cancelled", running), "the running request is cancelled")
        # FIFO: a request still queued would run before this one
        assert await _infer(proto, url, -1) is not None

    asyncio.run(run())
    assert not _marked(mesh, "started", queued), "the cancelled queued request reached the model"
    eventually(lambda: _stats(mesh)[:3] == (success + 1, fail + 2, canceled + 2), what="2 CANCELED, 1 success")
