"""ModelVersion scheduling details with a fake runtime: preserve_ordering across instances,
and model_warmup before serving."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from services.base.model import ModelVersion
from services.base.warmup import WarmupError, run_warmup, warmup_inputs
from tests.support import eventually_async
from tests.support.slow import work_for

CONFIG = """name: "sleepy" max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching { %s }
"""


class SleepyInstance:
    """Sleeps INPUT0 seconds, echoes it; records calls."""

    def __init__(self) -> None:
        self.calls: list[dict[str, np.ndarray]] = []

    def run(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        self.calls.append(inputs)
        x = inputs["INPUT0"]
        work_for(float(x.reshape(-1)[0]))
        return {"OUTPUT0": x.copy()}

    def close(self) -> None:
        pass


def request(seconds: float) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="sleepy")
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    r.raw_input_contents.append(np.array([[seconds]], np.float32).tobytes())
    return r


@pytest.mark.parametrize("preserve", [True, False])
async def test_preserve_ordering_across_two_instances(preserve: bool, tmp_path: Path) -> None:
    config = text_format.Parse(CONFIG % ("preserve_ordering: true" if preserve else ""), mc.ModelConfig())
    instances = [SleepyInstance(), SleepyInstance()]
    mv = ModelVersion(config, 1, tmp_path, instances, "fake")
    finished: list[str] = []

    async def one(name: str, seconds: float) -> None:
        await mv.infer(request(seconds), None)
        finished.append(name)

    slow = asyncio.ensure_future(one("slow", 0.3))
    await eventually_async(lambda: any(i.calls for i in instances))  # "slow" runs on instance 1; "fast" gets instance 2
    fast = asyncio.ensure_future(one("fast", 0.0))
    await asyncio.gather(slow, fast)
    await mv.close()
    assert finished == (["slow", "fast"] if preserve else ["fast", "slow"])


def test_warmup_runs_every_instance_count_times(tmp_path: Path) -> None:
    config = text_format.Parse(CONFIG % "" + """
      model_warmup [ { name: "zeros" batch_size: 1 count: 3
                       inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } },
                     { name: "from_file" batch_size: 1
                       inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 1 ] input_data_file: "x.bin" } } } ]
    """, mc.ModelConfig())
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "x.bin").write_bytes(np.array([0.0], np.float32).tobytes())
    instances = [SleepyInstance(), SleepyInstance()]
    run_warmup(config, instances, tmp_path)  # type: ignore[arg-type]
    for inst in instances:
        assert len(inst.calls) == 4  # 3 x zeros + 1 x file
        assert inst.calls[0]["INPUT0"].shape == (1, 1)


def test_warmup_errors_name_the_warmup_and_input(tmp_path: Path) -> None:
    config = text_format.Parse(CONFIG % "" + """
      model_warmup [ { name: "w1" batch_size: 2
                       inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 1 ] input_data_file: "missing.bin" } } } ]
    """, mc.ModelConfig())
    with pytest.raises(WarmupError, match="warmup 'w1' input 'INPUT0'.*missing.bin"):
        warmup_inputs(config, config.model_warmup[0], tmp_path)
