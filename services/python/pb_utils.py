"""``triton_python_backend_utils`` as a model's ``model.py`` sees it in a meshserve worker.

The worker registers this module under Triton's name, so ``import triton_python_backend_utils as
pb_utils`` works unchanged. It offers the API Triton's python backend documents for models:
Tensor, InferenceRequest (received in ``execute``, or built for BLS and run with ``exec`` /
``async_exec``), InferenceResponse, the response sender of decoupled models, TritonError and its
codes, TritonModelException, Logger, ModelConfig (``auto_complete_config``), MetricFamily /
Metric (kept in the worker; not exported), and the helper functions. The worker installs the
connection to the service (``_runtime``) before it loads the model.
"""
from __future__ import annotations

import asyncio
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

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


def wire_datatype(arr: np.ndarray) -> str:
    """The v2 datatype name of a numpy array (BYTES for object / bytes arrays)."""
    enum = numpy_to_triton_type(arr.dtype)
    if enum is None:
        raise TritonModelException(f"Tensor dtype {arr.dtype} is not supported by the Python backend")
    return _WIRE[enum - 1]


def wire_to_numpy(datatype: str) -> Any:
    return _ENUM_TO_NUMPY[_WIRE.index(datatype) + 1]


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """An object/bytes array flattened into 4-byte-length-prefixed elements (C order), as uint8."""
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


class TritonError:
    """An error: a message and one of Triton's codes (INTERNAL unless given)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL):
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


CODE_NAMES = {TritonError.UNKNOWN: "UNKNOWN", TritonError.INTERNAL: "INTERNAL", TritonError.NOT_FOUND: "NOT_FOUND",
              TritonError.INVALID_ARG: "INVALID_ARG", TritonError.UNAVAILABLE: "UNAVAILABLE",
              TritonError.UNSUPPORTED: "UNSUPPORTED", TritonError.ALREADY_EXISTS: "ALREADY_EXISTS",
              TritonError.CANCELLED: "CANCELLED"}


class TritonModelException(Exception):
    """Raised by the API on misuse; a model may raise it too (its request gets the message)."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


# ----------------------------------------------------------------------------- tensors


class Tensor:
    """A named tensor held as a numpy array (CPU memory)."""

    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None):
        arr = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        if arr.dtype.type == np.str_ or arr.dtype == np.void:
            raise TritonModelException("Tensor dtype used for numpy_array is not support by Python backend. "
                                       "Please use np.object_ instead.")
        if triton_dtype is not None:
            want = triton_to_numpy_type(triton_dtype)
            if want is not None and arr.dtype != want:
                arr = arr.view(want)
        self._name = name
        self._array = arr

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule over the tensor's memory (torch.utils.dlpack.from_dlpack takes it)."""
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._array.__dlpack__()

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A Tensor from a DLPack capsule or an object with ``__dlpack__`` (a torch tensor).
        GPU tensors are copied to the CPU (this worker keeps tensors in CPU memory)."""
        if hasattr(capsule, "__dlpack__"):
            obj = capsule
            if getattr(obj, "is_cuda", False):
                obj = obj.cpu()
            return Tensor(name, np.from_dlpack(obj))
        try:
            import torch.utils.dlpack as tdl  # a bare capsule: torch reads it
        except ImportError:
            raise TritonModelException("Tensor.from_dlpack of a bare DLPack capsule needs torch") from None
        return Tensor(name, tdl.from_dlpack(capsule).cpu().numpy())


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

    def send_response(self, key: int, response: InferenceResponse | None, flags: int) -> None: ...

    def is_cancelled(self, key: int) -> bool: ...

    def bls_exec(self, request: InferenceRequest, decoupled: bool) -> Any: ...


_runtime: WorkerRuntime | None = None


class InferenceResponse:
    """Output tensors, or an error, for one request."""

    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: dict | str | None = None):
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, list):
            raise TritonModelException('"output_tensors" must be a list.')
        self._outputs = output_tensors
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Sends the responses of one request of a decoupled model (``request.get_response_sender()``)."""

    def __init__(self, key: int):
        self._key = key
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                raise TritonModelException("Inference Response object must be provided when the response "
                                           "flags is not TRITONSERVER_RESPONSE_COMPLETE_FINAL.")
            if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._closed = True
        assert _runtime is not None
        _runtime.send_response(self._key, response, flags)

    def is_cancelled(self) -> bool:
        return _runtime is not None and _runtime.is_cancelled(self._key)


