"""Triton's generate extension (``POST /v2/models/{m}[/versions/{v}]/generate[_stream]``):
its flat JSON <-> a ModelInferRequest / ModelInferResponse.

Request (Triton's rules, recorded against Triton 2.51): every top-level key that names one of the
model's inputs (its metadata) is that input; ``"parameters"`` (an object) holds request
parameters, and its keys that name inputs are inputs too; any other key is a request parameter.
A parameter is a string, number or boolean. An input's value is a scalar or an array; its shape
comes from the metadata shape (batch dimension included): with ``n`` the number of top-level
elements (1 for a scalar), each fixed dimension ``d`` must divide ``n`` (``n //= d``), the last
variable dimension takes what is left and any other is 1; with no variable dimension ``n`` must
end at 1. Nested arrays are read row-major and must hold exactly that many elements.

Response: one JSON object with ``model_name``, ``model_version`` and one key per output, the
output's value as a scalar when it holds one element, else a flat array; keys sorted, as
Triton writes them. ``generate_stream`` sends each such object as a server-sent event
``data: {...}\\n\\n``, an error as ``data: {"error": "..."}\\n\\n``.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import datatypes, infer_checks
from meshserve.protocol.errors import InferError
from meshserve.protocol.http_codec import (
    _contents_to_json,
    _json_data_to_raw,
    _json_type,
    _loads,
    _raw_to_json,
    set_parameter,
)

PARAMETERS = "parameters"
EVENT_STREAM_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Triton's answer to /generate when the model gives no response or several (use generate_stream)
NOT_ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream for model "
                    "that generates various number of responses")
_PARAMETER_TYPES = (str, bool, int, float)


def parse_generate_request(body: bytes | bytearray, name: str, version: str,
                           metadata: pb.ModelMetadataResponse | bytes) -> pb.ModelInferRequest:
    """The generate request ``body`` for model ``name`` (``version``; "" = the server's choice)
    as a ModelInferRequest, its inputs shaped by the model's ``metadata`` (or its serialized
    bytes: what crosses to the body worker)."""
    md = pb.ModelMetadataResponse.FromString(metadata) if isinstance(metadata, bytes) else metadata
    doc = _loads(body, "generate request")
    if not isinstance(doc, dict):
        raise InferError.invalid(f"the generate request must be a JSON object, got {_json_type(doc)}")
    inputs = {t.name: t for t in md.inputs}
    # (every key that names no input is a parameter: at most MAX_PARAMETERS of them, counted first)
    if len(doc) > infer_checks.MAX_PARAMETERS + len(inputs) + 1:
        raise InferError.invalid(f"the generate request has {len(doc)} keys; at most {infer_checks.MAX_PARAMETERS} "
                                 f"parameters besides the model's {len(inputs)} inputs")
    request = pb.ModelInferRequest(model_name=name, model_version=version)
    for key, value in doc.items():
        if key == PARAMETERS:
            if not isinstance(value, dict):
                raise InferError.invalid("Expected JSON object for keyword: 'parameters': attempt to access "
                                         "JSON non-object as object")
            if len(value) > infer_checks.MAX_PARAMETERS:
                raise infer_checks.too_many("the generate request's 'parameters'", len(value), "keys",
                                            infer_checks.MAX_PARAMETERS)
            for inner, v in value.items():
                _map(request, inputs, inner, v, "Converting keyword: 'parameters': ")
        else:
            _map(request, inputs, key, value, "")
    if len(request.parameters) > infer_checks.MAX_PARAMETERS:
        raise infer_checks.too_many("the generate request", len(request.parameters), "parameters",
                                    infer_checks.MAX_PARAMETERS)
    return request


def _map(request: pb.ModelInferRequest, inputs: dict[str, pb.ModelMetadataResponse.TensorMetadata],
         key: str, value: Any, context: str) -> None:
    """One key of the request: an input when the model has one of that name, else a parameter."""
    meta = inputs.get(key)
    if meta is None:
        if not isinstance(value, _PARAMETER_TYPES):
            raise InferError.invalid(f"{context}parameter '{key}' has invalid type. It should be either "
                                     "'int', 'bool', or 'string'.")
        set_parameter(request.parameters[key], value, f"{context}parameter '{key}'")
        return
    if any(t.name == key for t in request.inputs):
        raise InferError.invalid(f"{context}input '{key}' already exists in request")
    shape = _shape(key, list(meta.shape), len(value) if isinstance(value, list) else 1)
    data = value if isinstance(value, list) else [value]
    count = datatypes.element_count(shape)
    if meta.datatype == "BYTES":  # (the request's BYTES inputs together, before this one's strings are decoded)
        infer_checks.check_bytes_elements(
            count + sum(datatypes.element_count(t.shape) for t in request.inputs if t.datatype == "BYTES"),
            f"input '{key}'")
    raw = _json_data_to_raw(f"input '{key}'", meta.datatype, shape, count, data)
    request.inputs.add(name=key, datatype=meta.datatype, shape=shape)
    request.raw_input_contents.append(raw)


def _shape(name: str, dims: list[int], count: int) -> list[int]:
    """The input's shape from its metadata ``dims`` for a value of ``count`` top-level elements."""
    shape = list(dims)
    variable = [i for i, d in enumerate(dims) if d < 0]
    for d in dims:
        if d < 0:
            continue
        if (d == 0 and count != 0) or (d and count % d):
            raise InferError.invalid(f"The schema can not convert input '{name}' to tensor with proper shape")
        count = count // d if d else 0
    if not variable:
        if count != 1:
            raise InferError.invalid(f"The schema can not convert input '{name}' to tensor with proper shape")
        return shape
    for i in variable:
        shape[i] = 1
    shape[variable[-1]] = count
    return shape


def render_generate_response(response: pb.ModelInferResponse, request: pb.ModelInferRequest) -> bytes:
    """One generate response object (UTF-8 JSON, keys sorted)."""
    doc: dict[str, Any] = {
        "model_name": response.model_name or request.model_name,
        "model_version": response.model_version or request.model_version,
    }
    raws = response.raw_output_contents
    for i, out in enumerate(response.outputs):
        where = f"output '{out.name}'"
        values = _raw_to_json(where, out.datatype, list(out.shape), raws[i]) if raws \
            else _contents_to_json(where, out)
        if isinstance(values, np.ndarray):  # (numbers come as a flat array, for orjson)
            values = values.tolist()
        doc[out.name] = values[0] if len(values) == 1 else values
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def render_generate_answer(raw: bytes | bytearray, request: bytes) -> bytes:
    """``render_generate_response`` of the serialized answer ``raw`` for the serialized request
    ``request`` (http_codec.rendering_request's): run by the body worker for a large answer."""
    return render_generate_response(pb.ModelInferResponse.FromString(bytes(raw)), pb.ModelInferRequest.FromString(request))


def sse_event(data: bytes) -> bytes:
    """A server-sent event carrying one JSON object."""
    return b"data: " + data + b"\n\n"


def sse_error(message: str) -> bytes:
    """The error event of generate_stream."""
    return sse_event(json.dumps({"error": message}, ensure_ascii=False, separators=(",", ":")).encode())
