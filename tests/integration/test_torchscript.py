"""The TorchScript service behind the gateway, driven with the real tritonclient (HTTP + gRPC).

Models are generated here with torch==2.13.0 (CPU): traced and scripted TorchScript archives
(`model.pt`) covering Triton's naming conventions, and one torch.export archive (`model.pt2`).
"""
from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start
from tests.support import models

torch = pytest.importorskip("torch", reason="the TorchScript tests need torch==2.13.0 (the [torch] extra)")

PROTOCOLS = ("http", "grpc")

ADD_SUB = models.pair_config("ts_add_sub", "pytorch_libtorch", 4, ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1"),
                             extra="dynamic_batching { max_queue_delay_microseconds: 20000 }\n")

NAMED = """name: "ts_named"
backend: "pytorch"
max_batch_size: 4
input [
  { name: "scale" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "x" data_type: TYPE_INT64 dims: [ 3 ] }
]
output [
  { name: "total" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "scaled" data_type: TYPE_INT64 dims: [ 3 ] }
]
"""

DICT_IN = """name: "ts_dict_in"
platform: "pytorch_libtorch"
max_batch_size: 0
input [
  { name: "a" data_type: TYPE_FP32 dims: [ 2, 2 ] },
  { name: "b" data_type: TYPE_FP32 dims: [ 2, 2 ] }
]
output [ { name: "prod" data_type: TYPE_FP32 dims: [ 2, 2 ] } ]
parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }
parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
"""

EXPORTED = """name: "pt2_affine"
backend: "pytorch"
default_model_filename: "model.pt2"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
"""

