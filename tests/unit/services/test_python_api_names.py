"""Parity by enumeration: every public name of Triton's ``triton_python_backend_utils`` is in
meshserve's (services/python/pb_utils.py), and each has a behavioural test.

The reference list below was generated once from triton-inference-server/python_backend at
branch r24.10 (commit 01d0ad82f9f5d63978456e26c8a2a9746a9d68d8, the python backend of Triton
2.51): the top-level functions, classes and constants of ``src/resources/triton_python_backend_utils.py``,
the names ``src/pb_stub.cc`` sets on that module (``py::setattr(python_backend_utils, ...)``,
``python_backend_utils.def("get_model_dir", ...)``), and for each class the stub binds in
``PYBIND11_EMBEDDED_MODULE(c_python_backend_utils, ...)`` its ``.def`` / ``def_static`` methods,
static properties and enum values (the classes a model reaches through objects too: the response
sender, the response iterator, the trace, Metric). It was checked against ``dir()`` of the module
inside a real Triton 2.51 model (the same 31 module names, less the imports json, np, struct).
``c_python_backend_utils``'s internal names (SharedMemory, async_event_future_done_callback,
shared_memory) are not part of the model API and are left out, as its comments say.

Names whose behaviour needs a running worker (BLS, the response sender of a served request, model
control, get_model_dir, metrics on /metrics, logging) are exercised in
tests/integration/test_python_api.py, which asserts it covers WORKER_NAMES.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import numpy as np
import pytest

from services.python import pb_utils
from services.python.core import render_custom_metrics

MODULE_NAMES = [
    "InferenceRequest", "InferenceResponse", "Logger", "MetricFamily", "ModelConfig", "PreferredMemory",
    "TRITONSERVER_MEMORY_CPU", "TRITONSERVER_MEMORY_GPU", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START", "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE", "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITON_STRING_TO_NUMPY",
    "Tensor", "TritonError", "TritonModelException", "deserialize_bytes_tensor", "get_input_config_by_name",
    "get_input_tensor_by_name", "get_model_dir", "get_output_config_by_name", "get_output_tensor_by_name",
    "is_model_ready", "load_model", "numpy_to_triton_type", "serialize_byte_tensor", "triton_string_to_numpy",
    "triton_to_numpy_type", "unload_model", "using_decoupled_model_transaction_policy",
]
# class -> its members, as the stub binds them (Python-side: ModelConfig's public methods)
CLASS_MEMBERS: dict[str, list[str]] = {
    "TritonError": ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                    "ALREADY_EXISTS", "CANCELLED", "code", "message"],
    "PreferredMemory": [],
    "MemoryType": ["TRITONSERVER_MEMORY_GPU", "TRITONSERVER_MEMORY_CPU"],
    "InferenceTrace": ["get_context"],
    "InferenceRequest": ["inputs", "request_id", "correlation_id", "flags", "set_flags", "timeout", "parameters",
                         "trace", "exec", "async_exec", "requested_output_names", "get_response_sender",
                         "is_cancelled", "set_release_flags"],
    "Tensor": ["name", "as_numpy", "triton_dtype", "to_dlpack", "is_cpu", "shape", "from_dlpack", "__dlpack__",
               "__dlpack_device__"],
    "InferenceResponse": ["output_tensors", "has_error", "error"],
    "InferenceResponseSender": ["send", "is_cancelled"],
    "ResponseIterator": ["__iter__", "__next__"],
    "Logger": ["LogLevel", "INFO", "WARNING", "ERROR", "VERBOSE", "log", "log_info", "log_warn", "log_error",
               "log_verbose"],
    "Logger.LogLevel": ["INFO", "WARNING", "ERROR", "VERBOSE"],
    "Metric": ["increment", "set", "observe", "value"],
    "MetricKind": ["COUNTER", "GAUGE", "HISTOGRAM"],
    "MetricFamily": ["COUNTER", "GAUGE", "HISTOGRAM", "Metric"],
    "ModelConfig": ["as_dict", "set_max_batch_size", "set_dynamic_batching", "add_input", "add_output",
                    "set_model_transaction_policy"],
}
ALL_NAMES = MODULE_NAMES + [f"{cls}.{m}" for cls, members in CLASS_MEMBERS.items() for m in members] + \
    [cls for cls in CLASS_MEMBERS if cls not in MODULE_NAMES]

# exercised in a running worker (tests/integration/test_python_api.py checks it covers exactly these)
WORKER_NAMES = frozenset({
    "get_model_dir", "load_model", "unload_model", "is_model_ready",
    "InferenceRequest.exec", "InferenceRequest.async_exec", "InferenceRequest.is_cancelled",
    "InferenceRequest.request_id", "InferenceRequest.correlation_id", "InferenceRequest.flags",
    "InferenceRequest.timeout", "InferenceRequest.parameters", "InferenceRequest.requested_output_names",
    "InferenceRequest.get_response_sender", "InferenceRequest.trace",
    "InferenceResponseSender", "InferenceResponseSender.send", "InferenceResponseSender.is_cancelled",
    "ResponseIterator", "ResponseIterator.__iter__", "ResponseIterator.__next__",
    "Logger.log", "Logger.log_info", "Logger.log_warn", "Logger.log_error",
    "Metric.observe", "MetricFamily.HISTOGRAM",
})


def _class(path: str) -> type:
    """A reference class as a model reaches it: on the module, or through the object that hands it out."""
    reach: dict[str, Callable[[], type]] = {
        "InferenceResponseSender": lambda: type(pb_utils.InferenceRequest(inputs=[], requested_output_names=[],
                                                                          model_name="m").get_response_sender()),
        "InferenceTrace": lambda: type(pb_utils.InferenceRequest(inputs=[], requested_output_names=[],
                                                                 model_name="m").trace()),
        "Metric": lambda: type(pb_utils.MetricFamily("names_reach", "", pb_utils.MetricFamily.GAUGE).Metric()),
        "MetricKind": lambda: type(pb_utils.MetricFamily.COUNTER),
        "MemoryType": lambda: type(pb_utils.TRITONSERVER_MEMORY_CPU),
        "ResponseIterator": lambda: type(pb_utils.response_iterator(iter([]), lambda: None)),
        "Logger.LogLevel": lambda: pb_utils.Logger.LogLevel,
    }
    return reach[path]() if path in reach else getattr(pb_utils, path)


def test_no_reference_name_is_missing() -> None:
    missing = [n for n in MODULE_NAMES if not hasattr(pb_utils, n)]
    for cls, members in CLASS_MEMBERS.items():
        try:
            owner = _class(cls)
        except AttributeError:
            missing.append(cls)
            continue
        missing += [f"{cls}.{m}" for m in members if not hasattr(owner, m)]
    assert missing == [], f"{len(missing)} names of triton_python_backend_utils missing: {missing}"


# ----------------------------------------------------------------------------- behaviour, name by name

def _req(**kw: object) -> pb_utils.InferenceRequest:
    args: dict = {"inputs": [], "requested_output_names": [], "model_name": "m", **kw}
    return pb_utils.InferenceRequest(**args)


def _raises(fn: Callable[[], object], text: str, exc: type[BaseException] = pb_utils.TritonModelException) -> None:
    with pytest.raises(exc) as info:
        fn()
    assert text in str(info.value), str(info.value)


def b_constants() -> None:
    assert (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END) == (1, 2)
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert (pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL, pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) == (1, 2)
    req = _req()
    assert not pb_utils.rescheduled(req)
    req.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)  # (run again: services/python/model.py)
    assert pb_utils.rescheduled(req)
    req.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
    assert not pb_utils.rescheduled(req)
    # execute() may return None for a batch whose requests it rescheduled, as the stub takes it
    req.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    assert pb_utils.collect_responses([req], None) == [None]
    _raises(lambda: pb_utils.collect_responses([req], [pb_utils.InferenceResponse([])]),
            "Expected a None object in the execute function return list for reschduled request")


def b_datatypes() -> None:
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_FP16"] is np.float16 and len(pb_utils.TRITON_STRING_TO_NUMPY) == 13
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert [pb_utils.triton_to_numpy_type(i) for i in (1, 2, 9, 11, 13)] == [np.bool_, np.uint8, np.int64,
                                                                            np.float32, np.object_]
    assert pb_utils.triton_to_numpy_type(99) is None
    assert [pb_utils.numpy_to_triton_type(t) for t in (np.bool_, np.int8, np.float64, np.object_, np.bytes_)] == \
        [1, 6, 12, 13, 13]


def b_bytes() -> None:
    data = pb_utils.serialize_byte_tensor(np.array([[b"ab"], ["\u00e9"]], dtype=np.object_))
    assert data is not None and bytes(data) == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xc3\xa9"
    assert pb_utils.serialize_byte_tensor(np.zeros(2, dtype=np.float32)) is None
    assert pb_utils.deserialize_bytes_tensor(bytes(data)).tolist() == [b"ab", "\u00e9".encode()]


def b_lookups() -> None:
    t = pb_utils.Tensor("A", np.zeros(1, dtype=np.float32))
    assert pb_utils.get_input_tensor_by_name(_req(inputs=[t]), "A") is t
    assert pb_utils.get_input_tensor_by_name(_req(inputs=[t]), "B") is None
    resp = pb_utils.InferenceResponse([t])
    assert pb_utils.get_output_tensor_by_name(resp, "A") is t and pb_utils.get_output_tensor_by_name(resp, "B") is None
    cfg = {"input": [{"name": "X"}], "output": [{"name": "Y"}]}
    assert pb_utils.get_input_config_by_name(cfg, "X") == {"name": "X"}
    assert pb_utils.get_output_config_by_name(cfg, "Y") == {"name": "Y"}
    assert pb_utils.get_input_config_by_name({}, "X") is None and pb_utils.get_output_config_by_name(cfg, "X") is None


def b_decoupled_policy() -> None:
    assert pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}})
    assert not pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": False}})
    assert not pb_utils.using_decoupled_model_transaction_policy({"name": "m"})


def b_triton_error() -> None:
    codes = ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
             "CANCELLED"]
    assert [int(getattr(pb_utils.TritonError, c)) for c in codes] == list(range(8))  # TRITONSERVER_Error_Code
    err = pb_utils.TritonError("gone", pb_utils.TritonError.NOT_FOUND)
    assert err.message() == "gone" and err.code() == pb_utils.TritonError.NOT_FOUND
    assert pb_utils.TritonError("x").code() == pb_utils.TritonError.INTERNAL
    _raises(lambda: pb_utils.TritonError(None), "", TypeError)  # type: ignore[arg-type]


def b_model_exception() -> None:
    exc = pb_utils.TritonModelException("why")
    assert isinstance(exc, Exception) and exc.message() == "why" and str(exc) == "why"


def b_memory() -> None:
    assert (int(pb_utils.TRITONSERVER_MEMORY_GPU), int(pb_utils.TRITONSERVER_MEMORY_CPU)) == (0, 1)  # the stub's
    assert pb_utils.TRITONSERVER_MEMORY_CPU is _class("MemoryType").TRITONSERVER_MEMORY_CPU
    assert _class("MemoryType").TRITONSERVER_MEMORY_GPU.name == "TRITONSERVER_MEMORY_GPU"
    pm = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 0)
    req = _req(preferred_memory=pm)  # accepted by a BLS request; outputs land in CPU memory here
    assert req.inputs() == []
    _raises(lambda: pb_utils.PreferredMemory(7), "PreferredMemory", TypeError)  # type: ignore[arg-type]


def b_trace() -> None:
    trace = _req().trace()
    assert isinstance(trace, _class("InferenceTrace")) and trace.get_context() is None


def b_request_built() -> None:
    t = pb_utils.Tensor("A", np.zeros(1, dtype=np.float32))
    req = pb_utils.InferenceRequest(request_id="r1", correlation_id="seq-a", inputs=[t],
                                    requested_output_names=["B", "A"], model_name="m", flags=1, timeout=5,
                                    parameters={"k": "v", "n": 2, "b": True})
    assert req.inputs() == [t] and req.request_id() == "r1" and req.correlation_id() == "seq-a"
    assert req.requested_output_names() == {"A", "B"}  # a set, as the stub's std::set
    assert req.flags() == 1 and req.timeout() == 5 and json.loads(req.parameters()) == {"k": "v", "n": 2, "b": True}
    req.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    assert req.flags() == 2
    assert _req().parameters() == "{}" and _req().correlation_id() == 0 and not _req().is_cancelled()
    _raises(lambda: _req(correlation_id=1.5), "Correlation ID must be integer or string")
    _raises(lambda: _req(parameters={1: "x"}), "Expect parameters keys to have type str, found type <class 'int'>")
    _raises(lambda: _req(request_id="r1", requested_output_names=[""]),
            "Requested output name for request with id 'r1' and model name 'm' should not be empty.")
    _raises(lambda: _req(inputs=[None]), "Input tensor for request with id '' and model name 'm' should not be empty.")


def b_exec_outside_worker() -> None:
    saved, pb_utils._runtime = pb_utils._runtime, None
    try:
        _raises(lambda: _req().exec(), "BLS is only supported during the 'execute' function.")
        _raises(lambda: asyncio.run(_async_exec()), "BLS is only supported during the 'execute' function.")
    finally:
        pb_utils._runtime = saved


async def _async_exec() -> object:
    return await _req().async_exec()


def b_tensor() -> None:
    t = pb_utils.Tensor("A", np.arange(6, dtype=np.int32).reshape(2, 3).T)  # not contiguous: copied, as the stub
    assert t.name() == "A" and t.shape() == [3, 2] and t.triton_dtype() == 8 and t.is_cpu()
    assert t.as_numpy().flags.c_contiguous and t.as_numpy().tolist() == [[0, 3], [1, 4], [2, 5]]
    assert t.__dlpack_device__() == (1, 0)  # kDLCPU
    back = pb_utils.Tensor.from_dlpack("B", t)  # anything with __dlpack__ and __dlpack_device__
    assert back.name() == "B" and back.as_numpy().tolist() == t.as_numpy().tolist()
    assert np.from_dlpack(t).tolist() == t.as_numpy().tolist()  # __dlpack__
    assert type(t.to_dlpack()).__name__ == "PyCapsule"
    _raises(lambda: pb_utils.Tensor("", np.zeros(1)), "Tensor name cannot be an empty string.")
    _raises(lambda: pb_utils.Tensor("S", np.array([b"a"], dtype=np.object_)).to_dlpack(),
            "DLPack does not have support for string tensors.")
    _raises(lambda: pb_utils.Tensor.from_dlpack("X", 5),
            "Provided tensor is not supported. Tensor must be a DLPack capsule         or have `__dlpack__` and "
            "`__dlpack_device__` attributes")
    # the stub's own dtype rule (pb_stub_utils.cc): a fixed-width bytes array is BYTES (NVIDIA's
    # qa/python_models/string and string_fixed answer np.bytes_ arrays); anything else it has no
    # type for is refused when the Tensor is made, in its words
    fixed = pb_utils.Tensor("F", np.array([b"123456", b"7"], dtype=np.bytes_))
    assert fixed.triton_dtype() == 13 and fixed.as_numpy().dtype == np.dtype("S6")
    assert pb_utils.wire_datatype(fixed.as_numpy()) == "BYTES"
    assert pb_utils.numpy_to_triton_type(np.dtype("S6")) is None  # (the module's function, as Triton's)
    for refused in (np.array(["text"]), np.zeros(2, dtype=np.complex64), np.zeros(1, dtype="V4")):
        _raises(lambda refused=refused: pb_utils.Tensor("X", refused), "NumPy dtype is not supported.")


class _CudaArray:
    """A stand-in for a tensor in GPU memory (DLPack device kDLCUDA)."""

    def __dlpack__(self, stream: object = None) -> object:
        raise AssertionError("a GPU tensor is not read without a GPU")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def b_argument_types() -> None:
    """pybind11's TypeErrors where the stub's bindings take another type (None included), as
    NVIDIA's qa/L0_backend_python/argument_validation model asserts them; its other cases are the
    stub's own TritonModelException texts."""
    t = [pb_utils.Tensor("INPUT0", np.asarray([1, 2], dtype=np.int32))]
    ok = {"inputs": t, "model_name": "m", "requested_output_names": ["o"]}
    for bad in ({"inputs": None}, {"model_name": None}, {"requested_output_names": [None]},
                {"requested_output_names": None}, {"correlation_id": None}, {"request_id": None},
                {"model_version": None}, {"flags": None}):
        with pytest.raises(TypeError):
            pb_utils.InferenceRequest(**{**ok, **bad})  # type: ignore[arg-type]
    _raises(lambda: pb_utils.InferenceRequest(**{**ok, "inputs": [None]}),  # type: ignore[arg-type]
            "Input tensor for request with id '' and model name 'm' should not be empty.")
    assert pb_utils.InferenceRequest(**{**ok, "correlation_id": "id-5"}).correlation_id() == "id-5"
    assert pb_utils.InferenceRequest(requested_output_names=[], inputs=[], model_name="m").correlation_id() == 0
    with pytest.raises(TypeError):
        pb_utils.InferenceResponse(output_tensors=None)  # type: ignore[arg-type]
    assert pb_utils.InferenceResponse(output_tensors=[]).output_tensors() == []
    for name, array in ((None, np.zeros(1)), ("OUTPUT0", None), ("", None)):
        with pytest.raises(TypeError):
            pb_utils.Tensor(name, array)  # type: ignore[arg-type]
    for call in (lambda: pb_utils.Logger.log("x", None), lambda: pb_utils.Logger.log("x", 1),
                 lambda: pb_utils.Logger.log_info(None), lambda: pb_utils.Logger.log_warn(None),
                 lambda: pb_utils.Logger.log_error(None), lambda: pb_utils.Logger.log_verbose(None)):
        with pytest.raises(TypeError):
            call()  # type: ignore[no-untyped-call]


