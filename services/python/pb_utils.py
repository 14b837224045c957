"""``triton_python_backend_utils`` as a model's ``model.py`` sees it in a meshserve worker.

The worker registers this module under Triton's name, so ``import triton_python_backend_utils as
pb_utils`` works unchanged. Its public surface is the reference's, name for name: Triton 2.51's
python backend (triton-inference-server/python_backend r24.10, 01d0ad82): the Python part
(``src/resources/triton_python_backend_utils.py``) and what the C++ stub binds and adds to the
module (``src/pb_stub.cc``: Tensor, InferenceRequest, InferenceResponse, the response sender and
iterator, InferenceTrace, Logger and LogLevel, MetricFamily / Metric with COUNTER, GAUGE and
HISTOGRAM, PreferredMemory and MemoryType, TritonError and its codes, TritonModelException,
load_model / unload_model / is_model_ready, get_model_dir). The list and each name's test:
tests/unit/services/test_python_api_names.py. Error texts are the reference's, measured on a real
Triton 2.51 where the source left them open. The worker installs the connection to the service
(``_runtime``) before it loads the model.
"""
from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import asyncio

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# config enum value <-> numpy, as Triton numbers its DataType enum (TYPE_BOOL = 1 ... TYPE_STRING = 13)
_ENUM_TO_NUMPY: dict[int, Any] = {i + 1: t for i, t in enumerate(TRITON_STRING_TO_NUMPY.values())}
_ENUM_TO_NUMPY[1] = np.bool_
# v2 wire datatype names, in the same order
_WIRE = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
         "FP16", "FP32", "FP64", "BYTES")


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    return _ENUM_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type == np.object_ or data_type == np.bytes_:
        return 13
    for enum, t in _ENUM_TO_NUMPY.items():
        if enum != 13 and np.dtype(t) == np.dtype(data_type):
            return enum
    return None


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    """Whether the model's config (the dict of ``json.loads(args["model_config"])``) sets
    ``model_transaction_policy { decoupled: true }``."""
    if "model_transaction_policy" in model_config:
        return bool(model_config["model_transaction_policy"]["decoupled"])
    return False


def get_model_dir() -> str:
    """The directory of the model's ``model.py`` (``<repository>/<model>/<version>``), as Triton's
    stub gives it."""
    if not _model_dir:
        raise TritonModelException("get_model_dir() is only available inside a model's worker")
    return _model_dir


_model_dir = ""  # set by the worker (services/python/worker.py) before it loads model.py


_STUB_TYPES: dict[np.dtype, int] = {}


def _stub_type(dtype: np.dtype) -> int:
    """The datatype of a Tensor made from an array of ``dtype``, as the stub maps it (its C++
    ``numpy_to_triton_type``, python_backend src/pb_stub_utils.cc), which unlike the module's
    ``numpy_to_triton_type`` takes a fixed-width bytes array (``S6``) as BYTES. Any other dtype
    (``U``, complex, a record) is refused in the stub's words when the Tensor is made."""
    enum = _STUB_TYPES.get(dtype)
    if enum is None:
        enum = 13 if dtype.type == np.bytes_ else numpy_to_triton_type(dtype)
        if enum is None:
            raise TritonModelException("NumPy dtype is not supported.")
        _STUB_TYPES[dtype] = enum
    return enum


def wire_datatype(arr: np.ndarray) -> str:
    """The v2 datatype name of a numpy array (BYTES for object / bytes arrays)."""
    return _WIRE[_stub_type(arr.dtype) - 1]


def wire_to_numpy(datatype: str) -> Any:
    """The numpy dtype a v2 datatype's bytes are read as (BF16: its raw bits, as uint16)."""
    if datatype == "BF16":
        return np.uint16
    return _ENUM_TO_NUMPY[_WIRE.index(datatype) + 1]


def wire_tensor(name: str, datatype: str, arr: np.ndarray) -> Tensor:
    """A tensor of v2 ``datatype`` over ``arr`` (read with wire_to_numpy): a BF16 one keeps its raw
    bits, reached through DLPack only, as Triton's stub holds it."""
    tensor = Tensor(name, arr)
    if datatype == "BF16":
        tensor._bf16 = True
    return tensor


def tensor_wire(tensor: Tensor) -> tuple[np.ndarray, str]:
    """A tensor's array (BF16: its raw bits, as uint16) and v2 datatype, for the wire."""
    if tensor._bf16:
        return tensor._array, "BF16"
    arr = tensor.as_numpy()
    return arr, wire_datatype(arr)


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """An object/bytes array flattened into 4-byte-length-prefixed elements (C order), as uint8.
    (The reference returns the same bytes as a ``bytes`` object, and ``()`` for an empty tensor.)"""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.object_)
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.reshape(-1):
        s = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(s)))
        parts.append(s)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | memoryview) -> np.ndarray:
    """4-byte-length-prefixed elements -> a 1-D object array of bytes."""
    out = []
    offset, buf = 0, memoryview(encoded_tensor)
    while offset < len(buf):
        (n,) = struct.unpack_from("<I", buf, offset)
        offset += 4
        out.append(bytes(buf[offset:offset + n]))
        offset += n
    return np.array(out, dtype=np.object_)


