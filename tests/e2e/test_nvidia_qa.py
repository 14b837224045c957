"""NVIDIA's own QA test of request validation (triton-inference-server/server
qa/L0_input_validation/input_validation_test.py), run unchanged as a subprocess against `meshserve
up` serving what its test.sh serves, on the port it hard-codes (localhost:8001):

- ``InputValTest`` on its own models (qa/L0_input_validation/models: python models with required
  and optional inputs): Triton's texts for missing inputs;
- ``InputShapeTest::test_input_shape_validation`` on ``pt_identity`` (a TorchScript identity made
  as test.sh makes it): Triton's text for an input's byte size;
- ``ModelNameValidationTest`` on an empty repository: Triton's checks of a loaded model's name.

Not run: ``InputShapeTest::test_input_string_shape_validation`` (with two wrong inputs Triton names
the one its hash map lists first, meshserve the first in the request: docs/datatypes.md) and
``test_wrong_input_shape_tensor_size`` (TensorRT shape-tensor models from NVIDIA's data volume).

The QA folder is not in this tree: point MESHSERVE_NVIDIA_QA at the ``qa`` folder of a server
snapshot (docs/nvidia-examples.md: one `git archive` of ``qa/L0_input_validation`` and
``qa/common``); without it the tests are skipped. Nothing here needs the network.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.up import meshserve_up

ENV = "MESHSERVE_NVIDIA_QA"
QA = Path(os.environ[ENV]) if os.environ.get(ENV) else None
PORTS = ("--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002")  # (the test's own)

pytestmark = pytest.mark.skipif(QA is None, reason=f"{ENV} is not set (the qa folder of NVIDIA's server "
                                "repository; docs/nvidia-examples.md says how to get it)")

PT_IDENTITY = """name: "pt_identity"
backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [8] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [8] } ]
dynamic_batching { max_queue_delay_microseconds: 1000000 }
"""


def _run(selector: str) -> None:
    """input_validation_test.py's ``selector`` with pytest, from its own folder, as test.sh runs it."""
    assert QA is not None
    folder = QA / "L0_input_validation"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"input_validation_test.py::{selector}"], cwd=folder, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_input_validation(tmp_path: Path) -> None:
    assert QA is not None
    repo = tmp_path / "models"
    shutil.copytree(QA / "L0_input_validation" / "models", repo)
    with meshserve_up("--repository", str(repo), *PORTS, timeout=180):
        _run("InputValTest")


def test_input_shape_validation(tmp_path: Path) -> None:
    import torch

    model = tmp_path / "models" / "pt_identity"
    (model / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(torch.nn.Identity()), str(model / "1" / "model.pt"))
    (model / "config.pbtxt").write_text(PT_IDENTITY)
    with meshserve_up("--repository", str(tmp_path / "models"), *PORTS, timeout=180):
        _run("InputShapeTest::test_input_shape_validation")


def test_model_name_validation(tmp_path: Path) -> None:
    (tmp_path / "test_models").mkdir()
    with meshserve_up("--repository", str(tmp_path / "test_models"), *PORTS, timeout=180):
        _run("ModelNameValidationTest")