def b_gpu_paths_on_a_cpu_box() -> None:
    """GPU-only paths: where no GPU is available, Triton's own CPU-build text (never AttributeError)."""
    if pb_utils._gpu_available():
        pytest.skip("a GPU is available: GPU tensors are copied to the CPU")
    _raises(lambda: pb_utils.Tensor.from_dlpack("G", _CudaArray()),
            "DLPack capsule passed pointer to memory allocated on GPU device,           when GPU is not available")


def b_response() -> None:
    t = pb_utils.Tensor("A", np.zeros(1, dtype=np.float32))
    ok = pb_utils.InferenceResponse(output_tensors=[t])
    assert ok.output_tensors() == [t] and not ok.has_error() and ok.error() is None
    assert pb_utils.InferenceResponse((t,)).output_tensors() == [t]  # a tuple converts, as pybind's list
    bad = pb_utils.InferenceResponse(error=pb_utils.TritonError("no", pb_utils.TritonError.INVALID_ARG))
    assert bad.has_error() and bad.error() is not None and bad.error().message() == "no"  # type: ignore[union-attr]
    _raises(lambda: pb_utils.InferenceResponse([None]), "Output tensor for inference response should not be empty.")
    # parameters, checked as the stub's PyParametersToJSON checks them (NVIDIA's response_parameters QA)
    assert json.loads(pb_utils.InferenceResponse([t], parameters={"a": "1", "c": 3, "d": False}).parameters()) == {
        "a": "1", "c": 3, "d": False}
    assert pb_utils.InferenceResponse([t]).parameters() == "{}"
    _raises(lambda: pb_utils.InferenceResponse([t], parameters={1: "x"}),
            "Expect parameters keys to have type str, found type <class 'int'>")
    for value, kind in ((0.5, "float"), (None, "NoneType"), (["v"], "list"), ({"k": 1}, "dict")):
        _raises(lambda value=value: pb_utils.InferenceResponse([t], parameters={"k": value}),
                f"Expect parameters values to have type bool/int/str, found type <class '{kind}'>")
    _raises(lambda: pb_utils.InferenceResponse([t], parameters=[]), "Expect dict, got <class 'list'>")


