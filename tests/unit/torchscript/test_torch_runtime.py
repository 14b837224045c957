"""TorchScript adapter without processes: naming conventions, result shapes, parameters,
devices. Models are scripted/traced/exported into tmp_path with torch==2.13.0 (CPU)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.base.runtime import InstancePlacement

torch = pytest.importorskip("torch", reason="needs torch==2.13.0 (the [torch] extra)")

from services.torchscript.runtime import (  # noqa: E402  (after the importorskip)
    ForwardSignature,
    RuntimeLoadError,
    TorchOptions,
    TorchScriptAdapter,
    collect_outputs,
    plan_inputs,
    plan_outputs,
)

CPU = InstancePlacement(0, "m_0", "cpu")
GPU = InstancePlacement(0, "m_0", "gpu", 0)


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + y, x * y


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def _pair_config(names: tuple[str, str] = ("x", "y"), params: str = "", dtype: str = "TYPE_FP32") -> mc.ModelConfig:
    return _config(f"""name: "pair" backend: "pytorch" max_batch_size: 4
        input [ {{ name: "{names[0]}" data_type: {dtype} dims: [ 2 ] }},
                {{ name: "{names[1]}" data_type: {dtype} dims: [ 2 ] }} ]
        output [ {{ name: "OUTPUT__0" data_type: {dtype} dims: [ 2 ] }},
                 {{ name: "OUTPUT__1" data_type: {dtype} dims: [ 2 ] }} ] {params}""")


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ts") / "model.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(Pair()).save(str(path))
    return path


def test_input_conventions() -> None:
    sig = ForwardSignature(("x", "y"), 2)
    assert plan_inputs("m", ["y", "x"], sig).convention == "forward_argument"
    plan = plan_inputs("m", ["INPUT__1", "INPUT__0"], sig)
    assert plan.convention == "named_index" and plan.positions == {"INPUT__1": 1, "INPUT__0": 0}
    plan = plan_inputs("m", ["a", "b"], sig)
    assert plan.convention == "config_order" and plan.positions == {"a": 0, "b": 1}
    assert plan_inputs("m", ["a", "b"], ForwardSignature(("inputs",), 1, dict_input=True)).convention == "dict"
    with pytest.raises(RuntimeLoadError, match="indexes \\[0, 2\\] are not 0..1"):
        plan_inputs("m", ["INPUT__0", "INPUT__2"], sig)
    with pytest.raises(RuntimeLoadError, match="forward\\(\\) argument\\(s\\) \\['y'\\] have no config input"):
        plan_inputs("m", ["x"], sig)
    with pytest.raises(RuntimeLoadError, match="the config has 3 inputs but forward\\(\\) takes 2..2"):
        plan_inputs("m", ["a", "b", "c"], sig)
    # an optional trailing argument may be left out
    assert plan_inputs("m", ["a"], ForwardSignature(("x", "y"), 1)).positions == {"a": 0}


def test_output_conventions() -> None:
    assert plan_outputs(["OUTPUT__1", "OUTPUT__0"]) == {"OUTPUT__1": 1, "OUTPUT__0": 0}
    assert plan_outputs(["b", "a"]) == {"b": 0, "a": 1}
    t0, t1 = torch.zeros(1), torch.ones(1)
    assert collect_outputs("m", t0, ["y"], {"y": 0})["y"] is t0
    assert collect_outputs("m", (t0, t1), ["b"], {"a": 0, "b": 1})["b"] is t1
    assert collect_outputs("m", [t0, t1], ["a"], {"a": 0, "b": 1})["a"] is t0
    assert collect_outputs("m", {"k": t1}, ["k"], {"k": 0})["k"] is t1
    with pytest.raises(InferError, match="dict without output 'z' \\(keys: \\['k'\\]\\)"):
        collect_outputs("m", {"k": t1}, ["z"], {"z": 0})
    with pytest.raises(InferError, match="output 'b' is result 1 but forward\\(\\) returned 1"):
        collect_outputs("m", (t0,), ["b"], {"b": 1})
    with pytest.raises(InferError, match="returned str"):
        collect_outputs("m", "nope", ["a"], {"a": 0})


def test_parameters() -> None:
    assert TorchOptions.from_config(_pair_config()) == TorchOptions()
    opts = TorchOptions.from_config(_pair_config(params="""
        parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }
        parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
        parameters { key: "ENABLE_JIT_PROFILING" value: { string_value: "false" } }
        parameters { key: "ENABLE_WEIGHT_SHARING" value: { string_value: "true" } }
        parameters { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }"""))
    assert not opts.inference_mode and not opts.optimized_execution and opts.jit_profiling is False
    assert opts.weight_sharing and opts.intra_op_threads == 1 and opts.jit_executor is None
    with pytest.raises(RuntimeLoadError, match="'INFERENCE_MODE' must be true or false, got 'maybe'"):
        TorchOptions.from_config(_pair_config(
            params='parameters { key: "INFERENCE_MODE" value: { string_value: "maybe" } }'))


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # zero-copy of request bytes
def test_run_by_name_with_parameters_and_weight_sharing(pair_file: Path) -> None:
    cfg = _pair_config(("y", "x"), params="""
        parameters { key: "ENABLE_WEIGHT_SHARING" value: { string_value: "true" } }
        parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }
        parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
        parameters { key: "ENABLE_TENSOR_FUSER" value: { string_value: "false" } }""")
    adapter = TorchScriptAdapter()
    a, b = adapter.load(pair_file, cfg, CPU), adapter.load(pair_file, cfg, InstancePlacement(1, "m_0", "cpu"))
    assert a.module is b.module
    c = TorchScriptAdapter().load(pair_file, _pair_config(("y", "x")), CPU)  # no sharing asked
    assert c.module is not a.module
    x = np.array([[1, 2]], dtype=np.float32)
    y = np.frombuffer(np.array([[10, 20]], dtype=np.float32).tobytes(), dtype=np.float32).reshape(1, 2)  # read-only
    out = a.run({"y": y, "x": x}, ["OUTPUT__0", "OUTPUT__1"])
    np.testing.assert_array_equal(out["OUTPUT__0"], [[11, 22]])
    np.testing.assert_array_equal(out["OUTPUT__1"], [[10, 40]])
    a.close()
    b.close()
    import gc

    gc.collect()
    assert len(adapter._shared) == 0  # the last instance let the shared module go


def test_output_dtype_mismatch_and_bytes_are_refused(pair_file: Path) -> None:
    cfg = _pair_config()
    cfg.output[0].data_type = mc.TYPE_INT32
    inst = TorchScriptAdapter().load(pair_file, cfg, CPU)
    x = np.ones((1, 2), dtype=np.float32)
    with pytest.raises(InferError, match="output 'OUTPUT__0' is torch.float32 but the config declares INT32"):
        inst.run({"x": x, "y": x}, ["OUTPUT__0"])
    with pytest.raises(RuntimeLoadError, match="TYPE_STRING"):
        TorchScriptAdapter().load(pair_file, _pair_config(dtype="TYPE_STRING"), CPU)
    with pytest.raises(RuntimeLoadError, match="UINT32, which the TorchScript service does not support"):
        TorchScriptAdapter().load(pair_file, _pair_config(dtype="TYPE_UINT32"), CPU)


def test_bad_archives(tmp_path: Path) -> None:
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a zip")
    with pytest.raises(RuntimeLoadError, match="could not load .*model.pt as a TorchScript archive"):
        TorchScriptAdapter().load(bad, _pair_config(), CPU)
    with pytest.raises(RuntimeLoadError, match="does not exist"):
        TorchScriptAdapter().load(tmp_path / "missing.pt", _pair_config(), CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_kind_gpu_without_cuda_is_a_clear_load_error(pair_file: Path) -> None:
    with pytest.raises(RuntimeLoadError, match="asks for KIND_GPU but this torch .* has no usable CUDA device"):
        TorchScriptAdapter().load(pair_file, _pair_config(), GPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kind_gpu_runs_on_cuda(pair_file: Path) -> None:
    cfg = _pair_config(params='parameters { key: "ENABLE_CACHE_CLEANING" value: { string_value: "true" } }')
    inst = TorchScriptAdapter().load(pair_file, cfg, GPU)
    assert inst.device.type == "cuda"
    x = np.array([[1, 2]], dtype=np.float32)
    out = inst.run({"x": x, "y": x}, ["OUTPUT__0", "OUTPUT__1"])
    np.testing.assert_array_equal(out["OUTPUT__0"], [[2, 4]])
    np.testing.assert_array_equal(out["OUTPUT__1"], [[1, 4]])
