"""The TensorRT adapter above the engine interface, with a numpy fake engine: config ↔ engine
checks, dtype mapping, optimization-profile choice, I/O binding, batch padding, and dynamic
batching through ModelVersion. No tensorrt, no GPU."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from services.base.model import ModelVersion
from services.base.runtime import InstancePlacement, placements
from services.tensorrt.engine import ProfileShapes, datatype_from_trt
from services.tensorrt.runtime import (
    RuntimeLoadError,
    TensorRTAdapter,
    instance_profiles,
    plan_io,
    select_profile,
)
from tests.unit.tensorrt.fake_engine import FakeEngine

GPU0 = InstancePlacement(0, "trt_0", "gpu", 0)


def config(text: str = "", max_batch: int = 8, dims: str = "[ 4 ]", dtype: str = "TYPE_FP32") -> mc.ModelConfig:
    base = f"""name: "trt" platform: "tensorrt_plan" backend: "tensorrt" max_batch_size: {max_batch}
    input [ {{ name: "INPUT0" data_type: {dtype} dims: {dims} }}, {{ name: "INPUT1" data_type: {dtype} dims: {dims} }} ]
    output [ {{ name: "OUTPUT0" data_type: {dtype} dims: {dims} }}, {{ name: "OUTPUT1" data_type: {dtype} dims: {dims} }} ]
    """
    return text_format.Parse(base + text, mc.ModelConfig())


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    p = tmp_path / "1" / "model.plan"
    p.parent.mkdir()
    p.write_bytes(b"not a real plan; the fake loader ignores it")
    return p


def adapter_for(engine: FakeEngine) -> tuple[TensorRTAdapter, list[tuple[Path, int]]]:
    calls: list[tuple[Path, int]] = []

    def loader(path: Path, device: int) -> FakeEngine:
        calls.append((path, device))
        return engine

    return TensorRTAdapter(loader), calls


def rows(n: int, dtype: type = np.float32) -> dict[str, np.ndarray]:
    a = np.arange(n * 4, dtype=dtype).reshape(n, 4)
    return {"INPUT0": a, "INPUT1": np.ones((n, 4), dtype=dtype)}


# ---- dtype mapping ---------------------------------------------------------------------------

def test_datatype_mapping() -> None:
    assert datatype_from_trt("FLOAT") == "FP32"
    assert datatype_from_trt("DataType.HALF") == "FP16"
    assert [datatype_from_trt(n) for n in ("INT8", "INT32", "INT64", "BOOL", "UINT8")] == \
        ["INT8", "INT32", "INT64", "BOOL", "UINT8"]
    assert datatype_from_trt("BF16") == "" and datatype_from_trt("FP8") == ""


# ---- config <-> engine -----------------------------------------------------------------------

def test_plan_matches_dynamic_batch_engine() -> None:
    plan = plan_io(config(), FakeEngine(), (0,))
    assert plan.batched and plan.fixed_batch == 0
    assert sorted(plan.inputs) == ["INPUT0", "INPUT1"] and sorted(plan.outputs) == ["OUTPUT0", "OUTPUT1"]


def test_plan_reports_every_mismatch() -> None:
    engine = FakeEngine(extra_input="MASK")
    cfg = config(dtype="TYPE_INT32")
    cfg.output.add(name="EXTRA", data_type=mc.TYPE_FP32, dims=[4])
    with pytest.raises(RuntimeLoadError) as err:
        plan_io(cfg, engine, (0,))
    msg = str(err.value)
    assert "model 'trt'" in msg
    assert "engine inputs ['MASK'] are not in the config" in msg
    assert "config output 'EXTRA' is not an engine output" in msg
    assert "input 'INPUT0' is INT32 in the config but FP32 in the engine" in msg


def test_plan_shape_checks() -> None:
    with pytest.raises(RuntimeLoadError, match=r"input 'INPUT0' has shape \[-1, 5\] in the config but \[-1, 4\]"):
        plan_io(config(dims="[ 5 ]"), FakeEngine(), (0,))
    with pytest.raises(RuntimeLoadError, match="max_batch_size 16 exceeds the largest batch .* accept \\(8\\)"):
        plan_io(config(max_batch=16), FakeEngine(), (0,))
    # max_batch_size 0: config dims are the whole engine shape
    plan_io(config(max_batch=0, dims="[ -1, 4 ]"), FakeEngine(), (0,))
    with pytest.raises(RuntimeLoadError, match="has shape \\[4\\] in the config but \\[-1, 4\\]"):
        plan_io(config(max_batch=0), FakeEngine(), (0,))


async def test_reshape_is_what_the_engine_sees(plan_file: Path) -> None:
    """Config dims [8] reshaped to [2, 4]: the engine's [-1, 2, 4] is checked against the
    reshape (against the dims it is refused), a request of [1, 8] reaches the engine as
    [1, 2, 4], and its outputs come back as [1, 8]."""
    cfg = config(dims="[ 8 ]")
    for t in [*cfg.input, *cfg.output]:
        t.reshape.shape.extend([2, 4])
    engine = FakeEngine(shape=(-1, 2, 4))
    plan = plan_io(cfg, engine, (0,))
    assert plan.batched and plan.fixed_batch == 0
    assert {n: d.shape for n, d in plan.inputs.items()} == {"INPUT0": (-1, 2, 4), "INPUT1": (-1, 2, 4)}
    with pytest.raises(RuntimeLoadError, match=r"input 'INPUT0' has shape \[-1, 8\] in the config but \[-1, 2, 4\]"):
        plan_io(config(dims="[ 8 ]"), engine, (0,))
    adapter, _ = adapter_for(engine)
    mv = ModelVersion(cfg, 1, plan_file.parent.parent, [adapter.load(plan_file, cfg, GPU0)], "tensorrt_plan")
    req = pb.ModelInferRequest(model_name="trt", id="r")
    values = np.arange(8, dtype=np.float32)
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[1, 8])
        req.raw_input_contents.append(values.tobytes())
    try:
        resp = pb.ModelInferResponse.FromString(await mv.infer(req, None))
    finally:
        await mv.close()
    assert engine.contexts[0].executions == [{"INPUT0": (1, 2, 4), "INPUT1": (1, 2, 4)}]
    out = {o.name: (list(o.shape), raw) for o, raw in zip(resp.outputs, resp.raw_output_contents, strict=True)}
    assert out["OUTPUT0"][0] == [1, 8] and out["OUTPUT1"][0] == [1, 8]
    np.testing.assert_array_equal(np.frombuffer(out["OUTPUT0"][1], np.float32), values * 2)


def test_unsupported_engine_type_is_named() -> None:
    with pytest.raises(RuntimeLoadError, match="TensorRT type BF16"):
        plan_io(config(), FakeEngine(datatype="", trt_type="BF16"), (0,))


# ---- profiles --------------------------------------------------------------------------------

def test_profile_covers_and_selection() -> None:
    ps = ProfileShapes((1, 4), (4, 4), (8, 4))
    assert ps.covers((1, 4)) and ps.covers((8, 4)) and not ps.covers((9, 4)) and not ps.covers((2, 5))
    engine = FakeEngine(profiles=[(1, 4), (5, 16)])
    assert select_profile(engine, {"INPUT0": (3, 4), "INPUT1": (3, 4)}, [0, 1]) == 0
    assert select_profile(engine, {"INPUT0": (9, 4), "INPUT1": (9, 4)}, [0, 1]) == 1
    assert select_profile(engine, {"INPUT0": (9, 4), "INPUT1": (9, 4)}, [0]) is None
    assert select_profile(engine, {"INPUT0": (17, 4), "INPUT1": (17, 4)}, [0, 1]) is None


def test_instance_group_profiles() -> None:
    cfg = config('instance_group [ { name: "small" kind: KIND_GPU profile: [ "1" ] } ]')
    (placement,) = placements(cfg, gpu_available=True)
    assert instance_profiles(cfg, placement, 2) == (1,)
    assert instance_profiles(config(), GPU0, 3) == (0, 1, 2)
    with pytest.raises(RuntimeLoadError, match="profile 1 does not exist"):
        instance_profiles(cfg, placement, 1)


def test_batches_switch_profiles_only_when_needed(plan_file: Path) -> None:
    engine = FakeEngine(profiles=[(1, 4), (5, 16)])
    adapter, _ = adapter_for(engine)
    inst = adapter.load(plan_file, config(max_batch=16), GPU0)
    for n in (2, 3, 10, 12, 1):
        out = inst.run(rows(n), ["OUTPUT0"])
        np.testing.assert_array_equal(out["OUTPUT0"], rows(n)["INPUT0"] + 1)
    ctx = engine.contexts[0]
    assert ctx.profile_calls == [0, 1, 0]
    assert [e["INPUT0"][0] for e in ctx.executions] == [2, 3, 10, 12, 1]


def test_no_profile_accepts_is_invalid_argument(plan_file: Path) -> None:
    cfg = config('instance_group [ { kind: KIND_GPU profile: [ "1" ] } ]', max_batch=16)
    engine = FakeEngine(profiles=[(1, 4), (5, 16)])
    adapter, _ = adapter_for(engine)
    (placement,) = placements(cfg, gpu_available=True)
    inst = adapter.load(plan_file, cfg, placement)
    with pytest.raises(InferError) as err:
        inst.run(rows(2), ["OUTPUT0"])
    assert err.value.code == Code.INVALID_ARG
    assert "profile 1: INPUT0 [5, 4]..[16, 4]" in str(err.value)


# ---- binding and batching --------------------------------------------------------------------

def test_every_output_is_bound_only_requested_returned(plan_file: Path) -> None:
    engine = FakeEngine()
    adapter, _ = adapter_for(engine)
    inst = adapter.load(plan_file, config(), GPU0)
    out = inst.run(rows(3), ["OUTPUT1"])
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"], rows(3)["INPUT0"] - 1)
    assert engine.contexts[0].bound_outputs == [["OUTPUT0", "OUTPUT1"]]


def test_fixed_batch_engine_pads_and_slices(plan_file: Path) -> None:
    engine = FakeEngine(shape=(8, 4))
    adapter, _ = adapter_for(engine)
    inst = adapter.load(plan_file, config(max_batch=8), GPU0)
    out = inst.run(rows(3), ["OUTPUT0", "OUTPUT1"])
    assert out["OUTPUT0"].shape == (3, 4)
    np.testing.assert_array_equal(out["OUTPUT0"], rows(3)["INPUT0"] + 1)
    assert engine.contexts[0].executions == [{"INPUT0": (8, 4), "INPUT1": (8, 4)}]
    assert engine.contexts[0].profile_calls == []  # static engine: no profile switching
    with pytest.raises(RuntimeLoadError, match="max_batch_size 16 exceeds the engine's fixed batch dimension 8"):
        adapter.load(plan_file, config(max_batch=16), GPU0)


def test_inputs_are_made_contiguous_in_the_engine_dtype(plan_file: Path) -> None:
    engine = FakeEngine(datatype="INT64", trt_type="INT64")
    adapter, _ = adapter_for(engine)
    inst = adapter.load(plan_file, config(dtype="TYPE_INT64"), GPU0)
    feeds = rows(4, np.int64)
    feeds["INPUT0"] = np.asfortranarray(feeds["INPUT0"])
    out = inst.run(feeds, ["OUTPUT0"])
    assert out["OUTPUT0"].dtype == np.int64


def test_data_dependent_output_shapes_are_refused(plan_file: Path) -> None:
    adapter, _ = adapter_for(FakeEngine(data_dependent=True))
    inst = adapter.load(plan_file, config(), GPU0)
    with pytest.raises(InferError, match="data-dependent shape"):
        inst.run(rows(1), ["OUTPUT0"])


# ---- adapter -----------------------------------------------------------------------------------

def test_engine_shared_per_device_contexts_per_instance(plan_file: Path) -> None:
    engine = FakeEngine()
    adapter, calls = adapter_for(engine)
    cfg = config('instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]')
    instances = [adapter.load(plan_file, cfg, p) for p in placements(cfg, gpu_available=True)]
    assert len(instances) == 4 and len(engine.contexts) == 4
    assert sorted(d for _, d in calls) == [0, 1]
    instances[0].close()
    assert engine.contexts[0].closed


def test_last_instance_frees_the_engine_and_a_failed_load_releases_it(plan_file: Path) -> None:
    engine = FakeEngine()
    adapter, calls = adapter_for(engine)
    a, b = adapter.load(plan_file, config(), GPU0), adapter.load(plan_file, config(), GPU0)
    assert len(calls) == 1
    a.close()
    assert not engine.closed
    b.close()
    assert engine.closed
    with pytest.raises(RuntimeLoadError):  # config mismatch after the engine loaded
        adapter.load(plan_file, config(dims="[ 5 ]"), GPU0)
    adapter.load(plan_file, config(), GPU0)
    assert len(calls) == 3  # nothing stale was kept


def test_cpu_instances_and_bad_files_are_refused(plan_file: Path, tmp_path: Path) -> None:
    adapter, _ = adapter_for(FakeEngine())
    with pytest.raises(RuntimeLoadError, match="TensorRT plans run on GPUs only"):
        adapter.load(plan_file, config(), InstancePlacement(0, "trt_0", "cpu"))
    with pytest.raises(RuntimeLoadError, match="does not exist"):
        adapter.load(tmp_path / "nope.plan", config(), GPU0)

    def broken(path: Path, device: int) -> FakeEngine:
        raise RuntimeError("TensorRT could not deserialize the plan")

    with pytest.raises(RuntimeLoadError, match=r"could not load TensorRT plan .*model.plan on GPU 0: TensorRT could"):
        TensorRTAdapter(broken).load(plan_file, config(), GPU0)
    cfg = config()
    cfg.input[0].data_type = mc.TYPE_STRING
    with pytest.raises(RuntimeLoadError, match="TYPE_STRING"):
        adapter.load(plan_file, cfg, GPU0)


def _request(i: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="trt", id=str(i))
    for name in ("INPUT0", "INPUT1"):
        t = req.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        del t
    req.raw_input_contents.append(np.full((1, 4), i, dtype=np.float32).tobytes())
    req.raw_input_contents.append(np.ones((1, 4), dtype=np.float32).tobytes())
    return req


async def test_dynamic_batching_through_model_version(plan_file: Path) -> None:
    engine = FakeEngine()
    adapter, _ = adapter_for(engine)
    cfg = config("dynamic_batching { max_queue_delay_microseconds: 50000 }")
    mv = ModelVersion(cfg, 1, plan_file.parent.parent, [adapter.load(plan_file, cfg, GPU0)], "tensorrt_plan")
    try:
        bodies = await asyncio.gather(*(mv.infer(_request(i), None) for i in range(16)))
    finally:
        await mv.close()
    for i, body in enumerate(bodies):
        resp = pb.ModelInferResponse.FromString(body)
        assert resp.id == str(i)
        out = dict(zip([o.name for o in resp.outputs], resp.raw_output_contents, strict=True))
        np.testing.assert_array_equal(np.frombuffer(out["OUTPUT0"], np.float32), [i + 1] * 4)
    assert mv.stats.inference_count == 16
    assert mv.stats.execution_count < 16
    assert max(e["INPUT0"][0] for e in engine.contexts[0].executions) > 1