def b_sender_rules() -> None:
    sender = _req().get_response_sender()
    assert isinstance(sender, _class("InferenceResponseSender"))
    _raises(lambda: sender.send(pb_utils.InferenceResponse([]), flags=5),
            "Unable to send response. Unsupported flag provided.")
    _raises(lambda: sender.send(None, flags=0),
            "Inference Response object must be provided when the response flags is set to zero.")


def b_response_iterator() -> None:
    closed: list[bool] = []
    items = [pb_utils.InferenceResponse([]), pb_utils.InferenceResponse([])]
    it = pb_utils.response_iterator(iter(items), lambda: closed.append(True))
    assert iter(it) is it and next(it) is items[0] and list(it) == [items[1]] and closed == [True]


def b_logger(caplog: pytest.LogCaptureFixture) -> None:
    levels = pb_utils.Logger.LogLevel
    assert [int(levels.INFO), int(levels.WARNING), int(levels.ERROR), int(levels.VERBOSE)] == [0, 1, 2, 3]
    assert pb_utils.Logger.INFO is levels.INFO and pb_utils.Logger.VERBOSE is levels.VERBOSE  # export_values
    assert pb_utils.Logger.WARNING.name == "WARNING" and pb_utils.Logger.ERROR is levels.ERROR
    with caplog.at_level(logging.DEBUG, logger="meshserve.python.model"):
        pb_utils.Logger.log("at warning", pb_utils.Logger.LogLevel.WARNING)
        pb_utils.Logger.log_verbose("verbose line")
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "meshserve.python.model"]
    assert got == [(logging.WARNING, "at warning"), (logging.DEBUG, "verbose line")]


