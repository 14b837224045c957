"""KIND_GPU instances end to end: real services and a gateway, tritonclient as the client.

With a CUDA device (scripts/gpu-check.sh runs this on one): a TorchScript archive and a
torch.export archive served with ``instance_group [ { kind: KIND_GPU } ]`` (two instances, each
on its own CUDA stream, dynamic batching), over HTTP and gRPC; CUDA shared memory (tritonclient's
``cuda_shared_memory``) in and out of such a model through the gateway; and the ONNX service's
KIND_GPU (CUDA execution provider) where onnxruntime has it. Without one: the same repository
loads, and each KIND_GPU model is UNAVAILABLE with the reason, never a crash.
"""
from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from meshserve.server.shm import cuda_devices
from tests.conftest import Proc, service_and_gateway
from tests.support import models
from tests.support.shm import in_regions

torch = pytest.importorskip("torch", reason="the TorchScript service needs torch (the [torch] extra)")

CUDA = torch.cuda.is_available()
PROTOCOLS = ("http", "grpc")
WIDTH = 4
GPU_GROUP = "instance_group [ { kind: KIND_GPU count: 2 } ]\n"

TS_ADD_SUB = models.pair_config("gpu_add_sub", "pytorch_libtorch", WIDTH, ("INPUT__0", "INPUT__1"),
                                ("OUTPUT__0", "OUTPUT__1"),
                                extra=GPU_GROUP + "dynamic_batching { max_queue_delay_microseconds: 20000 }\n")
PT2_AFFINE = f"""name: "gpu_affine"
backend: "pytorch"
default_model_filename: "model.pt2"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 3 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 3 ] }} ]
{GPU_GROUP}"""
ONNX_ADD_SUB = models.pair_config("gpu_onnx_add_sub", "onnxruntime_onnx", 16, extra=GPU_GROUP)


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _lib(proto: str) -> Any:
    return httpclient if proto == "http" else grpcclient


def _client(proto: str, proc: Proc) -> Any:
    return _lib(proto).InferenceServerClient(proc.http if proto == "http" else proc.grpc)


def _inputs(proto: str, names: tuple[str, ...], *arrays: np.ndarray) -> list[Any]:
    out = []
    for name, arr in zip(names, arrays, strict=True):
        inp = _lib(proto).InferInput(name, list(arr.shape), "FP32")
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def _index(service: Proc) -> dict[str, dict[str, Any]]:
    with httpclient.InferenceServerClient(service.http) as c:
        return {m["name"]: m for m in c.get_model_repository_index()}


@pytest.fixture(scope="module")
def ts_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """The TorchScript service over gpu_add_sub (model.pt) and gpu_affine (model.pt2), both KIND_GPU."""
    repo = tmp_path_factory.mktemp("gpu_repo")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        models.write(repo, "gpu_add_sub", TS_ADD_SUB, {1: models.torch_add_sub(WIDTH)}, "model.pt")
    models.write(repo, "gpu_affine", PT2_AFFINE, {1: models.torch_affine_export()}, "model.pt2")
    with service_and_gateway("torchscript", ["--repository", str(repo)], timeout=180) as both:
        yield both


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA answer")
def test_kind_gpu_without_cuda_is_unavailable_with_the_reason(ts_gpu: tuple[Proc, Proc]) -> None:
    service, gateway = ts_gpu
    index = _index(service)
    for name in ("gpu_add_sub", "gpu_affine"):
        assert index[name]["state"] == "UNAVAILABLE", index[name]
        assert "asks for KIND_GPU" in index[name]["reason"] and "no usable CUDA device" in index[name]["reason"]
    with httpclient.InferenceServerClient(gateway.http) as c:
        assert c.is_server_live() and not c.is_model_ready("gpu_add_sub")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_torchscript_and_export_archives_on_the_gpu(ts_gpu: tuple[Proc, Proc], proto: str) -> None:
    service, gateway = ts_gpu
    log = service.log()
    for name in ("gpu_add_sub", "gpu_affine"):  # both instances of each model were placed on the GPU
        for i in (0, 1):
            assert f"model '{name}' instance {i} on cuda:0" in log, log
    a = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH)
    b = np.full((3, WIDTH), 0.5, np.float32)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    with _client(proto, gateway) as c:
        assert c.is_model_ready("gpu_add_sub") and c.is_model_ready("gpu_affine")
        result = c.infer("gpu_add_sub", _inputs(proto, ("INPUT__0", "INPUT__1"), a, b))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a - b)
        result = c.infer("gpu_affine", _inputs(proto, ("x",), x))
        np.testing.assert_allclose(result.as_numpy("y"), x * np.array([1, 2, 3], np.float32) + 1)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_concurrent_requests_batch_on_the_gpu_instances(ts_gpu: tuple[Proc, Proc]) -> None:
    _, gateway = ts_gpu

    def stats() -> dict[str, Any]:
        with httpclient.InferenceServerClient(gateway.http) as c:
            return c.get_inference_statistics("gpu_add_sub")["model_stats"][0]

    before = stats()
    ones = np.ones((1, WIDTH), np.float32)

    def worker(i: int) -> bool:
        with grpcclient.InferenceServerClient(gateway.grpc) as c:
            return all(np.array_equal(c.infer("gpu_add_sub", _inputs("grpc", ("INPUT__0", "INPUT__1"), ones * i, ones))
                                      .as_numpy("OUTPUT__0"), ones * i + 1) for _ in range(8))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(pool.map(worker, range(16)))
    after = stats()
    assert after["inference_count"] - before["inference_count"] == 128
    assert after["execution_count"] - before["execution_count"] < 128


