"""Ensembles: compile-time validation naming the step, and the executor's DAG scheduling
(independent steps concurrently, failures naming the step, the in-flight bound), with a fake
upstream (no sockets)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format

from gateway.ensemble.executor import EnsembleExecutor
from gateway.ensemble.plan import EnsembleError, compile_plan
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from tests.support import models
from tests.support.slow import work_for_async

MODELS = {
    "double": 'name: "double" max_batch_size: 8 input [{name: "IN" data_type: TYPE_FP32 dims: [4]}] '
              'output [{name: "OUT" data_type: TYPE_FP32 dims: [4]}]',
    "triple": 'name: "triple" max_batch_size: 8 input [{name: "IN" data_type: TYPE_FP32 dims: [4]}] '
              'output [{name: "OUT" data_type: TYPE_FP32 dims: [4]}]',
    "add": 'name: "add" max_batch_size: 8 input [{name: "A" data_type: TYPE_FP32 dims: [4]}, '
           '{name: "B" data_type: TYPE_FP32 dims: [4]}] output [{name: "SUM" data_type: TYPE_FP32 dims: [4]}]',
    "ints": 'name: "ints" max_batch_size: 8 input [{name: "IN" data_type: TYPE_INT32 dims: [4]}] '
            'output [{name: "OUT" data_type: TYPE_INT32 dims: [4]}]',
    "wide": 'name: "wide" max_batch_size: 8 input [{name: "IN" data_type: TYPE_FP32 dims: [8]}] '
            'output [{name: "OUT" data_type: TYPE_FP32 dims: [8]}]',
}
CONFIGS = {k: text_format.Parse(v, mc.ModelConfig()) for k, v in MODELS.items()}

# X -> double -> D ; X -> triple -> T ; (D, T) -> add -> Y   (double and triple are independent)
DIAMOND = """
name: "diamond" platform: "ensemble" max_batch_size: 8
input [{name: "X" data_type: TYPE_FP32 dims: [4]}]
output [{name: "Y" data_type: TYPE_FP32 dims: [4]}, {name: "D" data_type: TYPE_FP32 dims: [4]}]
ensemble_scheduling { step [
  {model_name: "double" model_version: -1 input_map {key: "IN" value: "X"} output_map {key: "OUT" value: "D"}},
  {model_name: "triple" model_version: -1 input_map {key: "IN" value: "X"} output_map {key: "OUT" value: "T"}},
  {model_name: "add" model_version: -1 input_map [{key: "A" value: "D"}, {key: "B" value: "T"}]
   output_map {key: "SUM" value: "Y"}}
] }
"""


def lookup(model: str, version: str) -> mc.ModelConfig | None:
    return CONFIGS.get(model)


def ensemble(text: str = DIAMOND) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_diamond_compiles_in_dependency_order() -> None:
    plan = compile_plan(ensemble(), lookup)
    assert plan.order.index(2) > plan.order.index(0) and plan.order.index(2) > plan.order.index(1)
    assert set(plan.inputs) == {"X"} and set(plan.outputs) == {"Y", "D"}


@pytest.mark.parametrize("change,fragment", [
    (('model_name: "triple"', 'model_name: "nope"'), "step 1 (model 'nope'): unknown model 'nope'"),
    (('value: "T"}]', 'value: "Q"}]'), "step 2 (model 'add'): input 'B' reads tensor 'Q', which is neither"),
    (('{key: "IN" value: "X"} output_map {key: "OUT" value: "D"}',
      '{key: "IN" value: "Y"} output_map {key: "OUT" value: "D"}'), "form a cycle"),
    (('model_name: "triple"', 'model_name: "ints"'), "step 1 (model 'ints'): input 'IN' of model 'ints' expects "
                                                    "INT32[-1, 4] but tensor 'X' is FP32[-1, 4]"),
    (('model_name: "triple"', 'model_name: "wide"'), "step 1 (model 'wide'): input 'IN' of model 'wide' "
                                                    "expects FP32[-1, 8]"),
    (('input_map [{key: "A" value: "D"}, {key: "B" value: "T"}]', 'input_map [{key: "A" value: "D"}]'),
     "step 2 (model 'add'): input 'B' of model 'add' is not mapped"),
    (('{key: "IN" value: "X"} output_map {key: "OUT" value: "T"}',
      '{key: "IN" value: "X"} output_map {key: "OUT" value: "D"}'), "step 1 (model 'triple'): tensor 'D' is also"),
    (('{key: "SUM" value: "Y"}', '{key: "SUM" value: "Z"}'), "output 'Y' is not produced by any step"),
    (('{key: "A" value: "D"}', '{key: "C" value: "D"}'), "model 'add' has no input 'C'"),
])
def test_invalid_ensembles_name_the_step(change: tuple[str, str], fragment: str) -> None:
    text = DIAMOND.replace(*change)
    assert text != DIAMOND
    with pytest.raises(EnsembleError) as err:
        compile_plan(ensemble(text), lookup)
    assert "ensemble 'diamond'" in str(err.value)
    assert fragment in str(err.value), str(err.value)


def fake_upstream(delay_s: float = 0.1, fail: dict[str, InferError] | None = None):
    calls: list[tuple[str, float, float]] = []

    async def send(req: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                   affinity: str | None = None) -> pb.ModelInferResponse:
        t0 = time.monotonic()
        await work_for_async(delay_s)  # the steps' overlap in time is measured
        calls.append((req.model_name, t0, time.monotonic()))
        if fail and req.model_name in fail:
            raise fail[req.model_name]
        x = {t.name: np.frombuffer(raw, np.float32) for t, raw in zip(req.inputs, req.raw_input_contents,
                                                                      strict=True)}
        out = {"double": lambda: x["IN"] * 2, "triple": lambda: x["IN"] * 3,
               "add": lambda: x["A"] + x["B"]}[req.model_name]()
        resp = pb.ModelInferResponse(model_name=req.model_name)
        resp.outputs.add(name=req.outputs[0].name, datatype="FP32", shape=list(req.inputs[0].shape))
        resp.raw_output_contents.append(out.astype(np.float32).tobytes())
        return resp

    return SimpleNamespace(send=send), calls  # the executor's upstream.Upstream


def request(x: np.ndarray) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="diamond", id="r1")
    req.inputs.add(name="X", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.astype(np.float32).tobytes())
    return req


@pytest.mark.serial  # a latency/rate bound: run alone (scripts/test.sh)
async def test_independent_steps_run_concurrently() -> None:
    upstream, calls = fake_upstream(0.1)
    plan = compile_plan(ensemble(), lookup)
    executor = EnsembleExecutor(upstream)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    t0 = time.monotonic()
    resp = await executor.run(plan, request(x), timeout=5)
    elapsed = time.monotonic() - t0
    # two ~100 ms branches side by side, then the ~100 ms join: ~200 ms, not ~300 ms
    assert elapsed < 0.27, elapsed
    starts = {m: t for m, t, _ in calls}
    assert abs(starts["double"] - starts["triple"]) < 0.03
    assert resp.id == "r1" and resp.model_name == "diamond"
    out = {o.name: np.frombuffer(raw, np.float32).reshape(o.shape)
           for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
    np.testing.assert_array_equal(out["Y"], x * 5)
    np.testing.assert_array_equal(out["D"], x * 2)


async def test_two_independent_100ms_steps_take_100ms_not_200ms() -> None:
    two = models.ensemble_config("two", {"X": 4}, {"T": 4, "D": 4}, [
        models.step("double", {"IN": "X"}, {"OUT": "D"}), models.step("triple", {"IN": "X"}, {"OUT": "T"})])
    plan = compile_plan(ensemble(two), lookup)
    upstream, _ = fake_upstream(0.1)
    t0 = time.monotonic()
    await EnsembleExecutor(upstream).run(plan, request(np.ones((1, 4))), timeout=None)
    assert time.monotonic() - t0 < 0.17
    # with one step in flight at a time the same plan takes twice as long: the bound holds
    t0 = time.monotonic()
    await EnsembleExecutor(upstream, max_inflight_steps=1).run(plan, request(np.ones((1, 4))), timeout=None)
    assert time.monotonic() - t0 >= 0.2


async def test_a_failing_step_fails_the_request_with_its_model_and_status() -> None:
    upstream, calls = fake_upstream(0.05, fail={"triple": InferError(Code.RESOURCE_EXHAUSTED, "queue full")})
    plan = compile_plan(ensemble(), lookup)
    with pytest.raises(InferError) as err:
        await EnsembleExecutor(upstream).run(plan, request(np.ones((1, 4))), timeout=5)
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    assert "ensemble 'diamond' step 1 (model 'triple'): queue full" in err.value.message
    assert "add" not in [m for m, _, _ in calls]  # the join never ran


async def test_bad_inputs_are_client_errors() -> None:
    upstream, _ = fake_upstream(0.0)
    plan = compile_plan(ensemble(), lookup)
    bad = pb.ModelInferRequest(model_name="diamond")
    bad.inputs.add(name="NOPE", datatype="FP32", shape=[1, 4])
    bad.raw_input_contents.append(b"\0" * 16)
    for req in (bad, pb.ModelInferRequest(model_name="diamond")):
        with pytest.raises(InferError) as err:
            await EnsembleExecutor(upstream).run(plan, req, timeout=5)
        assert err.value.code == Code.INVALID_ARG
    req = request(np.ones((1, 4)))
    req.outputs.add(name="NOPE")
    with pytest.raises(InferError, match="no output 'NOPE'"):
        await EnsembleExecutor(upstream).run(plan, req, timeout=5)


async def test_a_tenants_steps_hold_at_most_its_share_of_the_step_slots() -> None:
    """StepSlots(4): mallory (share 0.5) holds 2 and its third waits in its own line; acme still
    takes the other 2 at once; mallory's third runs when one of its own ends (not acme's).
    Without tenants (CALLER unset) every slot is anyone's, as before."""
    import asyncio
    import contextvars

    from gateway.auth import CALLER
    from gateway.ensemble.executor import StepSlots

    slots = StepSlots(4)

    def as_tenant(who: tuple[str, float] | None) -> contextvars.Context:
        ctx = contextvars.copy_context()
        ctx.run(CALLER.set, who)
        return ctx

    loop = asyncio.get_running_loop()
    mallory = [loop.create_task(slots.take(), context=as_tenant(("mallory", 0.5))) for _ in range(3)]
    await asyncio.sleep(0)
    assert [t.done() for t in mallory] == [True, True, False]
    acme = [loop.create_task(slots.take(), context=as_tenant(("acme", 0.5))) for _ in range(2)]
    await asyncio.sleep(0)
    assert all(t.done() for t in acme) and not mallory[2].done()
    slots.give(acme[0].result())
    await asyncio.sleep(0)
    assert not mallory[2].done()  # acme's slot is free, but mallory holds its share
    slots.give(mallory[0].result())
    await asyncio.wait_for(mallory[2], 1)
    for t in (mallory[1], mallory[2], acme[1]):
        slots.give(t.result())
    assert slots.slots.busy == 0 and not slots.slots.held  # every slot given back
    anyone = StepSlots(4)
    held = [await loop.create_task(anyone.take(), context=as_tenant(None)) for _ in range(4)]
    assert sorted(index for index, _ in held) == [0, 1, 2, 3] and {who for _, who in held} == {None}
    fifth = loop.create_task(anyone.take(), context=as_tenant(None))
    await asyncio.sleep(0)
    assert not fifth.done()  # all 4 held
    anyone.give(held[2])
    assert await asyncio.wait_for(fifth, 1) == held[2]