# ----------------------------------------------------------------------------- errors


class _ErrorCode(IntEnum):
    """TRITONSERVER_Error_Code (the stub's ``TritonError.__ErrorCode``)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TritonError:
    """An error: a message and one of Triton's codes (INTERNAL unless given)."""

    UNKNOWN = _ErrorCode.UNKNOWN
    INTERNAL = _ErrorCode.INTERNAL
    NOT_FOUND = _ErrorCode.NOT_FOUND
    INVALID_ARG = _ErrorCode.INVALID_ARG
    UNAVAILABLE = _ErrorCode.UNAVAILABLE
    UNSUPPORTED = _ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = _ErrorCode.ALREADY_EXISTS
    CANCELLED = _ErrorCode.CANCELLED

    def __init__(self, message: str, code: int = _ErrorCode.INTERNAL):
        if message is None or code is None:  # the stub's arguments are none(false)
            raise TypeError("TritonError(message: str, code: TritonError code = INTERNAL): None is not accepted")
        self._message = message
        self._code = _ErrorCode(code) if code in _ErrorCode._value2member_map_ else code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code!r})"


CODE_NAMES = {c.value: c.name for c in _ErrorCode}


class TritonModelException(Exception):
    """Raised by the API on misuse; a model may raise it too (its request gets the message)."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


# ----------------------------------------------------------------------------- memory


class MemoryType(IntEnum):
    """Where a BLS request prefers its outputs (the stub's MemoryType; not TRITONSERVER_MemoryType)."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU


class PreferredMemory:
    """``PreferredMemory(TRITONSERVER_MEMORY_CPU or _GPU, device_id=0)`` for a BLS request's outputs.
    This worker keeps tensors in CPU memory: outputs land there either way, as on a Triton built
    without GPU support (its allocator falls back to CPU)."""

    def __init__(self, preferred_memory_type: MemoryType, preferred_device_id: int = 0):
        if preferred_memory_type not in (TRITONSERVER_MEMORY_GPU, TRITONSERVER_MEMORY_CPU) or \
                preferred_device_id is None:
            raise TypeError("PreferredMemory(preferred_memory_type: MemoryType, preferred_device_id: int = 0)")
        self._type = MemoryType(preferred_memory_type)
        self._device_id = int(preferred_device_id)


class InferenceTrace:
    """A request's trace; ``get_context()`` is the OpenTelemetry context Triton hands a traced
    request, None when the request is not traced (meshserve does not pass trace context to python
    models, so always None here)."""

    def __init__(self, context: str = ""):
        self._context = context

    def get_context(self) -> str | None:
        return self._context or None


_NO_TRACE = InferenceTrace()  # (shared: a request's default trace has no state)


# ----------------------------------------------------------------------------- tensors

# DLPack device types (dlpack.h DLDeviceType)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST = 1, 2, 3
_GPU_UNAVAILABLE = ("DLPack capsule passed pointer to memory allocated on GPU device,           "
                    "when GPU is not available")
_gpu: bool | None = None


def _gpu_available() -> bool:
    """Whether this worker can reach a CUDA device (through torch, the library that makes GPU
    DLPack tensors here); asked once."""
    global _gpu
    if _gpu is None:
        try:
            import torch
            _gpu = bool(torch.cuda.is_available())
        except ImportError:
            _gpu = False
    return _gpu


TRITONSERVER_TYPE_BF16 = 14  # TRITONSERVER_DataType (and the config's TYPE_BF16)
_BF16_NUMPY = "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() instead."


class Tensor:
    """A named tensor held as a numpy array (CPU memory). A BF16 tensor (numpy has no bfloat16)
    holds its raw bits as uint16 and, as Triton's stub, has no NumPy view: ``as_numpy()`` raises
    Triton's text, ``to_dlpack()`` / ``from_dlpack()`` carry it (torch.bfloat16)."""

    _bf16 = False

    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None):
        name = _str_arg(name, "name")
        if numpy_array is None:  # (pybind11's TypeError: the stub takes a numpy array)
            raise TypeError("Tensor(): numpy_array must be a numpy array, not None")
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        arr = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        if triton_dtype is None:
            _stub_type(arr.dtype)  # refused here, as the stub refuses it
        else:
            want = triton_to_numpy_type(triton_dtype)
            if want is not None and arr.dtype != want:
                arr = arr.view(want)
        if not arr.flags.c_contiguous:  # as the stub: the tensor's memory is C-contiguous
            arr = np.ascontiguousarray(arr)
        self._name = name
        self._array = arr

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._bf16:
            raise TritonModelException(_BF16_NUMPY)
        return self._array

    def triton_dtype(self) -> int | None:
        if self._bf16:
            return TRITONSERVER_TYPE_BF16
        return _stub_type(self._array.dtype)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule over the tensor's memory (torch.utils.dlpack.from_dlpack takes it)."""
        if self._array.dtype == np.object_:
            raise TritonModelException("DLPack does not have support for string tensors.")
        if self._bf16:  # numpy has no bfloat16: torch makes the capsule (kDLBfloat, 16 bits)
            return _bf16_torch(self._array).__dlpack__()
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.to_dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DL_CPU, 0)

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A Tensor from a DLPack capsule or an object with ``__dlpack__`` and ``__dlpack_device__``
        (a torch tensor, a numpy array). A GPU tensor is copied to the CPU where a GPU is
        available (this worker keeps tensors in CPU memory); without one, Triton's error."""
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        if type(capsule).__name__ == "PyCapsule":
            return _from_capsule(name, capsule)
        if isinstance(capsule, Tensor):  # (one of ours: its memory, BF16 kept)
            tensor = Tensor(name, capsule._array)
            tensor._bf16 = capsule._bf16
            return tensor
        if not hasattr(capsule, "__dlpack__") or not hasattr(capsule, "__dlpack_device__"):
            raise TritonModelException("Provided tensor is not supported. Tensor must be a DLPack capsule         "
                                       "or have `__dlpack__` and `__dlpack_device__` attributes")
        device = int(capsule.__dlpack_device__()[0])
        if device == _DL_CUDA:
            if not _gpu_available():
                raise TritonModelException(_GPU_UNAVAILABLE)
            import torch.utils.dlpack as tdl
            return Tensor(name, _contiguous(tdl.from_dlpack(capsule).cpu().numpy()))
        if device not in (_DL_CPU, _DL_CUDA_HOST):
            raise TritonModelException(f"DLDevice type {device} is not support by Python backend.")
        if _is_torch_bf16(capsule):
            return _bf16_tensor(name, capsule)
        try:
            arr = np.from_dlpack(capsule)
        except (BufferError, TypeError, RuntimeError) as exc:  # a dtype numpy has not
            raise TritonModelException(f"DLPack tensor is not supported by meshserve's python backend: {exc}") from None
        return Tensor(name, _contiguous(arr))


