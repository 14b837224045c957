"""ModelVersion's parts with a fake runtime: the Hop record (not request parameters) is what it
reads of a gateway's hop; the scheduler is the dynamic batcher, or for a sequence model the
sequence batcher alone; and the server's version comes from the package metadata."""
from __future__ import annotations

import asyncio
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import hop
from meshserve.protocol.errors import InferError
from meshserve.server import core as server_core
from meshserve.server.core import NO_HOP, Hop
from services.base import model
from services.base.model import ModelVersion
from services.base.scheduling import DynamicBatcher, Scheduler
from services.base.scheduling.sequence import SequenceBatcher
from services.sequence.model import SequenceModelVersion
from tests.conftest import ROOT
from tests.support.slow import work_for
from tests.support.waiting import eventually_async

TENSORS = """max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
SEQUENCE = """sequence_batching { control_input [
  { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ] }"""


class Echo:
    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        return {"OUTPUT0": inputs["INPUT0"].copy()}

    def close(self) -> None:
        pass


def _config(name: str, extra: str = "") -> mc.ModelConfig:
    return text_format.Parse(f'name: "{name}" backend: "onnxruntime" {TENSORS} {extra}', mc.ModelConfig())


def _request(rows: int, **params: int) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 1])
    r.raw_input_contents.append(np.arange(rows, dtype=np.float32).tobytes())
    for key, value in params.items():
        r.parameters[key].int64_param = value
    return r


async def test_a_model_version_reads_the_hop_record_not_the_parameters(tmp_path: Path) -> None:
    mv = ModelVersion(_config("m"), 1, tmp_path, [Echo()], "fake")
    try:
        # the parameter is the front door's to read: here it is only a parameter
        body = await mv.infer(_request(2, **{hop.MERGED: 5}), None, NO_HOP)
        assert pb.ModelInferResponse.FromString(body).outputs[0].shape == [2, 1]
        await mv.infer(_request(2), None, Hop(merged=2, queued_ns=1000))
        stats = mv.stats.to_pb()
        assert stats.inference_count == 4 and stats.inference_stats.success.count == 3  # 1 + the 2 merged
        with pytest.raises(InferError, match=r"'meshserve_merged_requests' must be in 1..2, got 3"):
            await mv.infer(_request(2), None, Hop(merged=3))
        with pytest.raises(InferError, match="model 'm': parameter 'meshserve_merged_requests' must be an integer"):
            await mv.infer(_request(2), None, Hop(merged=None))
        with pytest.raises(InferError, match="model 'm': parameter 'meshserve_queued_us' must be an integer"):
            await mv.infer(_request(1), None, Hop(queued_ns=None))
    finally:
        await mv.close()


async def test_each_model_version_has_one_scheduler(tmp_path: Path) -> None:
    plain = ModelVersion(_config("m"), 1, tmp_path, [Echo()], "fake")
    seq = SequenceModelVersion(_config("s", SEQUENCE), 1, tmp_path, [Echo()], "fake")
    try:
        assert isinstance(plain.scheduler, DynamicBatcher) and plain.scheduler is plain.batcher
        assert isinstance(seq.scheduler, SequenceBatcher) and not hasattr(seq, "batcher")
        for version in (plain, seq):
            scheduler: Scheduler = version.scheduler
            assert scheduler.inflight() == 0
        r = _request(1)
        r.parameters["sequence_id"].int64_param = 7
        r.parameters["sequence_start"].bool_param = True
        body = await seq.infer(r, None)
        assert pb.ModelInferResponse.FromString(body).model_name == "s"
    finally:
        await plain.close()
        await seq.close()


def test_the_server_version_is_the_package_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert server_core.SERVER_VERSION == project["version"]


class Timed(Echo):
    """Echo that records the thread of each run, taking ``seconds`` per run."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.threads: list[int] = []

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        self.threads.append(threading.get_ident())
        if self.seconds:
            work_for(self.seconds)
        return super().run(inputs, output_names)


@pytest.mark.parametrize("seconds, bound_ns, inline", [(0.0, 10**9, True), (0.002, 10**6, False), (0.0, 0, False)])
async def test_a_batch_size_measured_to_run_in_microseconds_runs_on_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float, bound_ns: int, inline: bool) -> None:
    monkeypatch.setattr(model, "INLINE_RUN_NS", bound_ns)
    instance = Timed(seconds)
    mv = ModelVersion(_config("m"), 1, tmp_path, [instance], "fake")
    loop_thread = threading.get_ident()
    try:
        for rows in (2, 2, 2, 3):  # the first run of a batch size (2, then 3) is measured on the worker thread
            body = await mv.infer(_request(rows), None)
            out = pb.ModelInferResponse.FromString(body)
            assert np.frombuffer(out.raw_output_contents[0], np.float32).tolist() == list(range(rows))
        on_loop = [t == loop_thread for t in instance.threads]
        assert on_loop == [False, inline, inline, False]
        stats = mv.stats.to_pb()
        assert stats.execution_count == 4 and stats.inference_count == 9
        assert stats.inference_stats.compute_infer.count == 4
    finally:
        await mv.close()


async def test_busy_and_last_use_are_what_an_eviction_reads(tmp_path: Path) -> None:
    """services/base/memory.py: a version with a request in flight or a live sequence is busy
    (never evicted); its last use is its load until a request runs, then that request's end."""
    gate = threading.Event()

    class Held(Echo):
        def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
            gate.wait(10)
            return super().run(inputs, output_names)

    plain = ModelVersion(_config("m"), 1, tmp_path, [Held()], "fake")
    seq = SequenceModelVersion(_config("s", SEQUENCE), 1, tmp_path, [Echo()], "fake")
    try:
        assert not plain.busy() and not seq.busy()
        loaded = plain.last_used_ms()
        assert loaded == plain.loaded_ms and plain.stats.last_inference_ms == 0
        pending = asyncio.ensure_future(plain.infer(_request(1), None))
        await eventually_async(lambda: plain.busy(), what="the request in flight")
        gate.set()
        await pending
        assert not plain.busy() and plain.last_used_ms() >= loaded
        r = _request(1)
        r.parameters["sequence_id"].int64_param = 7
        r.parameters["sequence_start"].bool_param = True
        await seq.infer(r, None)
        assert seq.busy()  # the sequence lives on (no sequence_end): its state would be lost
    finally:
        gate.set()
        await plain.close()
        await seq.close()


async def test_a_cancelled_run_fails_its_members_as_unavailable_not_internal(tmp_path: Path) -> None:
    """A batch whose run is cancelled (the service stopping) fails its members with UNAVAILABLE
    (503 / gRPC UNAVAILABLE) and no exception text; a runtime's own exception stays INTERNAL."""
    mv = ModelVersion(_config("m"), 1, tmp_path, [Echo()], "fake")
    try:
        cancelled = mv._failure(asyncio.CancelledError())
        assert cancelled.code == InferError.unavailable("x").code
        assert "cancelled" in str(cancelled) and "CancelledError" not in str(cancelled)
        assert mv._failure(RuntimeError("boom")).code == InferError.internal("x").code
    finally:
        await mv.close()
