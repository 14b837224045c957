"""Small real ONNX models and repository builders for the repository tests."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

Dim = int | str | None


def _shape(dims: list[Dim]) -> list[int | str | None]:
    return list(dims)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


class OnnxModels:
    """Builders that write a model file and return its path."""

    @staticmethod
    def add_sub(path: Path, *, batch: bool = True, size: int = 16) -> Path:
        """INPUT0, INPUT1 -> OUTPUT0 = sum, OUTPUT1 = difference (Triton's add_sub)."""
        shape: list[Dim] = ["batch", size] if batch else [size]
        ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, _shape(shape)) for n in ("INPUT0", "INPUT1")]
        outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, _shape(shape)) for n in ("OUTPUT0", "OUTPUT1")]
        nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
                 helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]
        return _save(helper.make_graph(nodes, "add_sub", ins, outs), path)

    @staticmethod
    def fixed(path: Path) -> Path:
        """X [1, 4] float -> Y [1, 4]: a fixed first dimension, so no batching."""
        x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])
        y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])
        return _save(helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "fixed", [x], [y]), path)

    @staticmethod
    def strings(path: Path) -> Path:
        """TEXT [N] string -> ECHO [N] string: rank 1 with a dynamic first dimension."""
        x = helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["N"])
        y = helper.make_tensor_value_info("ECHO", TensorProto.STRING, ["N"])
        node = helper.make_node("Identity", ["TEXT"], ["ECHO"])
        return _save(helper.make_graph([node], "strings", [x], [y]), path)

    @staticmethod
    def with_initializer_input(path: Path) -> Path:
        """An old-style graph listing its weight W among the inputs; only X is a real input.
        The output shape is left out so that shape inference has to supply it."""
        x = helper.make_tensor_value_info("X", TensorProto.INT64, [None, 3])
        w_info = helper.make_tensor_value_info("W", TensorProto.INT64, [3])
        y = helper.make_tensor_value_info("Y", TensorProto.INT64, None)
        w = numpy_helper.from_array(np.array([1, 2, 3], dtype=np.int64), "W")
        graph = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["Y"])], "init", [x, w_info], [y],
                                  initializer=[w])
        return _save(graph, path)

    @staticmethod
    def bf16(path: Path) -> Path:
        """A bfloat16 identity, a type Triton's onnxruntime backend does not map."""
        x = helper.make_tensor_value_info("X", TensorProto.BFLOAT16, [2])
        y = helper.make_tensor_value_info("Y", TensorProto.BFLOAT16, [2])
        return _save(helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "bf16", [x], [y]), path)


@pytest.fixture
def onnx_models() -> type[OnnxModels]:
    return OnnxModels


ModelWriter = Callable[..., Path]


@pytest.fixture
def write_model(tmp_path: Path) -> ModelWriter:
    """write_model(name, config=None, versions=(1,), model=OnnxModels.add_sub | None, repo=...) -> dir.

    Writes ``<repo>/<name>/config.pbtxt`` (when config is given) and, per version, the model
    file built by ``model`` (an empty version directory when model is None)."""

    def write(name: str, config: str | None = None, *, versions: tuple[int, ...] = (1,),
              model: Callable[[Path], Path] | None = OnnxModels.add_sub,
              filename: str = "model.onnx", repo: Path | None = None) -> Path:
        model_dir = (repo or tmp_path / "models") / name
        model_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (model_dir / "config.pbtxt").write_text(config)
        for v in versions:
            (model_dir / str(v)).mkdir(exist_ok=True)
            if model is not None:
                model(model_dir / str(v) / filename)
        return model_dir

    return write
