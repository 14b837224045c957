"""Build the test model repository: real ONNX models + Triton configs.

    python -m tests.models.generate OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from meshserve import examples

# v2 datatype -> (ONNX element type, config data_type)
DATATYPES: dict[str, tuple[int, str]] = {
    "BOOL": (TensorProto.BOOL, "TYPE_BOOL"),
    "UINT8": (TensorProto.UINT8, "TYPE_UINT8"),
    "UINT16": (TensorProto.UINT16, "TYPE_UINT16"),
    "UINT32": (TensorProto.UINT32, "TYPE_UINT32"),
    "UINT64": (TensorProto.UINT64, "TYPE_UINT64"),
    "INT8": (TensorProto.INT8, "TYPE_INT8"),
    "INT16": (TensorProto.INT16, "TYPE_INT16"),
    "INT32": (TensorProto.INT32, "TYPE_INT32"),
    "INT64": (TensorProto.INT64, "TYPE_INT64"),
    "FP16": (TensorProto.FLOAT16, "TYPE_FP16"),
    "FP32": (TensorProto.FLOAT, "TYPE_FP32"),
    "FP64": (TensorProto.DOUBLE, "TYPE_FP64"),
    "BYTES": (TensorProto.STRING, "TYPE_STRING"),
}
MAX_BATCH = 8


def _write(repo: Path, name: str, config: str, models: dict[int, object]) -> None:
    import onnx

    d = repo / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(config)
    for version, model in models.items():
        (d / str(version)).mkdir(exist_ok=True)
        onnx.save(model, str(d / str(version) / "model.onnx"))


def _graph(nodes: list, name: str, ins: list, outs: list, inits: list | None = None) -> object:
    m = helper.make_model(helper.make_graph(nodes, name, ins, outs, inits or []),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def identity(elem: int) -> object:
    """OUTPUT0 = INPUT0 over [batch, n] (any element type, incl. strings)."""
    return _graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity",
                  [helper.make_tensor_value_info("INPUT0", elem, ["batch", "n"])],
                  [helper.make_tensor_value_info("OUTPUT0", elem, ["batch", "n"])])


def small_mlp(seed: int = 7) -> object:
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((64, 256)) * 0.1).astype(np.float32), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((256, 64)) * 0.1).astype(np.float32), "W2")
    nodes = [helper.make_node("MatMul", ["INPUT0", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["OUTPUT0"])]
    return _graph(nodes, "small_mlp",
                  [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 64])],
                  [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 64])], [w1, w2])


def fixed_add() -> object:
    """No batch dimension: OUTPUT0 = INPUT0 + INPUT1 over [4]."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("INPUT0", "INPUT1")]
    return _graph([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"])], "fixed_add",
                  ins, [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [4])])


def build(repo: Path) -> Path:
    repo.mkdir(parents=True, exist_ok=True)
    _write(repo, "add_sub", f"""name: "add_sub"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
""", {1: examples.add_sub(TensorProto.FLOAT)})
    for dt, (elem, cfg_type) in DATATYPES.items():
        _write(repo, f"identity_{dt.lower()}", f"""name: "identity_{dt.lower()}"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: {cfg_type} dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {cfg_type} dims: [ -1 ] }} ]
dynamic_batching {{ }}
""", {1: identity(elem)})
    _write(repo, "small_mlp", """name: "small_mlp"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
dynamic_batching { max_queue_delay_microseconds: 5000 }
""", {1: small_mlp()})
    _write(repo, "fixed_add", """name: "fixed_add"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""", {1: fixed_add()})
    _write(repo, "scale", """name: "scale"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { all { } }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""", {1: examples.scale(1.0), 2: examples.scale(2.0)})
    # auto-completed from the ONNX file: no inputs/outputs in the config
    _write(repo, "autocomplete", 'name: "autocomplete"\nbackend: "onnxruntime"\n',
           {1: examples.add_sub(TensorProto.INT32)})
    return repo


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/meshserve-test-models")))