def _is_torch_bf16(obj: Any) -> bool:
    dtype = getattr(obj, "dtype", None)
    return dtype is not None and str(dtype) == "torch.bfloat16"


def _bf16_tensor(name: str, t: Any) -> Tensor:
    """A BF16 Tensor over a CPU torch.bfloat16 tensor's bits (C-contiguous, as the stub needs)."""
    import torch
    if t.device.type == "cuda":
        t = t.cpu()
    if not t.is_contiguous():
        raise TritonModelException(_NOT_CONTIGUOUS)
    tensor = Tensor(name, t.view(torch.int16).numpy().view(np.uint16))
    tensor._bf16 = True
    return tensor


def _bf16_torch(bits: np.ndarray) -> Any:
    """The torch.bfloat16 tensor over a BF16 tensor's bits (shared memory, no copy)."""
    try:
        import torch
    except ImportError:
        raise TritonModelException("to_dlpack() of a BF16 tensor needs torch in the worker's environment") from None
    if not bits.flags.writeable:  # (torch warns on a read-only array; the capsule's reader may not write)
        bits = bits.copy()
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


_NOT_CONTIGUOUS = ("DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order "
                   "are supported.")


def _contiguous(arr: np.ndarray) -> np.ndarray:
    if not arr.flags.c_contiguous:
        raise TritonModelException(_NOT_CONTIGUOUS)
    return arr


def _from_capsule(name: str, capsule: Any) -> Tensor:
    """A bare DLPack capsule's array (torch reads the capsule and tells its device)."""
    try:
        import torch.utils.dlpack as tdl
    except ImportError:
        raise TritonModelException("Tensor.from_dlpack of a bare DLPack capsule needs torch in the worker's "
                                   "environment; pass the tensor object instead") from None
    t = tdl.from_dlpack(capsule)
    if t.device.type == "cuda":
        t = t.cpu()
    if _is_torch_bf16(t):
        return _bf16_tensor(name, t)
    return Tensor(name, _contiguous(t.numpy()))


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for t in inference_request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    for entry in model_config.get("input", []):
        if entry["name"] == name:
            return entry
    return None


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    for entry in model_config.get("output", []):
        if entry["name"] == name:
            return entry
    return None


# ----------------------------------------------------------------------------- requests and responses


