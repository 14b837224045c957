"""generate_codec: Triton's generate JSON <-> tensors. Every expectation below is what Triton 2.51
answered for the same model metadata and body (tests/e2e/triton_reference.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError
from meshserve.protocol.generate_codec import (
    parse_generate_request,
    render_generate_response,
    sse_error,
    sse_event,
)


def metadata(*inputs: tuple[str, str, list[int]]) -> pb.ModelMetadataResponse:
    md = pb.ModelMetadataResponse(name="m", versions=["1"])
    for name, dt, shape in inputs:
        md.inputs.add(name=name, datatype=dt, shape=shape)
    return md


def parse(body: object, md: pb.ModelMetadataResponse) -> pb.ModelInferRequest:
    return parse_generate_request(json.dumps(body).encode(), "m", "", md)


# the models Triton was asked: X INT32 with metadata shape ... (batched ones include the batch -1)
SHAPES = {"dyn_batched": [-1, -1], "dyn2": [-1, 2], "dyn3": [-1, -1], "fix22": [2, 2]}
BAD = None
# value -> the shape Triton gave the input (S), or BAD: "The schema can not convert input 'X' to
# tensor with proper shape" (400) / "Shape does not match true shape of 'data' field" (Triton 500)
RECORDED: dict[str, list[tuple[object, list[int] | None]]] = {
    "dyn_batched": [(5, [1, 1]), ([5], [1, 1]), ([1, 2], [1, 2]), ([1, 2, 3, 4], [1, 4]), ([[1, 2], [3, 4]], BAD),
                    ([[1, 2, 3, 4]], BAD), ([], [1, 0]), ([[1], [2]], [1, 2])],
    "dyn2": [(5, BAD), ([5], BAD), ([1, 2], [1, 2]), ([1, 2, 3, 4], [2, 2]), ([[1, 2], [3, 4]], BAD),
             ([[1, 2, 3, 4]], BAD), ([], [0, 2]), ([[1], [2]], [1, 2])],
    "fix22": [(5, BAD), ([5], BAD), ([1, 2], BAD), ([1, 2, 3, 4], [2, 2]), ([[1, 2], [3, 4]], BAD),
              ([[1, 2, 3, 4]], BAD), ([], BAD), ([[1], [2]], BAD)],
}


@pytest.mark.parametrize(("model", "value", "shape"), [(m, v, s) for m, cases in RECORDED.items() for v, s in cases])
def test_input_shapes_follow_tritons_rule(model: str, value: object, shape: list[int] | None) -> None:
    md = metadata(("X", "INT32", SHAPES[model]))
    if shape is None:
        with pytest.raises(InferError) as exc:
            parse({"X": value}, md)
        assert exc.value.http_status == 400
        return
    request = parse({"X": value}, md)
    assert list(request.inputs[0].shape) == shape
    flat = np.array(value).ravel().tolist() if isinstance(value, list) else [value]
    assert np.frombuffer(request.raw_input_contents[0], np.int32).tolist() == flat


def test_keys_map_to_inputs_and_parameters_in_document_order() -> None:
    md = metadata(("text_input", "BYTES", [1]), ("count", "INT32", [1]))
    request = parse({"text_input": "hi", "suffix": "top", "count": [[2]], "parameters": {"suffix": "inner", "t": 0.5,
                                                                                         "stream": False}}, md)
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [("text_input", "BYTES", [1]),
                                                                             ("count", "INT32", [1])]
    assert request.raw_input_contents[0] == b"\x02\x00\x00\x00hi"
    assert request.parameters["suffix"].string_param == "inner"  # the later one wins, as in Triton
    assert request.parameters["t"].double_param == 0.5 and request.parameters["stream"].HasField("bool_param")


@pytest.mark.parametrize(("body", "error"), [
    ({"text_input": "hi", "parameters": {"suffix": [1]}},
     "Converting keyword: 'parameters': parameter 'suffix' has invalid type. It should be either 'int', 'bool', "
     "or 'string'."),
    ({"text_input": "hi", "extra": {"a": 1}},
     "parameter 'extra' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ({"text_input": "hi", "parameters": None},
     "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object"),
    ({"text_input": "hi", "parameters": {"text_input": "x"}},
     "Converting keyword: 'parameters': input 'text_input' already exists in request"),
    ({"text_input": ["a", "b"]}, "The schema can not convert input 'text_input' to tensor with proper shape"),
])
def test_tritons_words_for_bad_requests(body: object, error: str) -> None:
    with pytest.raises(InferError) as exc:
        parse(body, metadata(("text_input", "BYTES", [1])))
    assert (exc.value.http_status, exc.value.message) == (400, error)


@pytest.mark.parametrize("body", [b"{bad", b"[1,2]", b"", b'{"text_input": 5}', b'{"count": "x"}', b'{"count": 1.5}'])
def test_malformed_bodies_are_client_errors(body: bytes) -> None:
    md = metadata(("text_input", "BYTES", [1]), ("count", "INT32", [1]))
    with pytest.raises(InferError) as exc:
        parse_generate_request(body, "m", "", md)
    assert exc.value.http_status == 400


def test_outputs_render_as_scalars_or_flat_arrays_keys_sorted() -> None:
    response = pb.ModelInferResponse(model_name="add_sub_py", model_version="1")
    for name, dt, shape, raw in (("OUTPUT0", "FP32", [1, 4], np.array([2, 3, 4, 5], np.float32).tobytes()),
                                 ("text_output", "BYTES", [1], b"\x03\x00\x00\x00h\xc3\xa9"),
                                 ("IDX", "UINT32", [1], np.array([0], np.uint32).tobytes()),
                                 ("EMPTY", "INT32", [1, 0], b"")):
        response.outputs.add(name=name, datatype=dt, shape=shape)
        response.raw_output_contents.append(raw)
    assert render_generate_response(response, pb.ModelInferRequest()) == \
        '{"EMPTY":[],"IDX":0,"OUTPUT0":[2.0,3.0,4.0,5.0],"model_name":"add_sub_py","model_version":"1",' \
        '"text_output":"hé"}'.encode()


def test_events() -> None:
    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse_error("faulty_stream failed on 3") == b'data: {"error":"faulty_stream failed on 3"}\n\n'
