"""Business Logic Scripting in the worker: ``InferenceRequest.exec()`` runs the named model
through the mesh, as a gRPC client of the gateway (``--bls-target``), so any model of any kind
(python, onnx, torchscript, an ensemble) can be called, with the gateway's routing and limits.

``exec()`` is one ModelInfer call; ``exec(decoupled=True)`` one ModelStreamInfer call whose
responses arrive until the one marked ``triton_final_response`` (asked for with
``triton_enable_empty_final_response``). Errors come back as the response's error, as in Triton.

Every call is made as the python service's own identity: the API key of ``--bls-api-key-file``,
which ``services/python/main.py`` reads once and hands to the workers in the environment
(``MESHSERVE_BLS_API_KEY``), sent as ``x-api-key`` metadata. The gateway's tenants file says which
models that identity may reach and meters its calls (docs/security.md). When the gateway's gRPC
port serves TLS, the channel does too (``--bls-use-ssl`` and its files, ``credentials``).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator

import grpc
import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import grpc_service_pb2_grpc as pb_grpc
from meshserve.protocol import http_codec, wire
from meshserve.protocol.errors import InferError
from services.python import pb_utils

_MAX_MESSAGE = 256 * 1024 * 1024
BLS_API_KEY_ENV = "MESHSERVE_BLS_API_KEY"  # the service's BLS key, for its workers (never on a command line)
# BLS over TLS (--bls-use-ssl, --bls-root-cert, --bls-client-cert, --bls-client-key): the files'
# paths, for the workers ("1" and paths; unset: plaintext)
BLS_TLS_ENV = {"on": "MESHSERVE_BLS_USE_SSL", "root": "MESHSERVE_BLS_ROOT_CERT", "cert": "MESHSERVE_BLS_CLIENT_CERT",
               "key": "MESHSERVE_BLS_CLIENT_KEY"}
_GRPC_TO_TRITON = {
    grpc.StatusCode.INVALID_ARGUMENT: pb_utils.TritonError.INVALID_ARG,
    grpc.StatusCode.NOT_FOUND: pb_utils.TritonError.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED: pb_utils.TritonError.UNSUPPORTED,
    grpc.StatusCode.ALREADY_EXISTS: pb_utils.TritonError.ALREADY_EXISTS,
    grpc.StatusCode.CANCELLED: pb_utils.TritonError.CANCELLED,
    # Triton's BLS has no codes for these (its calls never leave the server). Not a 5xx: the
    # message says why the gateway refused the service's identity (see _refusal_hint).
    grpc.StatusCode.UNAUTHENTICATED: pb_utils.TritonError.INVALID_ARG,
    grpc.StatusCode.PERMISSION_DENIED: pb_utils.TritonError.INVALID_ARG,
    # the BLS identity over its quota: Triton's code for a full queue, to retry later
    grpc.StatusCode.RESOURCE_EXHAUSTED: pb_utils.TritonError.UNAVAILABLE,
}


def to_proto(request: pb_utils.InferenceRequest, stream: bool = False) -> pb.ModelInferRequest:
    """The request as a ModelInferRequest (its parameters as the HTTP codec reads JSON ones: an
    unsupported value raises InferError INVALID_ARG)."""
    msg = pb.ModelInferRequest(model_name=request.model_name, id=request.request_id())
    if request.model_version() > 0:
        msg.model_version = str(request.model_version())
    for t in request.inputs():
        arr, datatype = pb_utils.tensor_wire(t)
        msg.inputs.add(name=t.name(), datatype=datatype, shape=list(arr.shape))
        data = pb_utils.serialize_byte_tensor(arr) if datatype == "BYTES" else np.ascontiguousarray(arr)
        assert data is not None
        msg.raw_input_contents.append(data.tobytes())
    for name in request.requested_output_names():
        msg.outputs.add(name=name)
    for key, value in json.loads(request.parameters() or "{}").items():
        http_codec.set_parameter(msg.parameters[key], value, f"BLS request parameter '{key}'")
    corrid = request.correlation_id()
    if corrid:
        if isinstance(corrid, str):
            msg.parameters["sequence_id"].string_param = corrid
        else:
            msg.parameters["sequence_id"].int64_param = corrid
        flags = request.flags()
        msg.parameters["sequence_start"].bool_param = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        msg.parameters["sequence_end"].bool_param = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    if stream:
        msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


def from_proto(resp: pb.ModelInferResponse) -> pb_utils.InferenceResponse:
    tensors = []
    for i, out in enumerate(resp.outputs):
        raw = resp.raw_output_contents[i] if i < len(resp.raw_output_contents) else b""
        if out.datatype == "BYTES":
            arr = pb_utils.deserialize_bytes_tensor(raw)
        else:
            arr = np.frombuffer(raw, dtype=pb_utils.wire_to_numpy(out.datatype)).copy()
        tensors.append(pb_utils.wire_tensor(out.name, out.datatype, arr.reshape(list(out.shape))))
    # (triton_final_response is the gRPC stream's mark, not the callee's: Triton's BLS response has none)
    params = {k: getattr(v, v.WhichOneof("parameter_choice") or "string_param") for k, v in resp.parameters.items()
              if k != wire.FINAL_RESPONSE_PARAMETER}
    # (as JSON: the callee's parameters as they came, a double one too, past the model-facing check)
    return pb_utils.InferenceResponse(output_tensors=tensors, parameters=json.dumps(params))


def _error(code: grpc.StatusCode | None, message: str, model: str = "") -> pb_utils.InferenceResponse:
    """A failed call as Triton's BLS reports it: ``Model <m> - Error when running inference: …``."""
    triton = _GRPC_TO_TRITON.get(code, pb_utils.TritonError.INTERNAL) if code else pb_utils.TritonError.INTERNAL
    if model:
        message = f"Model {model} - Error when running inference: {message}"
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, triton))


