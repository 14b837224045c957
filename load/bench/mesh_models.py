"""Generated models for the model mesh (docs/model-mesh.md): many small ONNX models that each
hold a weight of a chosen size and answer something that names them, so a client can tell that
the right model answered. Used by the mesh tests (tests/integration/test_model_mesh.py) and the
mesh benchmark (load/bench/mesh.py).

Model ``i``: OUTPUT0 = INPUT0 + i over FP32 [batch, 16], computed as INPUT0 + W[k] with W a
[rows, 16] weight filled with i and k = int(min(INPUT0 * 0)) = 0: an index the runtime cannot know
before the request, so W is not constant-folded away (a reduction of W alone was: onnxruntime kept
16 floats of it) and stays resident, rows x 64 bytes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

WIDTH = 16


def mesh_model(index: int, rows: int) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    from meshserve.examples import onnx_model

    weight = numpy_helper.from_array(np.full((rows, WIDTH), float(index), dtype=np.float32), "W")
    zero = numpy_helper.from_array(np.zeros((), dtype=np.float32), "zero")
    # the row's index comes from the input (always 0), so no runtime can fold W away: it stays resident
    nodes = [helper.make_node("Mul", ["INPUT0", "zero"], ["z"]),
             helper.make_node("ReduceMin", ["z"], ["zmin"], keepdims=0),
             helper.make_node("Cast", ["zmin"], ["row"], to=TensorProto.INT64),
             helper.make_node("Gather", ["W", "row"], ["w"], axis=0),
             helper.make_node("Add", ["INPUT0", "w"], ["OUTPUT0"])]
    return onnx_model(nodes, f"mesh_{index}",
                      [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", WIDTH])],
                      [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", WIDTH])], [weight, zero])


def config(name: str) -> str:
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            f'input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
            "instance_group [ { kind: KIND_CPU count: 1 } ]\n")


def name_of(index: int) -> str:
    return f"mesh_{index:03d}"


def write(repo: Path, index: int, rows: int) -> str:
    """Write model ``index`` (``rows`` x 64 bytes of weight) into ``repo``; its name."""
    import onnx

    name = name_of(index)
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config(name))
    onnx.save(mesh_model(index, rows), str(folder / "1" / "model.onnx"))
    return name


def write_broken(repo: Path, name: str) -> None:
    """A model whose file is not ONNX: its load fails (the reason names the file, not a path)."""
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config(name))
    (folder / "1" / "model.onnx").write_bytes(b"this is not an onnx model\n")


def expected(index: int, inputs: np.ndarray) -> np.ndarray:
    return inputs + np.float32(index)
