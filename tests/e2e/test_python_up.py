"""`meshserve up` on a repository with python models next to an ONNX one: it starts the python
service with the gateway's gRPC address (also when the gateway's port is picked at start), so a
python model's BLS call reaches the ONNX model through the gateway; Ctrl-C stops the workers too,
each after its model's finalize() (NVIDIA's qa/L0_backend_python/decoupled counts its "Finalize
invoked" lines after the server stops). A model's pb_utils.Logger lines at INFO show at `up`'s
default level, as Triton shows them by default; VERBOSE ones do not."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from tests.models import python_models as pm
from tests.support.models import example_models
from tests.support.up import meshserve_up
from tests.support.waiting import eventually

# logs from initialize() and finalize(), as NVIDIA's decoupled QA models do
GREETS = pm.model_source("responses.append(pb_utils.InferenceResponse([]))").replace(
    "class TritonPythonModel:\n", """class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info("greets: initialize info")
        pb_utils.Logger.log_verbose("greets: initialize verbose")

    def finalize(self):
        pb_utils.Logger.log_info("greets: Finalize invoked")

""")


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "services.python.worker"], capture_output=True, text=True).stdout
    mine = []
    for p in out.split():
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            grand = int(Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if grand == pid:  # up -> python service -> worker
            mine.append(int(p))
    return mine


def test_up_runs_python_models_and_their_bls_calls(tmp_path: Path) -> None:
    repo = example_models(tmp_path / "repo", "add_sub")
    pm.write(repo, "bls_sync", pm.BLS_SYNC, pm.config("bls_sync", [*pm.PAIR_IN, ("MODEL_NAME", "TYPE_STRING", "1")],
                                                      pm.PAIR_OUT))
    pm.write(repo, "greets", GREETS, pm.config("greets", [("X", "TYPE_FP32", "1")], [("Y", "TYPE_FP32", "1")]))
    with meshserve_up("--metrics-port", "0", "--repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                      timeout=120) as up:
        banner = up.banner
        assert "starting the python service" in banner
        port = re.search(r"gRPC\s+localhost:(\d+)", banner)
        assert port is not None, banner
        workers = _workers(up.pid)
        assert workers, "the python service runs its model in a worker process"
        x = np.arange(16, dtype=np.float32)
        ins = [grpcclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
        ins.append(grpcclient.InferInput("MODEL_NAME", [1], "BYTES"))
        ins[0].set_data_from_numpy(x)
        ins[1].set_data_from_numpy(x * 2)
        ins[2].set_data_from_numpy(np.array([b"add_sub"], dtype=np.object_))
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port.group(1)}") as c:
            res = c.infer("bls_sync", ins)
        np.testing.assert_allclose(res.as_numpy("OUTPUT0"), x * 3)
        np.testing.assert_allclose(res.as_numpy("OUTPUT1"), -x)
        assert "greets: initialize info" in up.log(2000) and "greets: initialize verbose" not in up.log(2000)
        assert up.interrupt() == 0  # Ctrl-C
        assert [w for w in workers if Path(f"/proc/{w}").exists()] == []  # finalize()d and gone
        # (started from a load thread, a worker was killed when the service ended its load pool)
        eventually(lambda: "greets: Finalize invoked" in up.log(2000), timeout=10, what="finalize()'s line")
        assert "is down" not in up.log(2000)
