"""Ensembles with decoupled steps: the lineages compile_plan gives their tensors (Triton's rule
for steps fed from two lineages, with its text), and run_stream's rounds with a fake upstream
(no sockets): one response of the ensemble per response of the decoupled step, each through the
steps after it, and a failing round failing the request."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format

from gateway.ensemble.executor import EnsembleExecutor
from gateway.ensemble.plan import EnsembleError, compile_plan
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from tests.support import loop_passes

MODELS = {
    # fan: one response per element of IN, OUT = that element (decoupled)
    "fan": 'name: "fan" max_batch_size: 0 model_transaction_policy { decoupled: true } '
           'input [{name: "IN" data_type: TYPE_INT32 dims: [-1]}] output [{name: "OUT" data_type: TYPE_INT32 dims: [1]}]',
    "double": 'name: "double" max_batch_size: 0 input [{name: "X" data_type: TYPE_INT32 dims: [1]}] '
              'output [{name: "Y" data_type: TYPE_INT32 dims: [1]}]',
    "add": 'name: "add" max_batch_size: 0 input [{name: "A" data_type: TYPE_INT32 dims: [1]}, '
           '{name: "B" data_type: TYPE_INT32 dims: [1]}] output [{name: "S" data_type: TYPE_INT32 dims: [1]}]',
}
CONFIGS = {k: text_format.Parse(v, mc.ModelConfig()) for k, v in MODELS.items()}


def lookup(model: str, version: str) -> mc.ModelConfig | None:
    return CONFIGS.get(model)


def ensemble(inputs: str, outputs: str, steps: str) -> mc.ModelConfig:
    return text_format.Parse(f'name: "e" platform: "ensemble" max_batch_size: 0 input [{inputs}] '
                             f'output [{outputs}] ensemble_scheduling {{ step [{steps}] }}', mc.ModelConfig())


IN = '{name: "IN" data_type: TYPE_INT32 dims: [-1]}'
FAN = '{model_name: "fan" model_version: -1 input_map {key: "IN" value: "IN"} output_map {key: "OUT" value: "v"}}'
DOUBLE = '{model_name: "double" model_version: -1 input_map {key: "X" value: "v"} output_map {key: "Y" value: "W"}}'
FAN_DOUBLE = ensemble(IN, '{name: "W" data_type: TYPE_INT32 dims: [1]}', f"{FAN}, {DOUBLE}")


def test_a_decoupled_step_starts_a_lineage_that_the_steps_after_it_carry() -> None:
    plan = compile_plan(FAN_DOUBLE, lookup)
    assert plan.decoupled and plan.step_decoupled == (True, False)
    assert plan.step_lineage == (0, 1) and plan.step_out_lineage == (1, 1) and plan.output_lineage == 1
    plain = compile_plan(ensemble('{name: "v" data_type: TYPE_INT32 dims: [1]}',
                                  '{name: "W" data_type: TYPE_INT32 dims: [1]}', DOUBLE), lookup)
    assert not plain.decoupled and plain.output_lineage == 0


def test_a_step_fed_from_two_lineages_is_refused_with_tritons_text() -> None:
    add = ('{model_name: "add" model_version: -1 input_map [{key: "A" value: "K"}, {key: "B" value: "v"}] '
           'output_map {key: "S" value: "S"}}')
    config = ensemble(f'{IN}, {{name: "K" data_type: TYPE_INT32 dims: [1]}}',
                      '{name: "S" data_type: TYPE_INT32 dims: [1]}', f"{FAN}, {add}")
    with pytest.raises(EnsembleError, match="in ensemble e, step of model 'add' receives inputs originated from "
                                            "different decoupled models"):
        compile_plan(config, lookup)


def test_outputs_from_two_lineages_are_refused() -> None:
    config = ensemble(f'{IN}, {{name: "K" data_type: TYPE_INT32 dims: [1]}}',
                      '{name: "v" data_type: TYPE_INT32 dims: [1]}, {name: "W" data_type: TYPE_INT32 dims: [1]}',
                      f'{FAN}, {{model_name: "double" model_version: -1 input_map {{key: "X" value: "K"}} '
                      f'output_map {{key: "Y" value: "W"}}}}')
    with pytest.raises(EnsembleError, match="outputs originate from different decoupled models"):
        compile_plan(config, lookup)


def _int(resp: pb.ModelInferResponse, name: str) -> int:
    i = [o.name for o in resp.outputs].index(name)
    return int(np.frombuffer(resp.raw_output_contents[i], dtype=np.int32)[0])


class FakeUpstream:
    """fan answers each element of IN (a response each, then the final flag); double doubles X
    (failing on ``fail_on``)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.calls: list[str] = []

    async def send(self, request: pb.ModelInferRequest, raw: Any, timeout: Any, affinity: Any = None
                   ) -> pb.ModelInferResponse:
        self.calls.append(request.model_name)
        x = int(np.frombuffer(request.raw_input_contents[0], dtype=np.int32)[0])
        await loop_passes(5 - x % 5)  # later rounds may finish first
        if x == self.fail_on:
            raise InferError.invalid(f"double cannot take {x}")
        resp = pb.ModelInferResponse(model_name="double")
        resp.outputs.add(name="Y", datatype="INT32", shape=[1])
        resp.raw_output_contents.append(np.array([2 * x], dtype=np.int32).tobytes())
        return resp

    async def stream(self, request: pb.ModelInferRequest, raw: Any, timeout: Any, affinity: Any = None
                     ) -> AsyncIterator[tuple[pb.ModelInferResponse | None, bool]]:
        self.calls.append(request.model_name)
        for v in np.frombuffer(request.raw_input_contents[0], dtype=np.int32):
            resp = pb.ModelInferResponse(model_name="fan")
            resp.outputs.add(name="OUT", datatype="INT32", shape=[1])
            resp.raw_output_contents.append(np.array([v], dtype=np.int32).tobytes())
            yield resp, False
        yield None, True


def _request(values: list[int]) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="e", id="r")
    req.inputs.add(name="IN", datatype="INT32", shape=[len(values)])
    req.raw_input_contents.append(np.array(values, dtype=np.int32).tobytes())
    return req


async def _run(upstream: FakeUpstream, values: list[int]) -> list[int]:
    executor = EnsembleExecutor(upstream)  # type: ignore[arg-type]
    plan = compile_plan(FAN_DOUBLE, lookup)
    return [_int(r, "W") async for r in executor.run_stream(plan, _request(values), None)]


def test_each_response_of_the_decoupled_step_is_a_round_and_a_response() -> None:
    upstream = FakeUpstream()
    assert sorted(asyncio.run(_run(upstream, [1, 2, 3, 4]))) == [2, 4, 6, 8]
    assert upstream.calls.count("fan") == 1 and upstream.calls.count("double") == 4
    assert asyncio.run(_run(FakeUpstream(), [])) == []  # no response of the step: none of the ensemble


def test_a_failing_round_fails_the_request_naming_the_step() -> None:
    with pytest.raises(InferError, match="ensemble 'e' step 1 \\(model 'double'\\): double cannot take 3"):
        asyncio.run(_run(FakeUpstream(fail_on=3), [1, 2, 3, 4]))