class WorkerRuntime(Protocol):
    """What the API needs from the worker it runs in (services/python/worker.py)."""

    instance: str  # the instance's name, as Triton's stub names it in errors (`<model>_0`)

    def send_response(self, key: int, response: InferenceResponse | None, flags: int) -> None: ...

    def is_cancelled(self, key: int) -> bool: ...

    def bls_exec(self, request: InferenceRequest, decoupled: bool) -> Any: ...


_runtime: WorkerRuntime | None = None
_serving = False  # the worker sets it between initialize() and finalize(): BLS only runs then, as in Triton


def _instance() -> str:
    return str(getattr(_runtime, "instance", "") or "")


def _stub_error(prefix: str, message: str) -> TritonModelException:
    """An error the stub relays from the server, worded as Triton's stub words it."""
    return TritonModelException(f"{prefix}: Failed to process the request for model '{_instance()}', "
                                f"message: {message}")


class InferenceResponse:
    """Output tensors, or an error, for one request."""

    def __init__(self, output_tensors: list[Tensor] | tuple[Tensor, ...] = (),
                 error: TritonError | None = None, parameters: dict | str | None = None):
        if output_tensors is None:  # (given as None: pybind11's TypeError; the default is a list)
            raise TypeError("InferenceResponse(): output_tensors must be a list of pb_utils.Tensor, not None")
        if not isinstance(output_tensors, (list, tuple)):
            raise TritonModelException('"output_tensors" must be a list.')
        if any(t is None for t in output_tensors):
            raise TritonModelException("Output tensor for inference response should not be empty.")
        if not all(isinstance(t, Tensor) for t in output_tensors):
            raise TritonModelException('"output_tensors" must be a list of pb_utils.Tensor objects.')
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else _response_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Sends the responses of one request (``request.get_response_sender()``): any number for a
    decoupled model; for another model exactly one, with the final flag (Triton 24.10's rules)."""

    def __init__(self, key: int, decoupled: bool = True, request: InferenceRequest | None = None):
        self._key = key
        self._decoupled = decoupled
        self._request = request
        self._sent = 0
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL and flags != 0:
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException("Inference Response object must be provided when the response flags is "
                                       "set to zero.")
        with self._lock:
            if not self._decoupled:
                if response is not None and self._sent > 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model cannot send more "
                                               "than one response.")
                if response is None and flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL and self._sent == 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model cannot send complete "
                                               "final before sending a response.")
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            if response is not None:
                self._sent += 1
            if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._closed = True
            # a non-decoupled model's one response: the worker answers the request with it when
            # execute() returns; once it returned (the request deferred: collect_responses), it goes
            # out now (Triton 2.51 sends it now too, and ends the call at the final flag)
            deliver = None
            if not self._decoupled and self._request is not None and response is not None:
                self._request._sent_response = response
                if self._request._deferred:
                    deliver = response
        if not self._decoupled:
            if deliver is not None:
                assert _runtime is not None
                _runtime.send_response(self._key, deliver, TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        assert _runtime is not None
        _runtime.send_response(self._key, response, flags)

    def is_cancelled(self) -> bool:
        return _runtime is not None and self._key != 0 and _runtime.is_cancelled(self._key)


class ResponseIterator:
    """The responses of a decoupled BLS call (``request.exec(decoupled=True)``), up to and
    including the final one; leaving it early ends the call."""

    def __init__(self, items: Iterator[InferenceResponse], on_close: Callable[[], None] | None = None):
        self._items = items
        self._on_close = on_close

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        try:
            return next(self._items)
        except StopIteration:
            self._close()
            raise

    def _close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def __del__(self) -> None:
        self._close()


def response_iterator(items: Iterator[InferenceResponse], on_close: Callable[[], None]) -> ResponseIterator:
    """A decoupled BLS call's responses; ``on_close`` ends the call when the caller stops early."""
    return ResponseIterator(items, on_close)


def _response_parameters(parameters: dict | None) -> str:
    """A response's parameters as JSON, checked as the stub checks them (``PyParametersToJSON``):
    keys str, values bool/int/str, in its words. (A str is taken as JSON already: a BLS response's.)"""
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):  # (pybind11's cast, in the stub's words but for its mangled type name)
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}")
    return json.dumps(parameters)


def _check_parameters(parameters: Any) -> str:
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):  # a received request's, as the service forwards them
        return parameters
    if not isinstance(parameters, dict):
        raise TypeError("InferenceRequest parameters must be a dict")
    for key in parameters:
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
    # values: Triton takes bool/int/str; a float is sent too (a double parameter), and any other
    # value is the call's INVALID_ARG error (services/python/bls.py:to_proto)
    return json.dumps(parameters)


