"""Models for the datatype and shape edges (tests/integration/test_scalars.py, test_datatypes.py):
graphs with scalar (rank-0) tensors built from ONNX's own operators, identity models per v2
datatype for ONNX, TorchScript and python, and configs that contradict their graph.

    python -m tests.models.tensors OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from tests.support.models import onnx_model, write

# v2 datatype -> ONNX element type (every v2 datatype ONNX has, BF16 included)
ONNX_TYPES: dict[str, int] = {
    "BOOL": TensorProto.BOOL, "UINT8": TensorProto.UINT8, "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32, "UINT64": TensorProto.UINT64, "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16, "INT32": TensorProto.INT32, "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16, "FP32": TensorProto.FLOAT, "FP64": TensorProto.DOUBLE,
    "BF16": TensorProto.BFLOAT16, "BYTES": TensorProto.STRING,
}
# the datatypes Triton's pytorch backend (and ours) takes; the others are refused at load
TORCH_TYPES = ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64")
MAX_BATCH = 8


def config_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _value(name: str, elem: int, shape: list[int | str] | None) -> object:
    return helper.make_tensor_value_info(name, elem, shape)


def scalar_reduce() -> object:
    """X [r, c] FP32 -> SUM (ReduceSum, keepdims=0: a scalar), COUNT (Size: scalar INT64),
    COLS (Shape -> Gather with a scalar index: scalar INT64)."""
    nodes = [
        helper.make_node("ReduceSum", ["X"], ["SUM"], keepdims=0),
        helper.make_node("Size", ["X"], ["COUNT"]),
        helper.make_node("Shape", ["X"], ["SHAPE"]),
        helper.make_node("Gather", ["SHAPE", "ONE"], ["COLS"], axis=0),
    ]
    one = numpy_helper.from_array(np.array(1, dtype=np.int64), "ONE")
    return onnx_model(nodes, "scalar_reduce", [_value("X", TensorProto.FLOAT, ["r", "c"])],
                      [_value("SUM", TensorProto.FLOAT, []), _value("COUNT", TensorProto.INT64, []),
                       _value("COLS", TensorProto.INT64, [])], [one])


def scalar_shape() -> object:
    """Scalars that drive shapes: N (INT64 scalar) reshapes X into N rows (Reshape) and
    repeats V (FP32 scalar) N times (Expand); TOTAL = the scalar sum of X."""
    nodes = [
        helper.make_node("Unsqueeze", ["N", "AXIS0"], ["N1"]),
        helper.make_node("Concat", ["N1", "MINUS1"], ["RSHAPE"], axis=0),
        helper.make_node("Reshape", ["X", "RSHAPE"], ["R"]),
        helper.make_node("Expand", ["V", "N1"], ["E"]),
        helper.make_node("ReduceSum", ["X"], ["TOTAL"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array([0], dtype=np.int64), "AXIS0"),
             numpy_helper.from_array(np.array([-1], dtype=np.int64), "MINUS1")]
    return onnx_model(nodes, "scalar_shape",
                      [_value("N", TensorProto.INT64, []), _value("V", TensorProto.FLOAT, []),
                       _value("X", TensorProto.FLOAT, ["k"])],
                      [_value("R", TensorProto.FLOAT, ["a", "b"]), _value("E", TensorProto.FLOAT, ["n"]),
                       _value("TOTAL", TensorProto.FLOAT, [])], inits)


def scalar_double() -> object:
    """Y = 2 X over scalars (a graph that takes and gives one scalar per run)."""
    return onnx_model([helper.make_node("Mul", ["X", "TWO"], ["Y"])], "scalar_double",
                      [_value("X", TensorProto.FLOAT, [])], [_value("Y", TensorProto.FLOAT, [])],
                      [numpy_helper.from_array(np.array(2, dtype=np.float32), "TWO")])


def onnx_identity(datatype: str) -> object:
    elem = ONNX_TYPES[datatype]
    return onnx_model([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], f"identity_{datatype.lower()}",
                      [_value("INPUT0", elem, ["batch", "n"])], [_value("OUTPUT0", elem, ["batch", "n"])])


def identity_config(name: str, platform: str, datatype: str, extra: str = "", input_type: str | None = None,
                    inp: str = "INPUT0", out: str = "OUTPUT0") -> str:
    return (f'name: "{name}"\n{platform}\nmax_batch_size: {MAX_BATCH}\n'
            f'input [ {{ name: "{inp}" data_type: {input_type or config_type(datatype)} dims: [ -1 ] }} ]\n'
            f'output [ {{ name: "{out}" data_type: {config_type(datatype)} dims: [ -1 ] }} ]\n'
            f"dynamic_batching {{ }}\n{extra}")


def build_scalars(repo: Path) -> Path:
    """The scalar models (ONNX) and the configs that contradict their graphs."""
    write(repo, "scalar_reduce", """name: "scalar_reduce"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] },
         { name: "COLS" data_type: TYPE_INT64 dims: [ 1 ] } ]