def b_bytes_for_str_arguments() -> None:
    """pybind11's std::string arguments take bytes too (NVIDIA's bls example passes a model name
    straight from a BYTES tensor); other types stay pybind11's TypeError."""
    req = pb_utils.InferenceRequest(model_name=b"add_sub", request_id=bytearray(b"r1"),
                                    requested_output_names=[b"OUTPUT0"], inputs=[])
    assert (req.model_name, req.request_id(), req.requested_output_names()) == ("add_sub", "r1", {"OUTPUT0"})
    assert pb_utils.Tensor(b"X", np.zeros(1, np.float32)).name() == "X"
    _raises(lambda: pb_utils.InferenceRequest(model_name=7, requested_output_names=[], inputs=[]),
            "incompatible argument 'model_name'", TypeError)


def b_metric_kinds() -> None:
    kind = _class("MetricKind")
    assert [int(kind.COUNTER), int(kind.GAUGE), int(kind.HISTOGRAM)] == [0, 1, 2]
    assert pb_utils.MetricFamily.COUNTER is kind.COUNTER and pb_utils.MetricFamily.GAUGE is kind.GAUGE


def b_metrics() -> None:
    counters = pb_utils.MetricFamily("names_counter", "c", pb_utils.MetricFamily.COUNTER)
    counter = counters.Metric(labels={"a": "b"})
    counter.increment(2.5)
    assert counter.value() == 2.5
    gauges = pb_utils.MetricFamily("names_gauge", "g", pb_utils.MetricFamily.GAUGE)
    gauge = gauges.Metric()
    gauge.set(4)
    gauge.increment(-6)  # a gauge goes down too
    assert gauge.value() == -2
    where = "Failed to process the request for model '', message: "  # (no worker: no instance name)
    _raises(lambda: counter.set(1), f"Failed to set metric value: {where}TRITONSERVER_METRIC_KIND_COUNTER does "
                                    "not support Set")
    _raises(lambda: counter.increment(-1), "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically "
                                           "by non-negative values.")
    _raises(lambda: gauge.observe(1), "Failed to observe metric value: " + where +
            "TRITONSERVER_METRIC_KIND_GAUGE does not support Observe")


