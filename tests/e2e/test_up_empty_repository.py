"""`meshserve up` on an empty repository, as Triton starts on one (explicit model control): a
service of every kind this build runs is started, so a model copied in later is loaded through
the repository API and served; and a load names the model as Triton's checks want it (NVIDIA's
qa/L0_input_validation ModelNameValidationTest, whose texts are asserted here with its names)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from meshserve import examples
from tests.conftest import ROOT
from tests.support.net import free_port
from tests.support.up import meshserve_up

TRAVERSAL = ["../etc", "a/../b", "../../etc/passwd", "model/..", "..", "/etc/passwd", "model/subdir", "model/",
             " ..", ".. "]
EMPTY = ["", " ", "   ", "\t", "\n", "\r", "\f", "\v", " \t \n "]


def test_up_starts_on_an_empty_repository_and_loads_what_is_copied_in_later(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    grpc_port = free_port()
    with meshserve_up("--repository", str(repo), "--metrics-port", "0", "--http-port", "0",
                      "--grpc-port", str(grpc_port), timeout=180) as up:
        assert "holds no model yet: starting a service of every kind" in up.banner
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as c:
            assert c.is_server_ready() and c.get_model_repository_index().models == []
            for name in TRAVERSAL + EMPTY:
                with pytest.raises(InferenceServerException) as err:
                    c.load_model(name)
                want = "Model name cannot be empty. Please enter a valid name to deploy." if name in EMPTY else \
                    "model name must not contain path traversal characters"
                assert want in err.value.message(), name
                assert err.value.status() == "StatusCode.INVALID_ARGUMENT", name
            shutil.copytree(ROOT / "examples" / "model_repository" / "add_sub", repo / "add_sub")
            examples.ensure(repo, progress=lambda _: None, only={"add_sub"})
            c.load_model("add_sub")
            a = np.arange(16, dtype=np.float32).reshape(1, 16)
            inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
            for inp in inputs:
                inp.set_data_from_numpy(a)
            out = c.infer("add_sub", inputs)
            np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + a)