def credentials() -> grpc.ChannelCredentials | None:
    """The BLS channel's TLS credentials from the environment (BLS_TLS_ENV), None: plaintext. The
    CA the gateway's certificate must chain to (none: the system's) and, for a gateway with
    --grpc-use-ssl-mutual, the service's client certificate and key."""
    env = {k: os.environ.get(v, "") for k, v in BLS_TLS_ENV.items()}
    if env["on"] != "1":
        return None

    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(env["root"]), read(env["key"]), read(env["cert"]))


def _refusal_hint(code: grpc.StatusCode, has_key: bool) -> str:
    """What the operator must change when the gateway refuses the service's BLS identity."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if has_key:
            return (" (refused BLS call of the python service: its key, --bls-api-key-file, is not a key of the "
                    "gateway's tenants file)")
        return (" (refused BLS call of the python service: it was started without --bls-api-key-file, and the "
                "gateway's tenants file does not allow anonymous callers)")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return (" (refused BLS call of the python service: its identity, --bls-api-key-file, may not use this "
                "model; the gateway's tenants file grants it)")
    return ""


class BlsClient:
    """One gRPC channel from a worker to the gateway, shared by the model's BLS calls, made as the
    service's identity (``api_key``; by default the environment's ``MESHSERVE_BLS_API_KEY``)."""

    def __init__(self, target: str, api_key: str | None = None):
        self.target = target
        key = os.environ.get(BLS_API_KEY_ENV, "") if api_key is None else api_key
        self._metadata: tuple[tuple[str, str], ...] = (("x-api-key", key),) if key else ()
        self._stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._lock = threading.Lock()

    def _failed(self, exc: grpc.RpcError, model: str) -> pb_utils.InferenceResponse:
        code = exc.code()
        return _error(code, (exc.details() or str(exc)) + _refusal_hint(code, bool(self._metadata)), model)

    def _get_stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        with self._lock:
            if self._stub is None:
                options = [("grpc.max_send_message_length", _MAX_MESSAGE),
                           ("grpc.max_receive_message_length", _MAX_MESSAGE)]
                creds = credentials()
                channel = grpc.insecure_channel(self.target, options=options) if creds is None else \
                    grpc.secure_channel(self.target, creds, options=options)
                self._stub = pb_grpc.GRPCInferenceServiceStub(channel)
            return self._stub

    def infer(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        if not self.target:
            return _error(grpc.StatusCode.UNAVAILABLE, "BLS is not available: the python service was started "
                          "without --bls-target (`meshserve up` passes the gateway's address)")
        timeout = request.timeout() / 1e6 if request.timeout() > 0 else None
        try:
            resp = self._get_stub().ModelInfer(to_proto(request), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            return self._failed(exc, request.model_name)
        except InferError as exc:  # a parameter no request can carry
            return _error(exc.grpc_status, exc.message, request.model_name)
        return from_proto(resp)

    def stream(self, request: pb_utils.InferenceRequest) -> Iterator[pb_utils.InferenceResponse]:
        if not self.target:
            return iter([self.infer(request)])
        done = threading.Event()
        try:
            msg = to_proto(request, stream=True)
        except InferError as exc:  # a parameter no request can carry
            return iter([_error(exc.grpc_status, exc.message, request.model_name)])

        def requests() -> Iterator[pb.ModelInferRequest]:
            yield msg
            done.wait()  # keep the stream open until every response arrived

        timeout = request.timeout() / 1e6 if request.timeout() > 0 else None
        call = self._get_stub().ModelStreamInfer(requests(), timeout=timeout, metadata=self._metadata)

        def items() -> Iterator[pb_utils.InferenceResponse]:
            try:
                for item in call:
                    if item.error_message:
                        yield _error(None, item.error_message, request.model_name)
                        return
                    resp = item.infer_response
                    final = resp.parameters.get("triton_final_response")
                    yield from_proto(resp)  # Triton's iterator yields the empty final response too
                    if final is None or final.bool_param:
                        return  # a server without the final flag answers once
            except grpc.RpcError as exc:
                yield self._failed(exc, request.model_name)

        def close() -> None:
            done.set()
            call.cancel()

        return pb_utils.response_iterator(items(), close)

    # ---- model control (pb_utils.load_model, unload_model, is_model_ready) -------------------
    def _control_call(self, call: str, msg: object) -> tuple[object, str]:
        """One model-control RPC to the mesh: (its answer, "") or (None, the error's text)."""
        if not self.target:
            return None, ("model control is not available: the python service was started without "
                          "--bls-target (`meshserve up` passes the gateway's address)")
        try:
            return getattr(self._get_stub(), call)(msg), ""
        except grpc.RpcError as exc:
            return None, exc.details() or str(exc)

    def load(self, model: str, config: str, files: dict[str, bytes]) -> str:
        msg = pb.RepositoryModelLoadRequest(model_name=model)
        if config:
            msg.parameters["config"].string_param = config
        for path, content in files.items():
            msg.parameters[path].bytes_param = bytes(content)
        return self._control_call("RepositoryModelLoad", msg)[1]

    def unload(self, model: str, unload_dependents: bool) -> str:
        msg = pb.RepositoryModelUnloadRequest(model_name=model)
        if unload_dependents:
            msg.parameters["unload_dependents"].bool_param = True
        return self._control_call("RepositoryModelUnload", msg)[1]

    def ready(self, model: str, version: str) -> tuple[bool, str]:
        answer, err = self._control_call("ModelReady", pb.ModelReadyRequest(name=model, version=version))
        return bool(getattr(answer, "ready", False)), err
