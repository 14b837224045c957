"""The fil service (Triton's FIL backend: tree models) behind the gateway, driven with the real
tritonclient over HTTP and gRPC.

Models are built here on synthetic data (tests/models/fil.py): XGBoost (JSON, UBJSON), LightGBM
and a scikit-learn random forest converted with Treelite; every answer is compared with the
library's own prediction (classification with and without predict_proba, regression). One
service and one gateway for the module.
"""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, Proc, service_and_gateway
from tests.models import fil  # the libraries it builds with are imported by build()
from tests.support.net import free_port
from tests.support.up import meshserve_up

pytest.importorskip("treelite", reason="the fil tests need the [fil] extra (treelite, tl2cgen, xgboost, lightgbm)")
pytest.importorskip("sklearn", reason="the fil tests build a scikit-learn random forest (the [dev] extra)")

PROTOCOLS = ("http", "grpc")
PROBE = "probe"


@dataclass
class FilStack:
    repo: Path
    models: dict[str, fil.FilModel]
    service: Proc
    gateway: Proc


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FilStack]:
    repo = tmp_path_factory.mktemp("fil-repo")
    models = {m.name: m for m in fil.build(repo)}
    shutil.copytree(repo / "lgb_regression", repo / PROBE)  # reloaded with configs FIL refuses
    with pytest.MonkeyPatch.context() as mp:  # the compiled forests: built by this service's loads
        mp.setenv("MESHSERVE_CACHE", str(tmp_path_factory.mktemp("fil-cache")))
        with service_and_gateway("fil", ["--repository", str(repo), "--model-control-mode", "explicit",
                                         "--load-model", "*"], timeout=180) as (service, gateway):
            yield FilStack(repo, models, service, gateway)


def _client(stack: FilStack, protocol: str) -> Any:
    return httpclient.InferenceServerClient(stack.gateway.http) if protocol == "http" \
        else grpcclient.InferenceServerClient(stack.gateway.grpc)


def _infer(client: Any, protocol: str, model: str, x: np.ndarray) -> np.ndarray:
    mod = httpclient if protocol == "http" else grpcclient
    inp = mod.InferInput("input__0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer(model, [inp], outputs=[mod.InferRequestedOutput("output__0")])
    out = res.as_numpy("output__0")
    assert out is not None
    return out


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_model_answers_as_its_library(stack: FilStack, protocol: str) -> None:
    x = fil.rows()
    with _client(stack, protocol) as c:
        for name, model in stack.models.items():
            assert c.is_model_ready(name), name
            fil.check(model, _infer(c, protocol, name, x))  # the whole batch in one request
            one = np.concatenate([_infer(c, protocol, name, x[i:i + 1]) for i in range(4)])
            fil.check(fil.FilModel(name, model.expected[:4], model.is_class_index,
                                   None if model.scores is None else model.scores[:4], model.threshold), one)


def test_metadata_and_config_as_triton_fil(stack: FilStack) -> None:
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        meta = c.get_model_metadata("xgb_proba")
        assert meta["platform"] == "fil"
        assert meta["inputs"] == [{"name": "input__0", "datatype": "FP32", "shape": [-1, fil.FEATURES]}]
        assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 3]}]
        config = c.get_model_config("lgb_regression")
        assert config["backend"] == "fil" and config["default_model_filename"] == "xgboost.model"
        assert config["parameters"]["model_type"]["string_value"] == "lightgbm"


def test_concurrent_rows_are_batched(stack: FilStack) -> None:
    """Single-row requests from many clients: every answer right, and the dynamic batcher ran
    fewer executions than it answered requests."""
    x, model = fil.rows(11), stack.models["lgb_regression"]
    expected = None
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        before = c.get_inference_statistics("lgb_regression").model_stats[0]
        expected = np.concatenate([_infer(c, "grpc", "lgb_regression", x[i:i + 1]) for i in range(len(x))])

    def one(i: int) -> np.ndarray:
        with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
            return np.concatenate([_infer(c, "grpc", "lgb_regression", x[j:j + 1]) for j in range(i, len(x), 16)])

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        parts = list(pool.map(one, range(16)))
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(part, expected[i::16])
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        after = c.get_inference_statistics("lgb_regression").model_stats[0]
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == 2 * len(x), (inferences, executions)
    assert executions < inferences, (inferences, executions)
    assert model.expected.shape[1] == 1


def test_a_config_fil_refuses_names_the_key(stack: FilStack) -> None:
    """A reload through the gateway's model control with a config FIL would not take: a client
    error naming the parameter; the version loaded before keeps serving (as in Triton)."""
    base = {"backend": "fil", "max_batch_size": 8,
            "input": [{"name": "input__0", "data_type": "TYPE_FP32", "dims": [fil.FEATURES]}],
            "output": [{"name": "output__0", "data_type": "TYPE_FP32", "dims": [1]}]}
    cases = {
        "output_class": {"model_type": "lightgbm"},
        "model_type": {"model_type": "catboost", "output_class": "false"},
        "threshold": {"model_type": "lightgbm", "output_class": "true", "threshold": "high"},
        "predict_proba": {"model_type": "lightgbm", "output_class": "false", "predict_proba": "true"},
    }
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        for key, parameters in cases.items():
            config = {**base, "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
            with pytest.raises(InferenceServerException) as err:
                c.load_model(PROBE, config=json.dumps(config))
            assert f"'{key}'" in err.value.message(), (key, err.value.message())
            assert str(stack.repo) not in err.value.message()
        features = {**base, "input": [{"name": "input__0", "data_type": "TYPE_FP32", "dims": [3]}],
                    "parameters": {"model_type": {"string_value": "lightgbm"},
                                   "output_class": {"string_value": "false"}}}
        with pytest.raises(InferenceServerException) as err:
            c.load_model(PROBE, config=json.dumps(features))
        assert f"takes {fil.FEATURES} features" in err.value.message(), err.value.message()
        assert c.is_model_ready(PROBE)
        fil.check(stack.models["lgb_regression"], _infer(c, "http", PROBE, fil.rows()))


def test_check_repo_names_the_fil_kind(stack: FilStack) -> None:
    done = subprocess.run([sys.executable, "-m", "meshserve", "check-repo", str(stack.repo)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[1]: line.split()[:3] for line in done.stdout.splitlines()[1:-1]}
    assert rows == {name: ["ok", name, "fil"] for name in [*stack.models, PROBE]}, done.stdout


def test_meshserve_up_starts_the_fil_service(stack: FilStack, tmp_path: Path) -> None:
    """`meshserve up` finds the kind from the registry row: one fil service, models served."""
    repo = tmp_path / "repo"
    shutil.copytree(stack.repo / "lgb_regression", repo / "lgb_regression")
    ports = [free_port(), free_port()]
    with meshserve_up("--repository", str(repo), "--metrics-port", "-1", "--http-port", str(ports[0]),
                      "--grpc-port", str(ports[1]), timeout=120) as up:
        assert "starting the fil service" in up.banner and "1 service process(es)" in up.banner, up.banner
        with grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}") as c:
            fil.check(stack.models["lgb_regression"], _infer(c, "grpc", "lgb_regression", fil.rows()))
        assert up.stop(signal.SIGTERM) == 0  # a clean exit on SIGTERM

