"""Scalar (rank-0) tensors as Triton shapes them, through a real ONNX service and gateway with
tritonclient over HTTP (binary and JSON) and gRPC: a graph's scalar result answers with the
config's dims (`[1]`), a graph's scalar input is fed a true scalar (one that sets a shape answers
as onnxruntime does in process), a batched model whose input is a scalar per request runs each
request alone (the gateway does not merge them), and a config that contradicts its graph is
refused at load with Triton's reason."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, service_and_gateway
from tests.models.tensors import build_scalars, build_torch_scalar

# (protocol, binary): HTTP binary, HTTP JSON, gRPC
WIRES = [("http", True), ("http", False), ("grpc", True)]
HOPS = ["service", "gateway"]
GOOD = ["scalar_reduce", "scalar_shape", "scalar_batched"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scalars(tmp_path_factory.mktemp("scalars"))


@pytest.fixture(scope="module")
def procs(repo: Path) -> Iterator[dict[str, Proc]]:
    args = ["--repository", str(repo), "--model-control-mode", "explicit"]
    for name in GOOD:
        args += ["--load-model", name]
    with service_and_gateway("onnx", args) as (service, gateway):
        yield {"service": service, "gateway": gateway}


def _infer(url: str, proto: str, binary: bool, model: str, feeds: dict[str, np.ndarray],
           outputs: list[str]) -> dict[str, np.ndarray]:
    mod: Any = httpclient if proto == "http" else grpcclient
    inputs = []
    for name, value in feeds.items():
        inp = mod.InferInput(name, list(value.shape), "INT64" if value.dtype == np.int64 else "FP32")
        if proto == "http":
            inp.set_data_from_numpy(value, binary_data=binary)
        else:
            inp.set_data_from_numpy(value)
        inputs.append(inp)
    wanted = [mod.InferRequestedOutput(n, binary_data=binary) if proto == "http" else mod.InferRequestedOutput(n)
              for n in outputs]
    with mod.InferenceServerClient(url) as c:
        res = c.infer(model, inputs, outputs=wanted)
    out = {}
    for n in outputs:
        meta = res.get_output(n)
        shape = list(meta["shape"]) if proto == "http" else list(meta.shape)
        value = res.as_numpy(n)
        assert value is not None, n
        assert list(value.shape) == shape, (n, shape, value.shape)
        out[n] = value
    return out


def _in_process(repo: Path, model: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("hop", HOPS)
@pytest.mark.parametrize(("proto", "binary"), WIRES)
def test_scalar_outputs_answer_with_config_dims(procs: dict[str, Proc], repo: Path, hop: str, proto: str,
                                                binary: bool) -> None:
    """ReduceSum keepdims=0, Size and Shape->Gather give scalars: each answers with shape [1]
    (the config's dims), so ``out[0]`` works as it does against Triton."""
    for x in (np.arange(12, dtype=np.float32).reshape(3, 4) / 4, np.zeros((0, 5), np.float32)):  # (and zero-size)
        got = _infer(getattr(procs[hop], proto), proto, binary, "scalar_reduce", {"X": x}, ["SUM", "COUNT", "COLS"])
        want = _in_process(repo, "scalar_reduce", {"X": x})
        for name, expected in zip(["SUM", "COUNT", "COLS"], want, strict=True):
            assert expected.shape == ()  # the graph's own answer is a scalar
            assert got[name].shape == (1,), (name, got[name].shape)
            assert got[name][0] == expected, name
        assert got["COUNT"].dtype == np.int64 and got["SUM"].dtype == np.float32


@pytest.mark.parametrize("hop", HOPS)
@pytest.mark.parametrize(("proto", "binary"), WIRES)
def test_scalar_inputs_drive_shapes_as_in_process(procs: dict[str, Proc], repo: Path, hop: str, proto: str,
                                                  binary: bool) -> None:
    """N (a scalar) sets Reshape's rows and Expand's length; the answer equals onnxruntime's in
    process, for several N."""
    url = getattr(procs[hop], proto)
    for n in (1, 2, 3, 6):
        x = np.arange(6, dtype=np.float32) - 2.5
        feeds = {"N": np.array([n], dtype=np.int64), "V": np.array([0.25], dtype=np.float32), "X": x}
        got = _infer(url, proto, binary, "scalar_shape", feeds, ["R", "E", "TOTAL"])
        r, e, total = _in_process(repo, "scalar_shape", {"N": np.array(n, dtype=np.int64),
                                                         "V": np.array(0.25, dtype=np.float32), "X": x})
        assert r.shape == (n, 6 // n) and got["R"].shape == r.shape
        np.testing.assert_array_equal(got["R"], r)
        np.testing.assert_array_equal(got["E"], e)
        assert got["TOTAL"].shape == (1,) and got["TOTAL"][0] == total


def test_scalar_metadata_is_config_dims(procs: dict[str, Proc]) -> None:
    for proto in ("http", "grpc"):
        mod: Any = httpclient if proto == "http" else grpcclient
        with mod.InferenceServerClient(procs["gateway"].__getattribute__(proto)) as c:
            md = c.get_model_metadata("scalar_reduce")
            outs = md["outputs"] if proto == "http" else [{"name": o.name, "shape": list(o.shape)} for o in md.outputs]
            assert {o["name"]: list(o["shape"]) for o in outs} == {"SUM": [1], "COUNT": [1], "COLS": [1]}


@pytest.mark.parametrize("hop", HOPS)
@pytest.mark.parametrize(("proto", "binary"), WIRES)
def test_batched_scalar_input_runs_each_request_alone(procs: dict[str, Proc], hop: str, proto: str,
                                                      binary: bool) -> None:
    """A batched model whose graph takes a scalar: concurrent requests (which the dynamic
    batcher and the gateway's coalescer would otherwise merge) each get their own answer [1, 1];
    a request of two rows cannot feed one scalar and is a client error."""
    url = getattr(procs[hop], proto)

    def one(i: int) -> float:
        got = _infer(url, proto, binary, "scalar_batched", {"X": np.array([[i]], dtype=np.float32)}, ["Y"])
        assert got["Y"].shape == (1, 1)
        return float(got["Y"][0, 0])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [2.0 * i for i in range(16)]
    with pytest.raises(InferenceServerException) as err:
        _infer(url, proto, binary, "scalar_batched", {"X": np.array([[1], [2]], dtype=np.float32)}, ["Y"])
    assert "scalar" in str(err.value) and ("400" in str(err.value) or "INVALID_ARGUMENT" in str(err.value))


REFUSED = {
    "wrong_type": "unable to load model 'wrong_type', configuration expects datatype TYPE_INT32 for input "
                  "'INPUT0', model provides TYPE_FP32",
    # (the config pipeline, meshserve/repository/config.py, finds this one first, in its own words)
    "wrong_name": "'IN' is not an input of the ONNX model (inputs: INPUT0)",
    "wrong_rank": "model 'wrong_rank', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,-1]) but the "
                  "model configuration specifies 3 dimensions (an initial batch dimension because max_batch_size "
                  "> 0 followed by the explicit tensor shape, making complete shape [-1,-1,2])",
    "wrong_scalar": "unable to load model 'wrong_scalar', scalar tensor 'X', should only provide 1 in the model "
                    "configuration when the model doesn't support batching. Model configuration provided: [2].",
}


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_config_that_contradicts_its_graph_is_refused_at_load(procs: dict[str, Proc], proto: str) -> None:
    """Each refused with Triton's text (load_model's error and the repository index's reason),
    never READY; the service stays live and serves the others."""
    mod: Any = httpclient if proto == "http" else grpcclient
    with mod.InferenceServerClient(procs["service"].__getattribute__(proto)) as c:
        for model, text in REFUSED.items():
            with pytest.raises(InferenceServerException) as err:
                c.load_model(model)
            assert text in str(err.value), (model, str(err.value))
            assert not c.is_model_ready(model)
        index = c.get_model_repository_index()
        rows = index if proto == "http" else [{"name": m.name, "state": m.state, "reason": m.reason}
                                              for m in index.models]
        reasons = {r["name"]: (r.get("state"), r.get("reason", "")) for r in rows}
        for model, text in REFUSED.items():
            assert reasons[model][0] == "UNAVAILABLE" and text in reasons[model][1], (model, reasons[model])
        assert c.is_server_live() and c.is_model_ready("scalar_reduce")


@pytest.fixture(scope="module")
def torch_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    pytest.importorskip("torch", reason="the TorchScript leg needs torch (the [torch] extra)")
    repo = build_torch_scalar(tmp_path_factory.mktemp("ts_scalar"))
    with service_and_gateway("torchscript", ["--repository", str(repo)], timeout=120) as (service, gateway):
        yield {"service": service, "gateway": gateway}


@pytest.mark.parametrize("hop", HOPS)
@pytest.mark.parametrize(("proto", "binary"), WIRES)
def test_torchscript_scalars(torch_procs: dict[str, Proc], hop: str, proto: str, binary: bool) -> None:
    """A TorchScript model's 0-d results answer with the config dims [1]."""
    x = np.array([0.5, 1.5, -4.0], dtype=np.float32)
    got = _infer(getattr(torch_procs[hop], proto), proto, binary, "ts_scalar",
                 {"X": x, "N": np.array([3.0], dtype=np.float32)}, ["SUM", "COUNT"])
    assert got["SUM"].shape == (1,) and got["SUM"][0] == np.float32(3.0) * x.sum()
    assert got["COUNT"].shape == (1,) and got["COUNT"][0] == 3
