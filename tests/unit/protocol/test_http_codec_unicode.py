"""Strings a JSON body can carry but no protobuf field can hold (lone surrogates), and the gRPC
contents rule: client mistakes, INVALID_ARG naming the field."""
from __future__ import annotations

import json

import numpy as np
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.http_codec import (
    parse_index_request,
    parse_infer_request,
    parse_json_object,
    parse_load_request,
    parse_trace_settings,
    parse_unload_request,
)
from meshserve.protocol.infer_checks import reject_mixed_contents

GOOD_INPUT = '{"name": "IN", "shape": [1], "datatype": "FP32", "data": [1]}'


def with_good(template: str) -> str:
    """`template` with GOOD_INPUT in place of `@`."""
    return template.replace("@", GOOD_INPUT)


def invalid(fn, *args, match: str) -> str:
    with pytest.raises(InferError) as info:
        fn(*args)
    assert info.value.code == Code.INVALID_ARG
    assert match in info.value.message, info.value.message
    return info.value.message


@pytest.mark.parametrize(("body", "where"), [
    (r'{"inputs": [{"name": "\ud800", "shape": [1], "datatype": "FP32", "data": [1]}]}', "'inputs[0].name'"),
    (with_good(r'{"inputs": [@, {"name": "X", "shape": [1], "datatype": "\udfff", "data": [1]}]}'),
     "input 'X': the request JSON has a string that is not valid Unicode (a lone surrogate escape such as "
     r"\ud800) at 'inputs[1].datatype'"),
    (with_good(r'{"id": "a\uDC80b", "inputs": [@]}'), "at 'id'"),
    (with_good(r'{"parameters": {"k": "\ud83d"}, "inputs": [@]}'), "at 'parameters.k'"),
    (with_good(r'{"parameters": {"\ud83d": 1}, "inputs": [@]}'), r"at 'parameters.\ud83d'"),
    (with_good(r'{"inputs": [@], "outputs": [{"name": "\ud800"}]}'), "at 'outputs[0].name'"),
    (with_good(r'{"inputs": [@], "outputs": [{"name": "O", "parameters": {"x": ["\ud800"]}}]}'),
     "output 'O': "),
    (r'"\ud800"', "at '(top level)'"),
])
def test_lone_surrogates_are_invalid_naming_the_field(body: str, where: str) -> None:
    invalid(parse_infer_request, body.encode(), None, "m", match=where)


def test_raw_surrogate_bytes_are_invalid_too() -> None:
    """A surrogate's own UTF-8 bytes (ED A0 80) are not valid UTF-8, but json.loads decodes bytes
    with "surrogatepass" and takes them: the same 400, not a 500 (the no-5xx fuzz found it)."""
    body = b'{"inputs": [{"name": "\xed\xa0\x80", "shape": [1], "datatype": "FP32", "data": [1]}]}'
    invalid(parse_infer_request, body, None, "m", match="'inputs[0].name'")


def test_surrogate_pairs_and_non_ascii_text_are_fine() -> None:
    body = with_good(r'{"id": "\ud83d\ude00 é 中", "inputs": [@]}')
    assert parse_infer_request(body.encode(), None, "m").id == "\U0001f600 é 中"
    # a `\u` escape that is not a surrogate, next to one that is escaped text, not an escape
    body = with_good(r'{"id": "\\ud800 \u00e9", "inputs": [@]}')
    assert parse_infer_request(body.encode(), None, "m").id == "\\ud800 é"


@pytest.mark.parametrize("fn", [
    lambda b: parse_json_object(b, "log settings"), parse_trace_settings, parse_index_request,
    parse_load_request, parse_unload_request,
])
def test_every_body_parser_refuses_surrogates(fn) -> None:
    invalid(fn, rb'{"parameters": {"config": "\ud800"}, "x\udfff": 1}', match="not valid Unicode")


def test_settings_parsers_name_the_body_and_accept_empty() -> None:
    invalid(parse_json_object, b"{bad", "log settings", match="failed to parse the log settings JSON")
    invalid(parse_json_object, b"[1]", "log settings", match="log settings body must be a JSON object")
    assert parse_json_object(b"  ", "log settings") == {}
    assert parse_index_request(b"") is False
    assert parse_index_request(json.dumps({"ready": True}).encode()) is True
    invalid(parse_index_request, b"[]", match="repository index body must be a JSON object")
    invalid(parse_index_request, b"{", match="failed to parse the repository index request JSON")


def test_body_parsers_accept_bytearray() -> None:
    body = bytearray(with_good('{"inputs": [@]}').encode())
    assert parse_infer_request(body, None, "m").raw_input_contents[0] == np.float32(1).tobytes()
    assert parse_json_object(bytearray(b'{"a": 1}'), "x") == {"a": 1}


def test_reject_mixed_contents_matches_triton() -> None:
    req = pb.ModelInferRequest(model_name="simple")
    req.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 2])
    req.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 2])
    req.inputs[0].contents.int_contents.extend([1, 2])
    reject_mixed_contents(req)  # typed contents alone: fine
    req.raw_input_contents.append(b"\0" * 8)
    invalid(reject_mixed_contents, req, match="contents field must not be specified when using "
            "raw_input_contents for 'INPUT0' for model 'simple'")
    req.inputs[0].ClearField("contents")
    req.raw_input_contents.append(b"\0" * 8)
    reject_mixed_contents(req)  # raw alone: fine
    req.inputs[1].contents.SetInParent()  # an empty contents message is still "contents" (has_contents)
    invalid(reject_mixed_contents, req, match="for 'INPUT1' for model 'simple'")


def test_an_integer_too_long_for_int_is_invalid_not_internal() -> None:
    # json.loads raises a plain ValueError past sys.int_info's digit limit (found by the fuzz: 500)
    with pytest.raises(InferError) as err:
        parse_json_object(b'{"inputs":' + b"1" * 5000 + b"}", "infer request")
    assert err.value.code is Code.INVALID_ARG and "digits" in err.value.message