def test_an_ensembles_label_file_is_read_inside_its_folder_only(tmp_path: Path) -> None:
    from gateway.ensemble.catalog import read_labels
    from meshserve.repository.config import ConfigError

    folder = tmp_path / "ens"
    folder.mkdir()
    (folder / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "secret.txt").write_text("not a label\n")
    config = ensemble()
    config.output[0].label_filename = "labels.txt"
    assert read_labels(folder, config) == {"Y": ("cat", "dog")}
    config.output[1].label_filename = "../secret.txt"
    with pytest.raises(ConfigError, match=r"output\[1\].label_filename.*outside the model directory"):
        read_labels(folder, config)
    config.output[1].label_filename = "gone.txt"
    with pytest.raises(ConfigError, match=r"output\[1\].label_filename.*cannot read label file 'gone.txt'"):
        read_labels(folder, config)


def test_an_ensembles_request_is_refused_in_tritons_words() -> None:
    """An ensemble's request mistakes as Triton words them for any model (core's
    ValidateRequestInputs and its input checks): the gateway checks them itself."""
    from gateway.ensemble.executor import _inputs

    plan = compile_plan(ensemble(), lookup, {})

    def refused(*inputs: tuple[str, str]) -> str:
        request = pb.ModelInferRequest(model_name="diamond")
        for name, datatype in inputs:
            request.inputs.add(name=name, datatype=datatype, shape=[1, 4])
            request.raw_input_contents.append(bytes(16))
        with pytest.raises(InferError) as err:
            _inputs(plan, request)
        assert err.value.code == Code.INVALID_ARG
        return err.value.message

    assert refused() == ("expected 1 inputs but got 0 inputs for model 'diamond'. Got input(s) [], but missing "
                         "required input(s) ['X']. Please provide all required input(s).")
    assert refused(("Y", "FP32")) == "unexpected inference input 'Y' for model 'diamond'; model inputs are ['X']"
    assert refused(("X", "INT32")) == "inference input 'X' data-type is 'INT32', but model 'diamond' expects 'FP32'"