def _str_arg(value: Any, name: str) -> str:
    """A pybind11 ``std::string`` argument: a str, or bytes (bytearray) taken as its UTF-8, as
    pybind11's string caster loads bytes too (NVIDIA's BLS example passes the model name straight
    from a BYTES tensor: ``model_name=tensor.as_numpy()[0]``); anything else (None included) is
    pybind11's TypeError."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    raise TypeError(f"incompatible argument '{name}': expected str, got {type(value).__name__}")


def _typed(value: Any, kind: type, name: str) -> None:
    """An argument of a pybind11-bound call that is not of its type (None included: the stub's
    arguments are ``none(false)``): pybind11's TypeError, as NVIDIA's argument_validation QA expects."""
    if not isinstance(value, kind):
        raise TypeError(f"incompatible argument '{name}': expected {kind.__name__}, got {type(value).__name__}")


class InferenceRequest:
    """A request: one of those ``execute`` receives, or one a model builds to call another model
    (BLS: ``InferenceRequest(model_name=..., requested_output_names=[...], inputs=[...]).exec()``)."""

    def __init__(self, request_id: str = "", correlation_id: int | str = 0, inputs: Sequence[Tensor] | None = (),
                 requested_output_names: Sequence[str] | None = (), model_name: str = "", model_version: int = -1,
                 flags: int = 0, timeout: int = 0, preferred_memory: PreferredMemory | None = None,
                 trace: InferenceTrace | None = None, parameters: dict | str | None = None):
        request_id = _str_arg(request_id, "request_id")
        model_name = _str_arg(model_name, "model_name")
        _typed(model_version, int, "model_version")
        _typed(flags, int, "flags")
        _typed(timeout, int, "timeout")
        if correlation_id is None:  # (pybind11's TypeError for None; another type: the stub's text below)
            raise TypeError("InferenceRequest(): correlation_id cannot be None")
        if inputs is None or requested_output_names is None:  # (given as None: pybind11's TypeError)
            raise TypeError("InferenceRequest(): inputs and requested_output_names must be lists")
        inputs = list(inputs)
        if any(not isinstance(n, (str, bytes, bytearray)) for n in requested_output_names):
            raise TypeError("InferenceRequest(): requested_output_names must be a list of str")
        names = [_str_arg(n, "requested_output_names") for n in requested_output_names]
        if None in inputs:
            raise TritonModelException(f"Input tensor for request with id '{request_id}' and model name "
                                       f"'{model_name}' should not be empty.")
        if "" in names:
            raise TritonModelException(f"Requested output name for request with id '{request_id}' and model "
                                       f"name '{model_name}' should not be empty.")
        if not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        self._model_name = model_name
        self._inputs = inputs
        self._requested: set[str] = set(names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._model_version = model_version
        self._timeout = timeout
        self._preferred_memory = preferred_memory
        self._trace = trace or _NO_TRACE
        self._parameters = _check_parameters(parameters)
        self._key = 0  # a received request's key (the worker's), for the response sender
        self._decoupled = False
        self._sender: InferenceResponseSender | None = None
        self._sent_response: InferenceResponse | None = None  # a non-decoupled model's, sent by the sender
        # a non-decoupled request execute() returned without answering, whose sender answers it later
        self._deferred = False
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @property
    def model_name(self) -> str:
        return self._model_name

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def timeout(self) -> int:
        return self._timeout

    def model_version(self) -> int:
        return self._model_version

    def trace(self) -> InferenceTrace:
        return self._trace

    def requested_output_names(self) -> set[str]:
        """A set, as Triton's stub gives it: a received request's holds every output of the model
        when the client named none."""
        return self._requested

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        return _runtime is not None and self._key != 0 and _runtime.is_cancelled(self._key)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            self._sender = InferenceResponseSender(self._key, self._decoupled, self)
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """How the request is released when execute() returns: TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
        runs it again in a later batch (a model with ``sequence_batching { iterative_sequence:
        true }``: services/python/model.py), as the stub's (any int is taken, as there)."""
        self._release_flags = int(flags)

    def exec(self, decoupled: bool = False) -> Any:
        """Run the request on the model it names, through the mesh (the gateway's gRPC address the
        service was given as --bls-target). Returns an InferenceResponse (its error set when the
        call failed), or with ``decoupled=True`` a ResponseIterator over the model's responses."""
        if _runtime is None or not _serving:
            raise TritonModelException("BLS is only supported during the 'execute' function.")
        return _runtime.bls_exec(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> asyncio.Future[Any]:
        """``exec`` as an awaitable, for ``async def execute`` (run on a thread of the worker)."""
        import asyncio  # (here: a worker imports asyncio only for a model that awaits; docs/perf/suite-time.md)

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.exec, decoupled)