""", {1: scalar_reduce()})
    write(repo, "scalar_shape", """name: "scalar_shape"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT64 dims: [ 1 ] }, { name: "V" data_type: TYPE_FP32 dims: [ 1 ] },
        { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "R" data_type: TYPE_FP32 dims: [ -1, -1 ] }, { name: "E" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "TOTAL" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", {1: scalar_shape()})
    # batched, a scalar per request (Triton's auto-complete writes dims [1] + reshape [] for it)
    write(repo, "scalar_batched", f"""name: "scalar_batched"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] reshape: {{ shape: [ ] }} }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] reshape: {{ shape: [ ] }} }} ]
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
""", {1: scalar_double()})
    # configs that contradict their graph: refused at load with Triton's reasons
    write(repo, "wrong_type", identity_config("wrong_type", 'platform: "onnxruntime_onnx"', "FP32",
                                              input_type="TYPE_INT32"), {1: onnx_identity("FP32")})
    write(repo, "wrong_name", identity_config("wrong_name", 'platform: "onnxruntime_onnx"', "FP32", inp="IN"),
          {1: onnx_identity("FP32")})
    write(repo, "wrong_rank", f"""name: "wrong_rank"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1, 2 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
""", {1: onnx_identity("FP32")})
    write(repo, "wrong_scalar", """name: "wrong_scalar"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", {1: scalar_double()})
    return repo


def build_onnx_identities(repo: Path) -> Path:
    """identity_<dt> for every v2 datatype (batched, dynamic batching: the gateway coalesces)."""
    for dt in ONNX_TYPES:
        name = f"identity_{dt.lower()}"
        write(repo, name, identity_config(name, 'platform: "onnxruntime_onnx"', dt), {1: onnx_identity(dt)})
    return repo


def build_torch_identities(repo: Path) -> Path:
    """ts_identity_<dt> for every v2 datatype: y = x.clone() (TorchScript); those the pytorch
    backend does not take are in the repository too (refused at load)."""
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

    for dt in ONNX_TYPES:
        name = f"ts_identity_{dt.lower()}"
        write(repo, name, identity_config(name, 'platform: "pytorch_libtorch"', dt, inp="INPUT__0", out="OUTPUT__0"),
              {1: lambda path: torch.jit.save(torch.jit.script(Identity()), str(path))}, "model.pt")
    return repo


TS_SCALAR_CONFIG = """name: "ts_scalar"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "N" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""


def build_torch_scalar(repo: Path) -> Path:
    """ts_scalar (TorchScript): SUM = N[0] * X.sum() and COUNT = X.numel(), both 0-d tensors.
    (TorchScript declares no ranks, and a config reshape to [] needs max_batch_size > 0: Triton's
    pytorch backend feeds N as [1], and so do we.)"""
    import torch

    class Scalar(torch.nn.Module):
        def forward(self, X: torch.Tensor, N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return N[0] * X.sum(), torch.tensor(X.numel(), dtype=torch.int64)

    write(repo, "ts_scalar", TS_SCALAR_CONFIG,
          {1: lambda path: torch.jit.save(torch.jit.script(Scalar()), str(path))}, "model.pt")
    return repo


PY_IDENTITY = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
'''


# BF16 has no NumPy view in Triton's python backend (as_numpy() raises): DLPack carries it
PY_IDENTITY_DLPACK = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").to_dlpack())]) for r in requests]
'''


def build_python_identities(repo: Path) -> Path:
    """py_identity_<dt> (python backend) for every v2 datatype (BF16 through DLPack)."""
    for dt in ONNX_TYPES:
        name = f"py_identity_{dt.lower()}"
        source = PY_IDENTITY_DLPACK if dt == "BF16" else PY_IDENTITY
        write(repo, name, identity_config(name, 'backend: "python"', dt),
              {1: lambda path, source=source: path.write_text(source)}, "model.py")
    return repo


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/meshserve-tensor-models")
    print(build_scalars(out), build_onnx_identities(out))