def test_a_large_classification_is_relabelled_in_slices_between_which_the_loop_runs() -> None:
    """Up to MAX_CLASSIFIED entries (a Python step each): the loop's other work runs every
    RELABEL_SLICE of them, not after all."""
    from gateway.ensemble.executor import RELABEL_SLICE, _relabelled
    from meshserve.protocol.datatypes import deserialize_bytes, serialize_bytes

    plan = compile_plan(ensemble(), lookup, {"Y": ("a", "", "c")})
    n = 3 * RELABEL_SLICE + 1
    step = serialize_bytes([f"0.5:{i % 4}".encode() for i in range(n)])

    async def main() -> tuple[bytes, int]:
        ticks = 0
        done = False

        async def other() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        await asyncio.sleep(0)
        before = ticks
        out = await _relabelled(plan, "Y", step)
        done = True
        await task
        return out, ticks - before

    out, ticks = asyncio.run(main())
    assert ticks >= 3  # it ran between the slices
    got = deserialize_bytes(out)
    assert len(got) == n and got[:4] == [b"0.5:0:a", b"0.5:1", b"0.5:2:c", b"0.5:3"]


def test_a_steps_classification_is_relabelled_with_the_ensembles_labels() -> None:
    from gateway.ensemble.executor import _relabelled
    from meshserve.protocol.datatypes import deserialize_bytes, serialize_bytes

    plan = compile_plan(ensemble(), lookup, {"Y": ("a", "", "c")})
    step = serialize_bytes([b"0.900000:2:two", b"0.500000:1:one", b"0.100000:3", b"-1.000000:0:zero"])
    assert deserialize_bytes(asyncio.run(_relabelled(plan, "Y", step))) == [
        b"0.900000:2:c", b"0.500000:1", b"0.100000:3", b"-1.000000:0:a"]
    for bad in (serialize_bytes([b"0.9"]), serialize_bytes([b"0.9:x:two"]), b"\x09\x00"):
        with pytest.raises(InferError) as err:
            asyncio.run(_relabelled(plan, "Y", bad))
        assert err.value.code == Code.INTERNAL and "ensemble 'diamond' output 'Y'" in err.value.message
