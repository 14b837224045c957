"""The test models, built in one place, and how they are written into a Triton-layout repository.

ONNX models come from ``meshserve.examples`` where it has them (add_sub, mlp, scale: the example
repository ``meshserve up`` builds, so it stays in the package) and from here otherwise; both go
through ``onnx_model`` (one opset and IR version). The TorchScript models need torch (the
[torch] extra) and import it only when built. Which models a repository holds, under which
configs, is the business of its recipe (``tests/models/generate.py``, ``tests/models/sequence.py``,
``tests/deploy/support.py``, a test's own fixture); they all write through ``write``.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshserve import examples
from meshserve.examples import add_sub, mlp, onnx_model, save_onnx, scale

__all__ = ["add_sub", "ensemble_config", "example_models", "fixed_add", "identity", "mlp", "onnx_model", "pair_config", "save_onnx",
           "scale", "small_mlp", "step", "torch_add_sub", "torch_affine_export", "write"]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_repository"


def example_models(repo: Path, *names: str) -> Path:
    """``repo`` (made when missing) holding the example repository's models ``names`` (config,
    code), their model files generated as `meshserve up` generates them (``examples.ensure``)."""
    repo.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(EXAMPLES / name, repo / name, dirs_exist_ok=True)
    examples.ensure(repo, progress=lambda _: None, only=set(names))
    return repo


# what ``write`` takes for one version: an ONNX model, or a function that writes the file at a path
Model = Any
Writer = Callable[[Path], None]


def write(repo: Path, name: str, config: str, versions: Mapping[int, Model | Writer],
          filename: str = "model.onnx") -> Path:
    """``repo/name/config.pbtxt`` and ``repo/name/<version>/<filename>`` per version: an ONNX
    model is saved as it is (unchecked: some test models are wrong on purpose), a callable is
    called with the file's path. Returns the model's folder."""
    import onnx

    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config)
    for version, model in versions.items():
        path = folder / str(version) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(model):
            model(path)
        else:
            onnx.save(model, str(path))
    return folder


def pair_config(name: str, platform: str, width: int, inputs: tuple[str, str] = ("INPUT0", "INPUT1"),
                outputs: tuple[str, str] = ("OUTPUT0", "OUTPUT1"), max_batch_size: int = 8, extra: str = "") -> str:
    """The config.pbtxt of an add_sub-shaped model: two FP32 inputs and two FP32 outputs of
    [width] each, batched up to ``max_batch_size``; ``extra``: lines appended as they are."""
    def tensors(names: tuple[str, str]) -> str:
        return ",\n".join(f'  {{ name: "{n}" data_type: TYPE_FP32 dims: [ {width} ] }}' for n in names)

    return (f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: {max_batch_size}\n'
            f"input [\n{tensors(inputs)}\n]\noutput [\n{tensors(outputs)}\n]\n{extra}")


def step(model: str, inputs: Mapping[str, str], outputs: Mapping[str, str], version: int = -1) -> str:
    """One step of an ensemble's ``ensemble_scheduling``: ``inputs`` and ``outputs`` map the
    model's tensor names to the ensemble's."""
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: {version} {" ".join(maps)} }}'


def ensemble_config(name: str, inputs: Mapping[str, int], outputs: Mapping[str, int], steps: Sequence[str],
                    max_batch_size: int = 8) -> str:
    """The config.pbtxt of a platform "ensemble" model: FP32 tensors of [dims] each (name ->
    dims), its ``steps`` (``step``) in order."""
    def tensors(specs: Mapping[str, int]) -> str:
        return ", ".join(f'{{ name: "{n}" data_type: TYPE_FP32 dims: [ {d} ] }}' for n, d in specs.items())

    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
            f"input [ {tensors(inputs)} ]\noutput [ {tensors(outputs)} ]\n"
            "ensemble_scheduling { step [\n  " + ",\n  ".join(steps) + "\n] }\n")


# ---- ONNX ------------------------------------------------------------------------------------
def identity(elem: int, width: int | str = "n", name: str = "identity") -> Model:
    """OUTPUT0 = INPUT0 over [batch, width] (any element type, incl. strings)."""
    from onnx import helper

    return onnx_model([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], name,
                      [helper.make_tensor_value_info("INPUT0", elem, ["batch", width])],
                      [helper.make_tensor_value_info("OUTPUT0", elem, ["batch", width])])


def small_mlp(seed: int = 7) -> Model:
    """FP32 [batch, 64] -> 256 -> ReLU -> 64, fixed random weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((64, 256)) * 0.1).astype(np.float32), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((256, 64)) * 0.1).astype(np.float32), "W2")
    nodes = [helper.make_node("MatMul", ["INPUT0", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["OUTPUT0"])]
    return onnx_model(nodes, "small_mlp",
                      [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 64])],
                      [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 64])], [w1, w2])


def fixed_add() -> Model:
    """No batch dimension: OUTPUT0 = INPUT0 + INPUT1 over [4]."""
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("INPUT0", "INPUT1")]
    return onnx_model([helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"])], "fixed_add",
                      ins, [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [4])])


# ---- TorchScript -----------------------------------------------------------------------------
def torch_add_sub(width: int) -> Writer:
    """Writes a traced TorchScript archive: (a, b) -> (a + b, a - b) over [batch, width]
    (positional INPUT__0/INPUT__1 -> OUTPUT__0/OUTPUT__1 in a config)."""
    def save(path: Path) -> None:
        import torch

        class AddSub(torch.nn.Module):  # type: ignore[misc,name-defined]
            def forward(self, a: Any, b: Any) -> tuple[Any, Any]:
                return a + b, a - b

        # traced, not scripted: tracing needs no TorchScript type annotations
        example = (torch.zeros(2, width), torch.zeros(2, width))
        torch.jit.trace(AddSub(), example).save(str(path))

    return save


def torch_affine_export() -> Writer:
    """Writes a torch.export archive (``model.pt2``): x -> x * [1, 2, 3] + 1 over [batch, 3],
    batch 1..8 (the weights are a buffer, so they move with the module to a GPU)."""
    import torch

    class Affine(torch.nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.tensor([1.0, 2.0, 3.0]))

        def forward(self, x: Any) -> Any:
            return x * self.w + 1.0

    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(Affine(), (torch.zeros(2, 3),), dynamic_shapes={"x": {0: batch}})
    return lambda path: torch.export.save(program, str(path))