def b_histogram_unit() -> None:
    fam = pb_utils.MetricFamily("names_hist", "h", pb_utils.MetricFamily.HISTOGRAM)
    h = fam.Metric(labels={"m": "x"}, buckets=[1.0, 2.5])
    for v in (0.5, 1.0, 2.0, 9.0):
        h.observe(v)
    again = fam.Metric(labels={"m": "x"}, buckets=[7.0])  # the same labels: the same histogram (its buckets)
    again.observe(0.1)
    _raises(lambda: h.value(), "Failed to get metric value: Failed to process the request for model '', message: "
                               "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value")
    _raises(lambda: h.increment(1), "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Increment")
    _raises(lambda: h.set(1), "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Set")
    _raises(lambda: fam.Metric(labels={"m": "y"}), "Failed to create metric. Missing required buckets.")
    _raises(lambda: fam.Metric(labels={"m": "y"}, buckets=(1.0,)), "Failed to create metric. Buckets must be a list.")
    _raises(lambda: fam.Metric(labels={}, buckets=[2.0, 1.0]), "Bucket Boundaries must be strictly sorted")
    mine = [row for row in pb_utils.metrics_snapshot() if row[0] == "names_hist"]
    text = render_custom_metrics(mine).decode().splitlines()
    assert text == ["# HELP names_hist h", "# TYPE names_hist histogram", 'names_hist_count{m="x"} 5',
                    'names_hist_sum{m="x"} 12.6', 'names_hist_bucket{m="x",le="1"} 3',
                    'names_hist_bucket{m="x",le="2.5"} 4', 'names_hist_bucket{m="x",le="+Inf"} 5']