@pytest.mark.skipif(not CUDA or cuda_devices() == 0, reason="needs a CUDA device and cuda-python")
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_cuda_shared_memory_into_a_gpu_model(ts_gpu: tuple[Proc, Proc], proto: str) -> None:
    """tritonclient's cuda_shared_memory regions as a KIND_GPU model's inputs and outputs, through the gateway."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    _, gateway = ts_gpu
    mod = _lib(proto)
    size = 2 * WIDTH * 4  # [2, WIDTH] FP32
    a = np.arange(2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)
    b = np.full((2, WIDTH), 3.0, np.float32)
    inp = cudashm.create_shared_memory_region(f"gin-{proto}", 2 * size, 0)
    out = cudashm.create_shared_memory_region(f"gout-{proto}", 2 * size, 0)
    try:
        cudashm.set_shared_memory_region(inp, [a, b])
        with _client(proto, gateway) as c:
            c.register_cuda_shared_memory("gin", cudashm.get_raw_handle(inp), 0, 2 * size)
            c.register_cuda_shared_memory("gout", cudashm.get_raw_handle(out), 0, 2 * size)
            try:
                inputs, outputs = in_regions(
                    mod, "FP32", [2, WIDTH], [("INPUT__0", "gin", size, 0), ("INPUT__1", "gin", size, size)],
                    [("OUTPUT__0", "gout", size, 0), ("OUTPUT__1", "gout", size, size)])
                result = c.infer("gpu_add_sub", inputs, outputs=outputs)
                meta = result.get_output("OUTPUT__0")  # the data went to device memory, not the response
                if proto == "http":
                    assert "data" not in meta and meta["shape"] == [2, WIDTH], meta
                else:
                    assert meta.parameters["shared_memory_region"].string_param == "gout", meta
                got = cudashm.get_contents_as_numpy(out, np.float32, [4, WIDTH])
                np.testing.assert_array_equal(got[:2], a + b)
                np.testing.assert_array_equal(got[2:], a - b)
            finally:
                c.unregister_cuda_shared_memory()
    finally:
        cudashm.destroy_shared_memory_region(inp)
        cudashm.destroy_shared_memory_region(out)


@pytest.fixture(scope="module")
def onnx_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    from onnx import TensorProto

    repo = tmp_path_factory.mktemp("gpu_onnx_repo")
    models.write(repo, "gpu_onnx_add_sub", ONNX_ADD_SUB, {1: models.add_sub(TensorProto.FLOAT)})
    with service_and_gateway("onnx", ["--repository", str(repo)], timeout=180) as both:
        yield both


def test_onnx_kind_gpu(onnx_gpu: tuple[Proc, Proc]) -> None:
    """With onnxruntime's CUDA execution provider the model runs; without it, it is
    UNAVAILABLE with the reason (the CPU onnxruntime, GPU or not)."""
    service, gateway = onnx_gpu
    entry = _index(service)["gpu_onnx_add_sub"]
    if not _ort_has_cuda():
        assert entry["state"] == "UNAVAILABLE", entry
        assert "asks for KIND_GPU but onnxruntime has no CUDA execution provider" in entry["reason"], entry
        return
    assert entry["state"] == "READY", entry
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 2.0, np.float32)
    for proto in PROTOCOLS:
        with _client(proto, gateway) as c:
            result = c.infer("gpu_onnx_add_sub", _inputs(proto, ("INPUT0", "INPUT1"), a, b))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


PY_GPU_CONFIG = """name: "py_gpu_affine"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "ON_GPU" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""
# Written the way Triton's python-backend docs write a torch model: the input reaches torch through
# DLPack, runs on the instance's device, and the output goes back through DLPack.
PY_GPU_MODEL = '''
import numpy as np
import torch
import torch.utils.dlpack as tdl
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = tdl.from_dlpack(pb_utils.get_input_tensor_by_name(request, "X").to_dlpack()).to(self.device)
            y = x * 2 + 1
            on_gpu = np.full((x.shape[0], 1), int(y.is_cuda), np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor.from_dlpack("Y", tdl.to_dlpack(y)), pb_utils.Tensor("ON_GPU", on_gpu)]))
        return responses
'''


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("proto", PROTOCOLS)
def test_a_python_model_on_a_kind_gpu_instance_runs_torch_on_cuda(tmp_path: Any, proto: str) -> None:
    """A python-backend model with a KIND_GPU instance gets Triton's GPU args and runs torch on CUDA;
    its outputs come back through DLPack from device memory."""
    model = tmp_path / "py_gpu_affine"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(PY_GPU_CONFIG)
    (model / "1" / "model.py").write_text(PY_GPU_MODEL)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with service_and_gateway("python", ["--repository", str(tmp_path)], timeout=180) as (_, gateway), \
            _client(proto, gateway) as c:
        result = c.infer("py_gpu_affine", _inputs(proto, ("X",), x))
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 2 + 1)
        assert result.as_numpy("ON_GPU").tolist() == [[1], [1]]