STRINGS = """name: "ts_strings"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def _write(repo: Path, name: str, config: str, filename: str, save: Any) -> None:
    models.write(repo, name, config, {1: lambda path: save(str(path))}, filename)


def build_models(repo: Path) -> Path:
    nn = torch.nn

    class Named(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
            scaled = x * scale
            return {"scaled": scaled, "total": scaled.sum(dim=1, keepdim=True)}

    class DictIn(nn.Module):
        def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return inputs["a"] @ inputs["b"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        models.write(repo, "ts_add_sub", ADD_SUB, {1: models.torch_add_sub(4)}, "model.pt")
        _write(repo, "ts_named", NAMED, "model.pt", lambda p: torch.jit.script(Named()).save(p))
        _write(repo, "ts_dict_in", DICT_IN, "model.pt", lambda p: torch.jit.script(DictIn()).save(p))
        _write(repo, "ts_strings", STRINGS, "model.pt", lambda p: torch.jit.script(DictIn()).save(p))
    affine = models.torch_affine_export()
    models.write(repo, "pt2_affine", EXPORTED, {1: affine}, "model.pt2")
    # no default_model_filename: a version directory holding only model.pt2 is found too
    plain = EXPORTED.replace('name: "pt2_affine"', 'name: "pt2_plain"').replace(
        'default_model_filename: "model.pt2"\n', "")
    models.write(repo, "pt2_plain", plain, {1: affine}, "model.pt2")
    return repo


class Stack:
    def __init__(self, service: Proc, gateway: Proc):
        self.service = service
        self.gateway = gateway

    def url(self, proto: str) -> str:
        return self.gateway.http if proto == "http" else self.gateway.grpc


@pytest.fixture(scope="module")
def ts_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    repo = build_models(tmp_path_factory.mktemp("torchscript"))
    service = start(["service", "torchscript", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc])
    except Exception:
        service.stop()
        raise
    try:
        _wait_http_ready(gateway.http)
        yield Stack(service, gateway)
    finally:
        gateway.stop()
        service.stop()


def _client(proto: str, url: str) -> Any:
    return httpclient.InferenceServerClient(url) if proto == "http" else grpcclient.InferenceServerClient(url)


def _input(proto: str, name: str, arr: np.ndarray, datatype: str) -> Any:
    module = httpclient if proto == "http" else grpcclient
    inp = module.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr)
    return inp


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_positional_io_traced_model(ts_stack: Stack, proto: str) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.full((3, 4), 2.0, dtype=np.float32)
    with _client(proto, ts_stack.url(proto)) as c:
        assert c.is_model_ready("ts_add_sub")
        result = c.infer("ts_add_sub", [_input(proto, "INPUT__0", a, "FP32"), _input(proto, "INPUT__1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a - b)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_named_inputs_and_dict_outputs_int64(ts_stack: Stack, proto: str) -> None:
    # config order (scale, x) differs from forward(x, scale): names, not positions, must decide
    x = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    scale = np.array([[10], [-1]], dtype=np.int64)
    with _client(proto, ts_stack.url(proto)) as c:
        result = c.infer("ts_named", [_input(proto, "scale", scale, "INT64"), _input(proto, "x", x, "INT64")])
        only = c.infer("ts_named", [_input(proto, "scale", scale, "INT64"), _input(proto, "x", x, "INT64")],
                       outputs=[(httpclient.InferRequestedOutput if proto == "http"
                                 else grpcclient.InferRequestedOutput)("total")])
    assert result.as_numpy("scaled").dtype == np.int64
    np.testing.assert_array_equal(result.as_numpy("scaled"), x * scale)
    np.testing.assert_array_equal(result.as_numpy("total"), (x * scale).sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(only.as_numpy("total"), [[60], [-15]])
    assert only.as_numpy("scaled") is None


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_dict_input_single_tensor_output(ts_stack: Stack, proto: str) -> None:
    a = np.array([[1, 2], [3, 4]], dtype=np.float32)
    b = np.array([[0, 1], [1, 0]], dtype=np.float32)
    with _client(proto, ts_stack.url(proto)) as c:
        result = c.infer("ts_dict_in", [_input(proto, "a", a, "FP32"), _input(proto, "b", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("prod"), a @ b)


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("model", ["pt2_affine", "pt2_plain"])
def test_torch_export_archive(ts_stack: Stack, proto: str, model: str) -> None:
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    with _client(proto, ts_stack.url(proto)) as c:
        result = c.infer(model, [_input(proto, "x", x, "FP32")])
    np.testing.assert_allclose(result.as_numpy("y"), x * np.array([1, 2, 3], dtype=np.float32) + 1)


def test_metadata_and_config(ts_stack: Stack) -> None:
    with httpclient.InferenceServerClient(ts_stack.gateway.http) as c:
        md = c.get_model_metadata("ts_add_sub")
        assert md["platform"] == "pytorch_libtorch"
        assert [i["name"] for i in md["inputs"]] == ["INPUT__0", "INPUT__1"]
        assert md["inputs"][0]["shape"] == [-1, 4]
        cfg = c.get_model_config("ts_named")
        assert cfg["backend"] == "pytorch"


def test_string_model_refused_with_a_clear_reason(ts_stack: Stack) -> None:
    with httpclient.InferenceServerClient(ts_stack.service.http) as c:
        index = {m["name"]: m for m in c.get_model_repository_index()}
        assert not c.is_model_ready("ts_strings")
    entry = index["ts_strings"]
    assert entry["state"] == "UNAVAILABLE"
    assert "TYPE_STRING" in entry["reason"] and "TorchScript" in entry["reason"], entry


def test_concurrent_requests_are_batched(ts_stack: Stack) -> None:
    def stats() -> dict:
        with httpclient.InferenceServerClient(ts_stack.gateway.http) as c:
            return c.get_inference_statistics("ts_add_sub")["model_stats"][0]

    before = stats()
    ones = np.ones((1, 4), dtype=np.float32)

    def worker(i: int) -> bool:
        with grpcclient.InferenceServerClient(ts_stack.gateway.grpc) as c:
            ok = True
            for _ in range(4):
                a = ones * i
                out = c.infer("ts_add_sub", [_input("grpc", "INPUT__0", a, "FP32"),
                                             _input("grpc", "INPUT__1", ones, "FP32")])
                ok &= bool(np.array_equal(out.as_numpy("OUTPUT__0"), a + 1))
            return ok

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(pool.map(worker, range(16)))
    after = stats()
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert executions < inferences, (inferences, executions)
    assert max(b["batch_size"] for b in after["batch_stats"]) > 1


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_bad_shape_is_invalid_argument(ts_stack: Stack, proto: str) -> None:
    bad = np.ones((2, 5), dtype=np.float32)
    ok = np.ones((2, 4), dtype=np.float32)
    want = "400" if proto == "http" else "StatusCode.INVALID_ARGUMENT"
    with _client(proto, ts_stack.url(proto)) as c:
        with pytest.raises(InferenceServerException) as err:
            c.infer("ts_add_sub", [_input(proto, "INPUT__0", bad, "FP32"), _input(proto, "INPUT__1", ok, "FP32")])
        assert err.value.status() == want, err.value
        assert "INPUT__0" in str(err.value)
        with pytest.raises(InferenceServerException) as err:  # more rows than max_batch_size
            big = np.ones((9, 4), dtype=np.float32)
            c.infer("ts_add_sub", [_input(proto, "INPUT__0", big, "FP32"), _input(proto, "INPUT__1", big, "FP32")])
        assert err.value.status() == want, err.value
        with pytest.raises(InferenceServerException) as err:  # wrong datatype
            c.infer("ts_named", [_input(proto, "scale", np.ones((1, 1), np.int32), "INT32"),
                                 _input(proto, "x", np.ones((1, 3), np.int64), "INT64")])
        assert err.value.status() == want, err.value