def b_metric_family() -> None:
    where = "Error when creating MetricFamily: Failed to process the request for model '', message: "
    _raises(lambda: pb_utils.MetricFamily("bad-name", "", pb_utils.MetricFamily.GAUGE), where + "Invalid metric name")
    _raises(lambda: pb_utils.MetricFamily("__x", "", pb_utils.MetricFamily.GAUGE), where + "Invalid metric name")
    pb_utils.MetricFamily("names_dup", "one", pb_utils.MetricFamily.COUNTER)
    pb_utils.MetricFamily("names_dup", "other text", pb_utils.MetricFamily.COUNTER)  # same kind: the same family
    _raises(lambda: pb_utils.MetricFamily("names_dup", "", pb_utils.MetricFamily.GAUGE),
            where + "Family name already exists with different type")
    fam = pb_utils.MetricFamily("names_fam", "f", pb_utils.MetricFamily.COUNTER)
    _raises(lambda: fam.Metric(labels=["a"]), "Failed to create metric. Labels must be a dictionary.")  # type: ignore
    _raises(lambda: fam.Metric(labels={"a": "b"}, buckets=[1.0]), "Failed to create metric. Unexpected buckets found.")
    _raises(lambda: fam.Metric(labels={"a": 1}), "attempt to access JSON non-string as string")  # type: ignore
    _raises(lambda: fam.Metric(labels={"a-b": "1"}), "Invalid label name")


def b_metric_lifetime() -> None:
    """As the stub and Triton's core: a family name keeps its first description and its kind; a
    metric lives while a MetricFamily object that made it does (dropping the Metric object removes
    nothing); once the last one is deleted, its Metric objects fail every operation, in the stub's
    words, and the metric leaves the snapshot (/metrics). Each point measured on Triton 2.51 with
    a probe model (session 25)."""
    def rows(name: str) -> list:
        return [row for row in pb_utils.metrics_snapshot() if row[0] == name]

    first = pb_utils.MetricFamily("names_life", "first description", pb_utils.MetricFamily.GAUGE)
    second = pb_utils.MetricFamily("names_life", "second description", pb_utils.MetricFamily.GAUGE)
    assert second.description == "first description"
    a, b = first.Metric(labels={"k": "v"}), second.Metric(labels={"k": "v"})
    a.set(3)
    assert b.value() == 3  # one metric
    del first
    with pytest.raises(pb_utils.TritonModelException, match="^Failed to set metric value: Invalid metric operation "
                                                             "as the corresponding 'MetricFamily' has been deleted"):
        a.set(1)
    assert b.value() == 3 and [(r[1], r[3], r[4]) for r in rows("names_life")] == \
        [("first description", (("k", "v"),), 3.0)]
    kept = second.Metric()
    del kept  # the family holds it
    assert len(rows("names_life")) == 2
    del second
    for op, what in ((lambda: b.value(), "get"), (lambda: b.set(2), "set"), (lambda: b.increment(1), "increment")):
        _raises(op, f"Failed to {what} metric value: Invalid metric operation as the corresponding 'MetricFamily' "
                    "has been deleted. The 'MetricFamily' object should be deleted AFTER its corresponding 'Metric' "
                    "objects have been deleted.")
    assert rows("names_life") == []
    again = pb_utils.MetricFamily("names_life", "third", pb_utils.MetricFamily.GAUGE)
    assert again.description == "first description" and again.Metric(labels={"k": "v"}).value() == 0
    _raises(lambda: pb_utils.MetricFamily("names_life", "", pb_utils.MetricFamily.COUNTER),
            "Family name already exists with different type")