def collect_responses(requests: list[InferenceRequest], responses: Any) -> Any:
    """``execute()``'s return with the responses a non-decoupled model sent through its requests'
    response senders put in (where it returned None, or None for those requests), as Triton's stub
    accepts both paths. A request answered through its sender keeps that answer, as its client
    received it first on Triton (which then fails the call when execute() returned another one for
    it, "expected a single response, got 2", measured on 2.51). A request with no answer whose
    response sender the model took is *deferred*: it stays open, and its sender answers it after
    execute() returned, from a thread or a task (Triton 2.51; NVIDIA's response_sender QA models);
    its place in the returned list is None. A request with neither is left as returned (the
    worker's checks refuse a None there, as before: nothing could ever answer it)."""
    if responses is None:
        if not requests or all(r._sender is None and not rescheduled(r) for r in requests):
            return responses
        responses = [None] * len(requests)
    if not isinstance(responses, list) or len(responses) != len(requests):
        return responses
    out = []
    for r, resp in zip(requests, responses, strict=True):
        sender = r._sender
        if rescheduled(r):
            if resp is not None:  # (the stub's words, its spelling)
                raise TritonModelException("Expected a None object in the execute function return list for "
                                           f"reschduled request, found type '{type(resp)}'.")
        elif sender is not None and not r._decoupled:
            with sender._lock:
                if r._sent_response is not None:
                    resp = r._sent_response
                elif resp is None:
                    r._deferred = True  # (from here on its sender's response is sent at once)
        out.append(resp)
    return out


def rescheduled(request: InferenceRequest) -> bool:
    """Whether the model released ``request`` to run again (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)."""
    return bool(request._release_flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)


def deferred(request: InferenceRequest) -> bool:
    """Whether ``request`` stays open after execute() returned, answered later by its sender."""
    return request._deferred


# ----------------------------------------------------------------------------- model control


def _control() -> Any:
    """The worker's client of the mesh (the gateway's gRPC: model control as for BLS)."""
    client = getattr(_runtime, "bls_client", None)
    if client is None:
        raise TritonModelException("model control is only available inside a model's worker")
    return client()


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model through the mesh's model control, with an optional config (JSON)
    and files (``{"file:1/model.onnx": bytes}``), as Triton's ``pb_utils.load_model``."""
    model_name, config = _str_arg(model_name, "model_name"), _str_arg(config, "config")
    if files is not None and not isinstance(files, dict):
        raise TritonModelException(f"failed to load model '{model_name}', files should be a dictionary of file "
                                   "paths and file contents")
    err = _control().load(model_name, config, files or {})
    if err:
        raise _stub_error("Failed to load model", err)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    model_name = _str_arg(model_name, "model_name")
    err = _control().unload(model_name, unload_dependents)
    if err:
        raise _stub_error("Failed to unload model", err)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    model_name, model_version = _str_arg(model_name, "model_name"), _str_arg(model_version, "model_version")
    if model_version:
        try:
            version = int(model_version)
        except ValueError:
            raise _stub_error("Failed to check model readiness", (
                f"failed to get model version from specified version string '{model_version}' (details: stol), "
                "version should be an integral value > 0")) from None
        if version < 0:
            raise _stub_error("Failed to check model readiness", (
                f"failed to get model version from specified version string '{model_version}', version should "
                "be an integral value > 0"))
    ready, err = _control().ready(model_name, model_version)
    if err:
        raise _stub_error("Failed to check model readiness", err)
    return bool(ready)


# ----------------------------------------------------------------------------- logging


class _LogLevel(IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_PY_LEVEL = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}


class Logger:
    """Triton's model logger: lines go to the worker's stderr, the service's log (VERBOSE at
    DEBUG level, shown with --log-level DEBUG as Triton shows it with --log-verbose)."""

    _log = logging.getLogger("meshserve.python.model")
    LogLevel = _LogLevel
    INFO = _LogLevel.INFO
    WARNING = _LogLevel.WARNING
    ERROR = _LogLevel.ERROR
    VERBOSE = _LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: _LogLevel = _LogLevel.INFO) -> None:
        # (pybind11's TypeErrors: the message a str, the level a LogLevel, not an int nor None)
        message = _str_arg(message, "message")
        _typed(level, _LogLevel, "level")
        Logger._log.log(_PY_LEVEL.get(int(level), logging.INFO), "%s", message, stacklevel=3)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, _LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, _LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, _LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, _LogLevel.VERBOSE)


# ----------------------------------------------------------------------------- custom metrics


