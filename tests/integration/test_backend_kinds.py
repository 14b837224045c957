"""A new backend is its module plus one registry row: the throwaway "identity" kind
(tests/support/identity_backend.py), registered by MESHSERVE_EXTRA_KINDS alone, is checked by
check-repo, served by `meshserve service identity` behind a gateway (inference over HTTP and gRPC,
load and unload through the gateway's model control) and started by `meshserve up`, with the
real tritonclient."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import ROOT, start
from tests.support import eventually
from tests.support.identity_backend import ENV, MAGIC
from tests.support.net import free_port
from tests.support.up import meshserve_up

# one model per way a config names its kind: the backend, the platform, neither (the model file)
CONFIGS = {"by_backend": 'backend: "identity"', "by_platform": 'platform: "identity_numpy"', "by_file": ""}


def _repository(root: Path) -> Path:
    for name, naming in CONFIGS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.identity").write_text(MAGIC)
        (root / name / "config.pbtxt").write_text(f"""{naming}
max_batch_size: 8
dynamic_batching {{ }}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "INPUT1" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ -1 ] }} ]
""")
    return root


def _meshserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshserve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if k not in ENV}, **(env or {})})


def _infer(url: str, model: str, grpc: bool) -> None:
    mod = grpcclient if grpc else httpclient
    rng = np.random.default_rng(len(model))
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.integers(-100, 100, (3, 5)).astype(np.int32)
    ins = [mod.InferInput("INPUT0", [3, 4], "FP32"), mod.InferInput("INPUT1", [3, 5], "INT32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    with mod.InferenceServerClient(url) as c:
        res = c.infer(model, ins)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), b)


def test_check_repo_knows_the_kind_from_its_row_alone(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "repo")
    with_row = _meshserve("check-repo", str(repo), env=ENV)
    assert with_row.returncode == 0, with_row.stdout + with_row.stderr
    lines = {line.split()[1]: line.split() for line in with_row.stdout.splitlines()[1:-1]}
    assert {name: cols[:3] for name, cols in lines.items()} == {n: ["ok", n, "identity"] for n in CONFIGS}
    without = _meshserve("check-repo", str(repo))
    assert without.returncode == 1 and "unknown backend 'identity'" in without.stdout, without.stdout
    refused = _meshserve("service", "identity", "--repository", str(repo))
    assert refused.returncode == 2 and "invalid choice: 'identity'" in refused.stderr, refused.stderr


def test_a_service_of_the_new_kind_behind_a_gateway(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "repo")
    service = start(["service", "identity", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                     "--model-control-mode", "explicit", "--load-model", "by_backend", "--load-model", "by_file"],
                    env=ENV)
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                         "--discovery-interval", "0.5"], env=ENV)
        try:
            _infer(service.http, "by_backend", grpc=False)  # the service alone is a v2 server
            with httpclient.InferenceServerClient(gateway.http) as c:
                eventually(lambda: c.is_model_ready("by_file"), what="by_file ready at the gateway")
                assert not c.is_model_ready("by_platform")
                c.load_model("by_platform")  # model control: the replica that lists it loads it
                assert c.is_model_ready("by_platform")
                assert c.get_model_metadata("by_platform")["platform"] == "identity_numpy"
            for model in CONFIGS:
                _infer(gateway.http, model, grpc=False)
                _infer(gateway.grpc, model, grpc=True)
            with grpcclient.InferenceServerClient(gateway.grpc) as c:
                c.unload_model("by_backend")
                assert not c.is_model_ready("by_backend")
                # a load with a config override: the gateway finds the kind's replica from the row
                override = {"backend": "identity", "max_batch_size": 8,
                            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                                      {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [-1]}],
                            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                                       {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [-1]}]}
                c.load_model("by_backend", config=json.dumps(override))
                assert c.is_model_ready("by_backend")
            _infer(gateway.grpc, "by_backend", grpc=True)
        finally:
            gateway.stop()
    finally:
        service.stop()


def test_meshserve_up_starts_the_new_kind(tmp_path: Path) -> None:
    repo = _repository(tmp_path / "repo")
    http_port, grpc_port = free_port(), free_port()
    with meshserve_up("--repository", str(repo), "--metrics-port", "-1", "--http-port", str(http_port),
                      "--grpc-port", str(grpc_port), timeout=120, env=ENV) as up:
        assert "starting the identity service" in up.banner and "1 service process(es)" in up.banner, up.banner
        for model in CONFIGS:
            _infer(f"127.0.0.1:{http_port}", model, grpc=False)
            _infer(f"127.0.0.1:{grpc_port}", model, grpc=True)
        assert up.stop(signal.SIGTERM) == 0  # a clean exit on SIGTERM