class InferenceRequest:
    """A request: one of those ``execute`` receives, or one a model builds to call another model
    (BLS: ``InferenceRequest(model_name=..., requested_output_names=[...], inputs=[...]).exec()``)."""

    def __init__(self, model_name: str = "", inputs: list[Tensor] | None = None,
                 requested_output_names: list[str] | None = None, request_id: str = "",
                 correlation_id: int | str = 0, flags: int = 0, model_version: int = -1,
                 timeout: int = 0, parameters: dict | str | None = None, preferred_memory: Any = None,
                 trace: Any = None):
        self._model_name = model_name
        self._inputs = list(inputs or [])
        self._requested: list[str] | set[str] = list(requested_output_names or [])
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._model_version = model_version
        self._timeout = timeout
        if parameters is not None and not isinstance(parameters, (dict, str)):
            raise TritonModelException("InferenceRequest parameters must be a dict or a JSON string")
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        self._key = 0  # a received request's key (the worker's), for the response sender
        self._decoupled = False

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

    def timeout(self) -> int:
        return self._timeout

    def model_version(self) -> int:
        return self._model_version

    def requested_output_names(self) -> list[str] | set[str]:
        """A received request's: a set of names (all the model's outputs when the client named
        none), as in Triton; a BLS request's: the names it was built with."""
        return self._requested

    def parameters(self) -> str:
        return self._parameters

    def is_cancelled(self) -> bool:
        return _runtime is not None and self._key != 0 and _runtime.is_cancelled(self._key)

    def get_response_sender(self) -> InferenceResponseSender:
        if not self._decoupled:
            raise TritonModelException("Unable to get response sender: the model is not decoupled "
                                       "(model_transaction_policy { decoupled: true })")
        return InferenceResponseSender(self._key)

    def set_release_flags(self, flags: int) -> None:
        if flags != TRITONSERVER_REQUEST_RELEASE_ALL:
            raise TritonModelException("request rescheduling is not supported by meshserve's python service")

    def exec(self, decoupled: bool = False) -> Any:
        """Run the request on the model it names, through the mesh (the gateway's gRPC address the
        service was given as --bls-target). Returns an InferenceResponse (its error set when the
        call failed), or with ``decoupled=True`` an iterator over the model's responses."""
        if _runtime is None:
            raise TritonModelException("BLS requests can only be executed inside a model's execute()")
        return _runtime.bls_exec(self, decoupled)

    def async_exec(self, decoupled: bool = False) -> asyncio.Future[Any]:
        """``exec`` as an awaitable, for ``async def execute`` (run on a thread of the worker)."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, self.exec, decoupled)


# ----------------------------------------------------------------------------- logging


class Logger:
    """Triton's model logger: lines go to the worker's stderr, the service's log."""

    _log = logging.getLogger("meshserve.python.model")

    class LogLevel:
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    @classmethod
    def log(cls, message: str, level: int = 0) -> None:
        py = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}.get(level, logging.INFO)
        cls._log.log(py, "%s", message)

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, cls.LogLevel.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, cls.LogLevel.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, cls.LogLevel.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, cls.LogLevel.VERBOSE)


# ----------------------------------------------------------------------------- custom metrics

# every metric of this worker by (family name, labels); the service collects them at each scrape
# of /metrics and merges the instances' (services/python/core.py:PythonServiceCore.metrics_text)
_METRICS: dict[tuple[str, tuple[tuple[str, str], ...]], Metric] = {}
_metrics_lock = threading.Lock()


class MetricFamily:
    """A custom metric family (COUNTER or GAUGE) on the service's /metrics, as in Triton."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __init__(self, name: str, description: str, kind: int):
        if kind not in (self.COUNTER, self.GAUGE):
            raise TritonModelException("only COUNTER and GAUGE metric families are supported")
        if not name or not all(c.isalnum() or c == "_" for c in name) or name[0].isdigit():
            raise TritonModelException(f"metric family name '{name}' is not a valid Prometheus metric name")
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict[str, str] | None = None) -> Metric:
        key = (self.name, tuple(sorted((labels or {}).items())))
        with _metrics_lock:
            metric = _METRICS.get(key)
            if metric is None:
                metric = _METRICS[key] = Metric(self, labels)
            return metric


class Metric:
    """One labelled counter or gauge; the same family and labels give the same metric."""

    def __init__(self, family: MetricFamily, labels: dict[str, str] | None = None):
        self._family = family
        self._labels = dict(labels or {})
        self._value = 0.0
        self._updated = 0.0  # time.monotonic() of the last change: a gauge shows the latest set

    def increment(self, by: float) -> None:
        if self._family.kind == MetricFamily.COUNTER and by < 0:
            raise TritonModelException("a counter cannot be decremented")
        with _metrics_lock:
            self._value += by
            self._updated = time.monotonic()

    def set(self, value: float) -> None:
        if self._family.kind != MetricFamily.GAUGE:
            raise TritonModelException("only a gauge can be set")
        with _metrics_lock:
            self._value = value
            self._updated = time.monotonic()

    def value(self) -> float:
        return self._value


def metrics_snapshot() -> list[tuple[str, str, int, tuple[tuple[str, str], ...], float, float]]:
    """(name, description, kind, labels, value, last change) of every metric of this worker."""
    with _metrics_lock:
        return [(m._family.name, m._family.description, m._family.kind, labels, m._value, m._updated)
                for (_, labels), m in _METRICS.items()]


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
                raise ValueError(f"{kind} '{name}' in auto-complete-config function for model '{self._name()}' "
                                 f"contains property other than {', '.join(repr(v) for v in valid)}.")
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


def response_iterator(items: Iterator[InferenceResponse], on_close: Callable[[], None]) -> Iterator[InferenceResponse]:
    """A decoupled BLS call's responses; ``on_close`` ends the call when the caller stops early."""
    try:
        yield from items
    finally:
        on_close()