class MetricKind(IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


COUNTER = MetricKind.COUNTER
GAUGE = MetricKind.GAUGE
HISTOGRAM = MetricKind.HISTOGRAM

# Every metric of this worker by (family name, labels): its values, shared by every Metric made
# for them (the same family name and labels: the same Prometheus metric, as in Triton's core); the
# service collects them at each scrape of /metrics and merges the instances'
# (services/python/core.py:PythonServiceCore.metrics_text). As in Triton, a metric lives while a
# MetricFamily object that made it lives (the stub's family holds its metrics; dropping the Metric
# object alone removes nothing): when the last such family object is deleted, its Metric objects
# fail every operation and the metric leaves /metrics.
_CELLS: dict[tuple[str, tuple[tuple[str, str], ...]], _Cell] = {}
# this worker's families: one kind per name, and the description first given, for the worker's life
# (Triton's core never takes a family out of its Prometheus registry: a later MetricFamily of the
# name gets the first one's description, and another kind is refused)
_FAMILIES: dict[str, tuple[MetricKind, str]] = {}
# (reentrant: a MetricFamily's __del__ takes it, and may run wherever the collector runs)
_metrics_lock = threading.RLock()
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_KIND_NAME = {0: "COUNTER", 1: "GAUGE", 2: "HISTOGRAM"}


class MetricFamily:
    """A custom metric family (COUNTER, GAUGE or HISTOGRAM) on the service's /metrics, as in Triton."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: MetricKind):
        self._metrics: list[Metric] = []  # (first: __del__ reads it, also after a refused __init__)
        if name is None or description is None or kind not in (COUNTER, GAUGE, HISTOGRAM):
            raise TypeError("MetricFamily(name: str, description: str, kind: MetricKind)")
        name, description = _str_arg(name, "name"), _str_arg(description, "description")
        if not _METRIC_NAME.fullmatch(name) or name.startswith("__"):
            raise _stub_error("Error when creating MetricFamily", "Invalid metric name")
        with _metrics_lock:
            have = _FAMILIES.setdefault(name, (MetricKind(kind), description))
        if have[0] != kind:
            raise _stub_error("Error when creating MetricFamily", "Family name already exists with different type")
        self.name, self.description, self.kind = name, have[1], MetricKind(kind)

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None:
            if not isinstance(buckets, list):
                raise TritonModelException("Failed to create metric. Buckets must be a list.")
            if self.kind != HISTOGRAM:
                raise TritonModelException("Failed to create metric. Unexpected buckets found.")
        elif self.kind == HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        for label, value in (labels or {}).items():
            if not isinstance(value, str):
                raise _stub_error("Error when creating Metric", "attempt to access JSON non-string as string")
            if not isinstance(label, str) or not _LABEL_NAME.fullmatch(label) or label.startswith("__"):
                raise _stub_error("Error when creating Metric", "Invalid label name")
        bounds = [float(b) for b in buckets] if buckets is not None else None
        if bounds is not None and any(nxt <= cur for cur, nxt in zip(bounds, bounds[1:], strict=False)):
            raise _stub_error("Error when creating Metric", "Bucket Boundaries must be strictly sorted")
        key = (self.name, tuple(sorted((labels or {}).items())))
        with _metrics_lock:
            cell = _CELLS.get(key)
            if cell is None:  # the same family and labels: the same metric (its first buckets)
                cell = _CELLS[key] = _Cell(key, self.kind, bounds)
            cell.refs += 1
            metric = Metric(cell)
            self._metrics.append(metric)
        return metric

    def __del__(self) -> None:
        """The stub's ~MetricFamily: every Metric it made is cleared (its operations fail from now
        on), and a metric no live family holds leaves /metrics."""
        with _metrics_lock:
            for metric in self._metrics:
                metric._clear()
            self._metrics.clear()


class _Cell:
    """One metric's values (a histogram's value is its sum), shared by its Metric objects; ``refs``:
    how many of them are not cleared."""

    __slots__ = ("buckets", "count", "counts", "key", "kind", "refs", "updated", "value")

    def __init__(self, key: tuple[str, tuple[tuple[str, str], ...]], kind: MetricKind, buckets: list[float] | None):
        self.key = key
        self.kind = kind
        self.value = 0.0
        self.updated = 0.0  # time.monotonic() of the last change: a gauge shows the latest set
        self.buckets = tuple(buckets or ())
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative
        self.count = 0
        self.refs = 0


class Metric:
    """One labelled counter, gauge or histogram (made by ``MetricFamily.Metric``); the same family
    and labels give the same metric. It holds no reference to its family, as the stub's does not:
    once the family object is deleted every operation fails, in the stub's words."""

    def __init__(self, cell: _Cell):
        self._cell: _Cell | None = cell
        self._kind = cell.kind

    def _clear(self) -> None:
        cell, self._cell = self._cell, None
        if cell is not None:
            cell.refs -= 1
            if cell.refs == 0 and _CELLS.get(cell.key) is cell:
                del _CELLS[cell.key]

    def _live(self, what: str) -> _Cell:
        """Its values; once its family object is deleted, the stub's error (checked before anything
        is sent, so without the request's "Failed to process" part: measured on Triton 2.51)."""
        cell = self._cell
        if cell is None:
            raise TritonModelException(
                f"{what}: Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
                "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have been deleted.")
        return cell

    def _refuse(self, what: str, op: str) -> TritonModelException:
        return _stub_error(what, f"TRITONSERVER_METRIC_KIND_{_KIND_NAME[self._kind]} does not support {op}")

    def increment(self, value: float) -> None:
        cell = self._live("Failed to increment metric value")
        if self._kind == HISTOGRAM:
            raise self._refuse("Failed to increment metric value", "Increment")
        if self._kind == COUNTER and value < 0:
            raise _stub_error("Failed to increment metric value", "TRITONSERVER_METRIC_KIND_COUNTER can only be "
                              "incremented monotonically by non-negative values.")
        with _metrics_lock:
            cell.value += value
            cell.updated = time.monotonic()

    def set(self, value: float) -> None:
        cell = self._live("Failed to set metric value")
        if self._kind != GAUGE:
            raise self._refuse("Failed to set metric value", "Set")
        with _metrics_lock:
            cell.value = value
            cell.updated = time.monotonic()

    def observe(self, value: float) -> None:
        cell = self._live("Failed to observe metric value")
        if self._kind != HISTOGRAM:
            raise self._refuse("Failed to observe metric value", "Observe")
        value = float(value)
        with _metrics_lock:
            for i, bound in enumerate(cell.buckets):
                if value <= bound:
                    cell.counts[i] += 1
                    break
            cell.count += 1
            cell.value += value  # the sum
            cell.updated = time.monotonic()

    def value(self) -> float:
        cell = self._live("Failed to get metric value")
        if self._kind == HISTOGRAM:
            raise self._refuse("Failed to get metric value", "Value")
        return cell.value


