"""Models of a chosen size for the memory-budget tests: their weights are what they cost.

``onnx_matmul``: y = x @ W with W an n x n FP32 initializer filled with ``value / n`` (so a row
of ones answers ``value`` in every column: each model's answer tells which model ran);
``torch_linear``: the same as TorchScript; ``onnx_chain`` / ``torch_chain``: the same size in many
n x n layers (how real models hold their weights); ``python_weights``: a python model that loads an
n x n FP32 array from its version directory in initialize() and answers the same, sleeping
INPUT ``ms`` milliseconds first when it has that input (the slow request of the eviction tests).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.models import python_models


def _config(name: str, platform: str, n: int, extra: str = "") -> str:
    return (f'name: "{name}"\n{platform}\nmax_batch_size: 0\n'
            f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1, {n} ] }}{extra} ]\n'
            f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1, {n} ] }} ]\n'
            'instance_group [ { count: 1 kind: KIND_CPU } ]\n')


def onnx_matmul(repo: Path, name: str, n: int, value: float) -> Path:
    """An ONNX model of n*n*4 bytes of weights (one tensor) under ``repo/name`` (version 1)."""
    return onnx_chain(repo, name, n, value, layers=1)


def _layer_value(i: int, layers: int, value: float) -> float:
    """Each layer's weights differ (onnxruntime shares initializers of equal contents: 48 equal
    layers held 2 MiB, not 48); the product of the layers is ``value`` within 0.2%."""
    return value if i == layers - 1 else 1.0 + i * 1e-6


def onnx_chain(repo: Path, name: str, n: int, value: float, layers: int = 48) -> Path:
    """An ONNX model of ``layers`` MatMuls of n x n FP32 weights (many mid-sized tensors, as real
    models have: what the heap, not mmap, serves); a row of ones answers ``value`` (within 0.2%)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        w = np.full((n, n), _layer_value(i, layers, value) / n, np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [out]))
        prev = out
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], inits)
    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(_config(name, 'platform: "onnxruntime_onnx"', n))
    return folder


def torch_chain(repo: Path, name: str, n: int, value: float, layers: int = 48) -> Path:
    """``onnx_chain`` as TorchScript: ``layers`` bias-free Linear layers of n x n."""
    import torch

    linears = [torch.nn.Linear(n, n, bias=False) for _ in range(layers)]
    with torch.no_grad():
        for i, layer in enumerate(linears):
            layer.weight.fill_(_layer_value(i, layers, value) / n)
    return _save_torch(repo, name, n, torch.jit.script(torch.nn.Sequential(*linears)))


def torch_linear(repo: Path, name: str, n: int, value: float) -> Path:
    """A TorchScript model of n*n*4 bytes of weights (one tensor) under ``repo/name`` (version 1)."""
    return torch_chain(repo, name, n, value, layers=1)


def _save_torch(repo: Path, name: str, n: int, module: object) -> Path:
    import torch

    folder = repo / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    torch.jit.save(module, str(folder / "1" / "model.pt"))
    text = _config(name, 'platform: "pytorch_libtorch"', n).replace('name: "x"', 'name: "INPUT__0"')
    (folder / "config.pbtxt").write_text(text.replace('name: "y"', 'name: "OUTPUT__0"'))
    return folder


PYTHON_WEIGHTS = python_models.with_helpers('''
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        self.weights = np.load(os.path.join(here, "weights.npy"))

    def execute(self, requests):
        responses = []
        for request in requests:
            ms = pb_utils.get_input_tensor_by_name(request, "ms")
            if ms is not None:
                work_for(float(ms.as_numpy().reshape(-1)[0]))
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = (x @ self.weights).astype(np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y)]))
        return responses
''', python_models.WORK_FOR)


def python_weights(repo: Path, name: str, n: int, value: float) -> Path:
    """A python model holding n*n*4 bytes of weights (read from its files) under ``repo/name``."""
    folder = python_models.write(repo, name, PYTHON_WEIGHTS, None)
    np.save(folder / "1" / "weights.npy", np.full((n, n), value / n, np.float32))
    extra = ', { name: "ms" data_type: TYPE_FP32 dims: [ 1 ] optional: true }'
    (folder / "config.pbtxt").write_text(_config(name, 'backend: "python"', n, extra))
    return folder


def row_of_ones(n: int) -> np.ndarray:
    return np.ones((1, n), np.float32)