def b_model_config() -> None:
    cfg = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 0, "input": [], "output": []}))
    cfg.set_max_batch_size(4)
    cfg.set_dynamic_batching()
    cfg.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2], "optional": True})
    cfg.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [2]})
    cfg.set_model_transaction_policy({"decoupled": False})
    assert cfg.as_dict()["max_batch_size"] == 4 and cfg.as_dict()["dynamic_batching"] == {}
    assert cfg.as_dict()["model_transaction_policy"] == {"decoupled": False}
    with pytest.raises(ValueError, match="the model expects optional False but the model configuration specifies "
                                         "optional True"):
        cfg.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2], "optional": False})
    with pytest.raises(ValueError, match="contains property other than 'name', 'data_type', 'dims' and 'optional'"):
        cfg.add_input({"name": "Z", "data_type": "TYPE_FP32", "dims": [2], "shape": 1})
    with pytest.raises(ValueError, match="contains property other than 'name', 'data_type' and 'dims'"):
        cfg.add_output({"name": "Z", "data_type": "TYPE_FP32", "dims": [2], "optional": True})


# (names covered, check): every reference name is in one group here or in WORKER_NAMES
BEHAVIOUR: list[tuple[tuple[str, ...], Callable[..., None]]] = [
    (("TRITONSERVER_REQUEST_FLAG_SEQUENCE_START", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
      "TRITONSERVER_RESPONSE_COMPLETE_FINAL", "TRITONSERVER_REQUEST_RELEASE_ALL",
      "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE", "InferenceRequest.set_release_flags"), b_constants),
    (("TRITON_STRING_TO_NUMPY", "triton_string_to_numpy", "triton_to_numpy_type", "numpy_to_triton_type"),
     b_datatypes),
    (("serialize_byte_tensor", "deserialize_bytes_tensor"), b_bytes),
    (("get_input_tensor_by_name", "get_output_tensor_by_name", "get_input_config_by_name",
      "get_output_config_by_name"), b_lookups),
    (("using_decoupled_model_transaction_policy",), b_decoupled_policy),
    (("TritonError", *[f"TritonError.{m}" for m in CLASS_MEMBERS["TritonError"]]), b_triton_error),
    (("TritonModelException",), b_model_exception),
    (("PreferredMemory", "TRITONSERVER_MEMORY_CPU", "TRITONSERVER_MEMORY_GPU", "MemoryType",
      "MemoryType.TRITONSERVER_MEMORY_GPU", "MemoryType.TRITONSERVER_MEMORY_CPU"), b_memory),
    (("InferenceTrace", "InferenceTrace.get_context"), b_trace),
    (("InferenceRequest", "InferenceRequest.inputs", "InferenceRequest.set_flags"), b_request_built),
    ((), b_exec_outside_worker),
    (("Tensor", *[f"Tensor.{m}" for m in CLASS_MEMBERS["Tensor"]]), b_tensor),
    ((), b_gpu_paths_on_a_cpu_box),
    ((), b_argument_types),
    (("InferenceResponse", "InferenceResponse.output_tensors", "InferenceResponse.has_error",
      "InferenceResponse.error"), b_response),
    ((), b_sender_rules),
    ((), b_response_iterator),
    (("Logger", "Logger.LogLevel", "Logger.INFO", "Logger.WARNING", "Logger.ERROR", "Logger.VERBOSE",
      "Logger.log_verbose", "Logger.LogLevel.INFO", "Logger.LogLevel.WARNING", "Logger.LogLevel.ERROR",
      "Logger.LogLevel.VERBOSE"), b_logger),
    (("MetricKind", "MetricKind.COUNTER", "MetricKind.GAUGE", "MetricKind.HISTOGRAM", "MetricFamily.COUNTER",
      "MetricFamily.GAUGE"), b_metric_kinds),
    (("Metric", "Metric.increment", "Metric.set", "Metric.value"), b_metrics),
    ((), b_histogram_unit),
    (("MetricFamily", "MetricFamily.Metric"), b_metric_family),
    ((), b_metric_lifetime),
    ((), b_bytes_for_str_arguments),
    (("ModelConfig", *[f"ModelConfig.{m}" for m in CLASS_MEMBERS["ModelConfig"]]), b_model_config),
]


