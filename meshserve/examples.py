"""Model files of the bundled example repository (examples/model_repository), made on first use.

The configs are committed; the ONNX files are generated here (the MLP is ~25 MB, over the
size we commit), deterministically from a fixed seed.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SEED = 20261121
OPSET = 17
IR_VERSION = 8
MLP_DIMS = (512, 2048, 2048, 512)


def save_onnx(model: Any, path: Path) -> None:
    """Check ``model`` and write it to ``path`` (its folder made as needed)."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def onnx_model(nodes: list, name: str, inputs: list, outputs: list, inits: list | None = None) -> object:
    """An ONNX model of one graph at meshserve's opset and IR version (what every model here is)."""
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, inits or []),
                              opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def add_sub(elem: int) -> object:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 over [batch, 16]."""
    from onnx import helper

    ins = [helper.make_tensor_value_info(n, elem, ["batch", 16]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, elem, ["batch", 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]
    return onnx_model(nodes, "add_sub", ins, outs)


def mlp(seed: int = SEED) -> object:
    """FP32 [batch, 512] -> 2048 -> ReLU -> 2048 -> ReLU -> 512, He-scaled normal weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "INPUT0"
    n = len(MLP_DIMS) - 1
    for i in range(n):
        fan_in, fan_out = MLP_DIMS[i], MLP_DIMS[i + 1]
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        b = (rng.standard_normal(fan_out) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"B{i}")]
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"mm{i}"]))
        out = "OUTPUT0" if i == n - 1 else f"add{i}"
        nodes.append(helper.make_node("Add", [f"mm{i}", f"B{i}"], [out]))
        if i < n - 1:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"]))
            prev = f"relu{i}"
    return onnx_model(nodes, "mlp",
                      [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", MLP_DIMS[0]])],
                      [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", MLP_DIMS[-1]])],
                      inits)


def scale(factor: float) -> object:
    """OUTPUT0 = INPUT0 * factor over [batch, 4] (one model per version: factor = version)."""
    from onnx import TensorProto, helper, numpy_helper

    k = numpy_helper.from_array(np.array([factor], dtype=np.float32), "K")
    return onnx_model([helper.make_node("Mul", ["INPUT0", "K"], ["OUTPUT0"])], "scale",
                      [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])],
                      [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])], [k])


def builders() -> dict[str, Callable[[], object]]:
    from onnx import TensorProto

    return {
        "add_sub/1/model.onnx": lambda: add_sub(TensorProto.FLOAT),
        "add_sub_int32/1/model.onnx": lambda: add_sub(TensorProto.INT32),
        "mlp/1/model.onnx": mlp,
        "scale/1/model.onnx": lambda: scale(1.0),
        "scale/2/model.onnx": lambda: scale(2.0),
    }


def ensure(repo: Path, progress: Callable[[str], None] = print, force: bool = False,
           only: set[str] | None = None) -> None:
    """Generate any missing model file of the example repository (`only`: these models)."""
    todo = [(rel, build) for rel, build in builders().items()
            if (force or not (repo / rel).exists()) and (only is None or rel.split("/")[0] in only)]
    for i, (rel, build) in enumerate(todo, 1):
        progress(f"generating example model {rel} ({i}/{len(todo)})")
        save_onnx(build(), repo / rel)