# a snapshot row: (name, description, kind, labels, value (a histogram's sum), last change,
# a histogram's (bucket bounds, per-bucket counts, count) or None)
MetricRow = tuple[str, str, int, tuple[tuple[str, str], ...], float, float,
                  "tuple[tuple[float, ...], tuple[int, ...], int] | None"]


def metrics_snapshot() -> list[MetricRow]:
    """Every metric of this worker (the service renders them: services/python/core.py)."""
    with _metrics_lock:
        return [(name, _FAMILIES[name][1], int(c.kind), labels, c.value, c.updated,
                 (c.buckets, tuple(c.counts), c.count) if c.kind == HISTOGRAM else None)
                for (name, labels), c in _CELLS.items()]


# ----------------------------------------------------------------------------- auto-complete


class ModelConfig:
    """The model's config as ``auto_complete_config`` sees and changes it (a dict, as Triton's
    JSON form of ModelConfig)."""

    def __init__(self, model_config: str | dict):
        self._config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])
        self._config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict:
        return self._config

    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {current}, but in auto-complete-config "
                             f"function for model '{self._name()}' specified max_batch_size {max_batch_size}")
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                                 f"function for model '{self._name()}' tries to set scheduling_choice as "
                                 "'dynamic_batching'")
        self._config.setdefault("dynamic_batching", {})

    def _add(self, kind: str, entry: dict, valid: tuple[str, ...]) -> None:
        name = entry.get("name", "")
        for prop in entry:
            if prop not in valid:
                listed = ", ".join(repr(v) for v in valid[:-1]) + f" and {valid[-1]!r}"
                raise ValueError(f"{kind} '{name}' in auto-complete-config function for model '{self._name()}' "
                                 f"contains property other than {listed}.")
        for prop in ("name", "data_type", "dims"):
            if prop not in entry:
                where = f"{kind} '{name}'" if prop != "name" else kind
                raise ValueError(f"{where} in auto-complete-config function for model '{self._name()}' "
                                 f"is missing '{prop}' property.")
        for current in self._config[kind]:
            if current.get("name") != name:
                continue
            have = current.get("data_type", "TYPE_INVALID")
            if have != "TYPE_INVALID" and have != entry["data_type"]:
                raise ValueError(f"unable to load model '{self._name()}', configuration expects datatype {have} "
                                 f"for {kind} '{name}', model provides {entry['data_type']}")
            dims = [int(d) for d in current.get("dims", [])]
            if dims and dims != [int(d) for d in entry["dims"]]:
                raise ValueError(f"model '{self._name()}', tensor '{name}': the model expects dims "
                                 f"{list(entry['dims'])} but the model configuration specifies dims {dims}")
            if "optional" in current and "optional" in entry and current["optional"] != entry["optional"]:
                raise ValueError(f"model '{self._name()}', tensor '{name}': the model expects optional "
                                 f"{entry['optional']} but the model configuration specifies optional "
                                 f"{current['optional']}")
            current.update(entry)
            return
        self._config[kind].append(dict(entry))

    def add_input(self, input: dict) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        for prop in transaction_policy_dict:
            if prop != "decoupled":
                raise ValueError("model transaction property in auto-complete-config function for model "
                                 f"'{self._name()}' contains property other than 'decoupled'.")
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            want = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != want:
                raise ValueError("trying to change decoupled property in auto-complete-config for model "
                                 f"'{self._name()}', which is already set to '{policy['decoupled']}'.")
            policy["decoupled"] = want


def _install(runtime: WorkerRuntime) -> None:
    """Called by the worker: connect the API to its service."""
    global _runtime
    _runtime = runtime