def test_every_reference_name_has_a_behavioural_test() -> None:
    covered = {n for names, _ in BEHAVIOUR for n in names} | WORKER_NAMES
    assert sorted(set(ALL_NAMES) - covered) == []
    assert sorted(covered - set(ALL_NAMES)) == []  # no test claims a name the reference has not


@pytest.mark.parametrize("check", [c for _, c in BEHAVIOUR], ids=[c.__name__ for _, c in BEHAVIOUR])
def test_behaviour(check: Callable[..., None], caplog: pytest.LogCaptureFixture) -> None:
    if check is b_logger:
        check(caplog)
    else:
        check()


def test_custom_metrics_text_is_what_triton_2_51_wrote() -> None:
    """The same metrics made in a model on a real Triton 2.51 (its /metrics, copied here)."""
    counter = pb_utils.MetricFamily("t251_counter", "a counter", pb_utils.MetricFamily.COUNTER)
    counter.Metric(labels={"model": "probe"}).increment(1234567.125)
    counter.Metric(labels={"model": "dropped"}).increment(5)
    # (every family kept while its metrics are read: a metric lives while its MetricFamily object
    # does, on Triton as here: b_metric_lifetime)
    gauges = pb_utils.MetricFamily("t251_gauge", "a gauge", pb_utils.MetricFamily.GAUGE)
    gauge = gauges.Metric(labels={"model": "probe"})
    gauge.set(0.1)
    gauge.increment(-2)
    hists = pb_utils.MetricFamily("t251_hist", "a histogram", pb_utils.MetricFamily.HISTOGRAM)
    hist = hists.Metric(labels={"model": "probe", "b": "x"}, buckets=[0.5, 1, 2.5])
    for v in (0.1, 1.0, 2.0, 3.0, 1234567.125):
        hist.observe(v)
    empty = pb_utils.MetricFamily("t251_empty", "no metric", pb_utils.MetricFamily.COUNTER)  # not shown
    bare = pb_utils.MetricFamily("t251_bare", "d", pb_utils.MetricFamily.COUNTER)
    bare.Metric()
    rows = [r for r in pb_utils.metrics_snapshot() if r[0].startswith("t251_")]
    got = render_custom_metrics(sorted(rows, key=lambda r: (r[0], r[3]))).decode()
    del counter, gauges, hists, empty, bare
    assert got == """\
# HELP t251_bare d
# TYPE t251_bare counter
t251_bare 0
# HELP t251_counter a counter
# TYPE t251_counter counter
t251_counter{model="dropped"} 5
t251_counter{model="probe"} 1234567.125
# HELP t251_gauge a gauge
# TYPE t251_gauge gauge
t251_gauge{model="probe"} -1.9
# HELP t251_hist a histogram
# TYPE t251_hist histogram
t251_hist_count{b="x",model="probe"} 5
t251_hist_sum{b="x",model="probe"} 1234573.225
t251_hist_bucket{b="x",model="probe",le="0.5"} 1
t251_hist_bucket{b="x",model="probe",le="1"} 2
t251_hist_bucket{b="x",model="probe",le="2.5"} 3
t251_hist_bucket{b="x",model="probe",le="+Inf"} 5
"""


def test_histograms_of_several_instances_merge() -> None:
    """Two workers' rows for one histogram: counts and sums add up; a worker whose bounds differ
    has its counts placed at the first bound at or above each of its own."""
    labels = (("m", "x"),)
    rows = [("h", "d", 2, labels, 3.0, 1.0, ((1.0, 5.0), (1, 1), 2)),
            ("h", "d", 2, labels, 4.0, 2.0, ((1.0, 5.0), (0, 1), 2)),
            ("h", "d", 2, labels, 2.0, 3.0, ((0.5, 9.0), (1, 0), 3)),
            ("bad", "d", 2, labels, 1.0, 1.0, None)]  # malformed: left out
    assert render_custom_metrics(rows).decode().splitlines() == [
        "# HELP h d", "# TYPE h histogram", 'h_count{m="x"} 7', 'h_sum{m="x"} 9', 'h_bucket{m="x",le="1"} 2',
        'h_bucket{m="x",le="5"} 4', 'h_bucket{m="x",le="+Inf"} 7']
