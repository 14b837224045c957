"""The `Engine` interface over the real TensorRT 10 Python API; CUDA memory via cuda-python.

CUDA memory: cuda-python's runtime bindings (`cudaMalloc`, `cudaMemcpyAsync`, one
`cudaStream_t` per execution context) rather than torch's allocator, so that the [tensorrt]
extra does not pull torch. Device buffers are per context and per tensor, grown when a
batch needs more and reused otherwise. Host data is copied from/to the numpy arrays of the
batch; the stream is synchronized once per batch after the output copies.

Imported only by the TensorRT service (needs `tensorrt` and a CUDA device).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import tensorrt as trt

from services.tensorrt.engine import INPUT, OUTPUT, ProfileShapes, TensorDesc, datatype_from_trt

try:  # cuda-python >= 12.6 moved the bindings
    from cuda.bindings import runtime as cudart
except ImportError:  # pragma: no cover - older cuda-python
    from cuda import cudart  # type: ignore[no-redef]

log = logging.getLogger("meshserve.tensorrt")
_TRT_LOGGER = trt.Logger(trt.Logger.WARNING)


class CudaError(RuntimeError):
    pass


def check(result: Any, what: str) -> Any:
    """cuda-python calls return (err, *values); raise on an error, return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        _, msg = cudart.cudaGetErrorString(err)
        raise CudaError(f"{what} failed: {err.name if hasattr(err, 'name') else err}: "
                        f"{msg.decode() if isinstance(msg, bytes) else msg}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class DeviceBuffer:
    """A growable device allocation."""

    def __init__(self) -> None:
        self.ptr = 0
        self.size = 0

    def ensure(self, nbytes: int) -> int:
        nbytes = max(nbytes, 1)
        if nbytes > self.size:
            self.free()
            self.ptr = int(check(cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))
            self.size = nbytes
        return self.ptr

    def free(self) -> None:
        if self.ptr:
            check(cudart.cudaFree(self.ptr), "cudaFree")
            self.ptr, self.size = 0, 0


class TrtContext:
    """IExecutionContext + its CUDA stream + its device buffers."""

    def __init__(self, engine: TrtEngine):
        self.engine = engine
        self.device_id = engine.device_id
        check(cudart.cudaSetDevice(self.device_id), "cudaSetDevice")
        self.context = engine.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of GPU memory?)")
        self.stream = check(cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.buffers: dict[str, DeviceBuffer] = {}

    @property
    def _stream_handle(self) -> int:
        return int(self.stream)

    def set_optimization_profile(self, index: int) -> None:
        check(cudart.cudaSetDevice(self.device_id), "cudaSetDevice")
        if not self.context.set_optimization_profile_async(index, self._stream_handle):
            raise RuntimeError(f"TensorRT refused optimization profile {index}")
        check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self.context.set_input_shape(name, tuple(shape)):
            raise RuntimeError(f"TensorRT refused shape {list(shape)} for input '{name}'")

    def output_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.context.get_tensor_shape(name))

    def execute(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        check(cudart.cudaSetDevice(self.device_id), "cudaSetDevice")
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name, arr in inputs.items():
            ptr = self.buffers.setdefault(name, DeviceBuffer()).ensure(arr.nbytes)
            if arr.nbytes:
                check(cudart.cudaMemcpyAsync(ptr, arr.ctypes.data, arr.nbytes, h2d, self.stream),
                      f"copy of input '{name}' to the GPU")
            self.context.set_tensor_address(name, ptr)
        for name, arr in outputs.items():
            ptr = self.buffers.setdefault(name, DeviceBuffer()).ensure(arr.nbytes)
            self.context.set_tensor_address(name, ptr)
        if not self.context.execute_async_v3(self._stream_handle):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        for name, arr in outputs.items():
            if arr.nbytes:
                check(cudart.cudaMemcpyAsync(arr.ctypes.data, self.buffers[name].ptr, arr.nbytes, d2h,
                                             self.stream), f"copy of output '{name}' from the GPU")
        check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def close(self) -> None:
        try:
            check(cudart.cudaSetDevice(self.device_id), "cudaSetDevice")
            check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
            for buf in self.buffers.values():
                buf.free()
            check(cudart.cudaStreamDestroy(self.stream), "cudaStreamDestroy")
        except CudaError as exc:
            log.warning("TensorRT context cleanup: %s", exc)
        self.context = None


class TrtEngine:
    """ICudaEngine on one GPU."""

    def __init__(self, engine: Any, device_id: int, runtime: Any):
        self.engine = engine
        self.device_id = device_id
        self._runtime = runtime  # keep the runtime alive as long as the engine

    def tensors(self) -> list[TensorDesc]:
        out = []
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            mode = INPUT if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else OUTPUT
            dtype = self.engine.get_tensor_dtype(name)
            trt_name = getattr(dtype, "name", str(dtype))
            out.append(TensorDesc(name, mode, datatype_from_trt(trt_name), tuple(self.engine.get_tensor_shape(name)),
                                  trt_name))
        return out

    @property
    def num_profiles(self) -> int:
        return int(self.engine.num_optimization_profiles)

    def profile_shapes(self, name: str, profile: int) -> ProfileShapes:
        lo, opt, hi = self.engine.get_tensor_profile_shape(name, profile)
        return ProfileShapes(tuple(lo), tuple(opt), tuple(hi))

    def create_context(self) -> TrtContext:
        return TrtContext(self)

    def close(self) -> None:
        self.engine = None


def load_engine(model_file: Path, device_id: int) -> TrtEngine:
    """Deserialize a plan on a GPU."""
    count = check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
    if device_id >= count:
        raise RuntimeError(f"GPU {device_id} does not exist ({count} CUDA device(s) visible)")
    check(cudart.cudaSetDevice(device_id), "cudaSetDevice")
    runtime = trt.Runtime(_TRT_LOGGER)
    engine = runtime.deserialize_cuda_engine(model_file.read_bytes())
    if engine is None:
        raise RuntimeError(f"TensorRT {trt.__version__} could not deserialize the plan (a plan only loads with "
                           "the TensorRT version and GPU architecture it was built for; rebuild it with "
                           "`meshserve build-trt`)")
    return TrtEngine(engine, device_id, runtime)


def gpu_count() -> int:
    try:
        return int(check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount"))
    except CudaError:
        return 0
