"""http_codec's JSON request template (parse_infer of an all-JSON body) and the kept pieces of
a JSON answer (render_infer_response with a RenderPlan): every answer equals the full parse /
render's, errors included word for word, for bodies made by the real tritonclient encoder and
by hand (perf_analyzer's compact JSON with Inference-Header-Content-Length = body length)."""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import datatypes, http_codec
from meshserve.protocol.errors import InferError
from meshserve.protocol.http_codec import parse_infer, parse_infer_request, render_infer_response


@pytest.fixture(autouse=True)
def _empty_caches() -> None:
    http_codec._templates.clear()
    http_codec._json_templates.clear()
    http_codec._rendered.clear()


def client_body(arrays: dict[str, tuple[np.ndarray, str]], outputs: tuple[str, ...] = ("OUT",),
                request_id: str = "") -> bytes:
    """An all-JSON request as tritonclient's HTTP client writes it (binary_data=False)."""
    inputs = []
    for name, (arr, datatype) in arrays.items():
        t = httpclient.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr, binary_data=False)
        inputs.append(t)
    outs = [httpclient.InferRequestedOutput(o, binary_data=False) for o in outputs]
    data, json_size = _get_inference_request(inputs=inputs, request_id=request_id, outputs=outs,
                                             sequence_id=0, sequence_start=False, sequence_end=False,
                                             priority=0, timeout=None, custom_parameters=None)
    assert json_size is None
    return data if isinstance(data, bytes) else data.encode()


def compact(inputs: list[dict[str, Any]], outputs: list[str] | None = None, **top: Any) -> bytes:
    """A compact JSON body (as perf_analyzer's rapidjson writes one)."""
    doc: dict[str, Any] = {**top, "inputs": inputs}
    if outputs is not None:
        doc["outputs"] = [{"name": o} for o in outputs]
    return json.dumps(doc, separators=(",", ":")).encode()


def same_as_full(data: bytes, header_length: int | None, model: str = "m", version: str = "") -> pb.ModelInferRequest:
    """parse_infer's request, checked against the full parse (and its serialized form, when made
    from a template)."""
    request, plan, raw = parse_infer(data, header_length, model, version)
    assert request == parse_infer_request(data, header_length, model, version)
    if raw is not None:
        assert plan is not None and pb.ModelInferRequest.FromString(raw) == request
    return request


def error_of(fn: Any, *args: Any) -> str:
    with pytest.raises(InferError) as caught:
        fn(*args)
    assert caught.value.http_status == 400
    return caught.value.message


@pytest.mark.parametrize("perf_analyzer", [False, True])
def test_repeated_skeletons_use_the_template_with_their_own_numbers(perf_analyzer: bool) -> None:
    rng = np.random.default_rng(0)
    made = []
    for i in range(6):
        a, b = rng.random((1, 16), dtype=np.float32), rng.random((1, 16), dtype=np.float32)
        data = client_body({"INPUT0": (a, "FP32"), "INPUT1": (b, "FP32")}, ("OUTPUT0", "OUTPUT1"))
        hl = len(data) if perf_analyzer else None
        request, plan, raw = parse_infer(data, hl, "add_sub", "1")
        assert request == parse_infer_request(data, hl, "add_sub", "1")
        assert plan is not None and (raw is None) == (i == 0)  # the first makes the template
        assert request.raw_input_contents[0] == a.tobytes() and request.raw_input_contents[1] == b.tobytes()
        made.append(plan)
    assert len(http_codec._json_templates) == 1 and all(p is made[0] for p in made)
    # another model or version: its own template, its own names
    other, plan, _ = parse_infer(data, None, "other", "")
    assert other.model_name == "other" and other.model_version == "" and plan is not made[0]


def test_what_changes_the_skeleton_is_parsed_again() -> None:
    base = [{"name": "A", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]
    variants = [
        base,
        [{"name": "A", "shape": [2, 1], "datatype": "FP32", "data": [1, 2]}],  # shape
        [{"name": "A", "shape": [1, 2], "datatype": "FP64", "data": [1, 2]}],  # datatype
        [{"name": "B", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],  # name
        [{"name": "A", "shape": [1, 2], "datatype": "FP32", "data": [1, 2], "parameters": {"p": 1}}],
        [{"name": "A", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}],
    ]
    for inputs in variants:
        same_as_full(compact(inputs), None)
        same_as_full(compact(inputs, ["X"]), None)  # outputs
        same_as_full(compact(inputs, id="r1"), None)  # id
        same_as_full(compact(inputs, parameters={"priority": 2}), None)  # parameters
    count = len(http_codec._json_templates)
    assert count == 4 * len(variants)
    for inputs in variants:  # all hits now: each its own shape, names and numbers
        data = compact([{**t, "data": [v + 0.5 for v in t["data"]]} for t in inputs], ["X"])
        request = same_as_full(data, None)
        assert list(request.inputs[0].shape) == inputs[0]["shape"]
        assert np.frombuffer(request.raw_input_contents[0], "<f4" if inputs[0]["datatype"] == "FP32" else "<f8"
                             ).tolist() == [v + 0.5 for v in inputs[0]["data"]]
    assert len(http_codec._json_templates) == count
    # the whole body as JSON vs the same bytes with Inference-Header-Content-Length: two keys
    data = compact(base)
    same_as_full(data, len(data))
    assert len(http_codec._json_templates) == count + 1


DATA: dict[str, tuple[list[Any], list[Any]]] = {
    "BOOL": ([True, False, True], [False, False, True]),
    "INT8": ([-128, 0, 127], [1, 2, 3]),
    "INT16": ([-32768, 5, 32767], [7, 8, 9]),
    "INT32": ([-(2**31), 0, 2**31 - 1], [3, 2, 1]),
    "INT64": ([-(2**63), 0, 2**63 - 1], [10**18, -(10**18), 5]),
    "UINT8": ([0, 1, 255], [9, 9, 9]),
    "UINT16": ([0, 1, 65535], [1, 2, 3]),
    "UINT32": ([0, 1, 2**32 - 1], [4, 5, 6]),
    "UINT64": ([0, 1, 2**64 - 1], [2**63, 1, 0]),
    "FP16": ([0.1, -65504.0, 3], [1e-8, 2.5, -0.0]),
    "FP32": ([0.1, 3.4028234e38, 1], [1e-45, -2.5, 7]),
    "FP64": ([0.1, 1e308, -5], [2**70, 1.5, 2]),
    "BYTES": (["ab", "", "\u00e9\""], ["xyz", "q", "\u4e2d"]),
}


@pytest.mark.parametrize("datatype", sorted(DATA))
@pytest.mark.parametrize("nested", [False, True])
def test_every_datatype_from_the_template_equals_the_full_parse(datatype: str, nested: bool) -> None:
    def body(values: list[Any]) -> bytes:
        data: list[Any] = [values] if nested else values
        return compact([{"name": "T", "shape": [1, 3], "datatype": datatype, "data": data},
                        {"name": "U", "shape": [2], "datatype": "INT32", "data": [[1], [2]] if nested else [1, 2]}])
    first, second = DATA[datatype]
    r1 = same_as_full(body(first), None)
    r2 = same_as_full(body(second), None)
    assert len(http_codec._json_templates) == 1 and r1.raw_input_contents[0] != r2.raw_input_contents[0]
    again = same_as_full(body(first), None)  # no stale value: the first numbers again
    assert again == r1


# (datatype, data of a [1, 3] input): mistakes in the numbers only, so a template hit
BAD: list[tuple[str, Any]] = [
    ("FP32", [1, 2]),  # wrong element count
    ("FP32", [1, 2, 3, 4]),
    ("FP32", [[1, 2], [3]]),  # ragged nesting
    ("FP32", [[1, 2, 3]]),  # nested: fine
    ("FP32", [1, "2", 3]),  # a string
    ("FP32", [1, None, 3]),
    ("FP32", [True, False, True]),  # bools for a number type
    ("FP32", [True, 1.5, 2]),  # (numpy reads this as floats: accepted, as before)
    ("FP32", [1e39, 0, 0]),  # out of range for FP32
    ("FP16", [70000, 0, 0]),
    ("FP32", [{"a": 1}, 2, 3]),
    ("FP32", 5),  # not a list
    ("FP32", "abc"),
    ("INT8", [1, 300, 2]),
    ("INT32", [1.5, 2, 3]),  # floats for an integer type
    ("INT64", [2**64, 0, 0]),  # beyond 64 bits (orjson: a float; the exact reading words it)
    ("UINT8", [-1, 0, 0]),
    ("UINT64", [2**64, 0, 0]),
    ("BOOL", [1, 0, 1]),
    ("BOOL", [True, None, False]),
    ("BYTES", ["a", 1, "b"]),
    ("BYTES", ["a", "b"]),
    ("FP32", []),
]


@pytest.mark.parametrize(("datatype", "data"), BAD)
def test_bad_numbers_on_a_template_hit_give_the_full_parse_s_answer(datatype: str, data: Any) -> None:
    good = DATA.get(datatype, ([1.0, 2.0, 3.0], []))[0]

    def body(values: Any) -> bytes:
        return compact([{"name": "T", "shape": [1, 3], "datatype": datatype, "data": values}])
    same_as_full(body(good), None)  # the template
    bad = body(data)
    try:
        expected = parse_infer_request(bad, None, "m")
    except InferError as e:
        assert error_of(parse_infer, bad, None, "m") == e.message
        assert error_of(parse_infer, bad, len(bad), "m") == error_of(parse_infer_request, bad, len(bad), "m")
    else:
        assert parse_infer(bad, None, "m")[0] == expected
    assert parse_infer(body(good), None, "m")[2] is not None  # the template is still there and used


@pytest.mark.parametrize("text", [
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,NaN,3]}]}',  # orjson refuses NaN
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,Infinity,-Infinity]}]}',
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]',  # truncated
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,2,3]}],}',
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32"}]}',  # no data
    b'{"inputs":{"name":"T"}}',
    b'{"inputs":["T"]}',
    b'{"inputs":[["T"]]}',
    b'["inputs"]',
    b'{}',
    b'',
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,2,3]},'
    b'{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]}',  # a name twice
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,2,3],'
    b'"parameters":{"binary_data_size":12}}]}',
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32","data":[1,2,3],'
    b'"parameters":{"shared_memory_region":"r"}}]}',
    b'{"inputs":[{"name":"T","shape":[1,-3],"datatype":"FP32","data":[1,2,3]}]}',
    b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP99","data":[1,2,3]}]}',
    b'{"parameters":{"p":10000000000000000000000},"inputs":[{"name":"T","shape":[1],"datatype":"FP32","data":[1]}]}',
    b'{"inputs":[{"name":"T\\ud800","shape":[1],"datatype":"FP32","data":[1]}]}',
    b'{"inputs":[{"name":"T","shape":[3],"datatype":"BF16","data":[1,2,3]}]}',  # BF16: binary only
    b'\xef\xbb\xbf{"inputs":[{"name":"T","shape":[1],"datatype":"FP32","data":[1]}]}',  # a BOM
])
def test_malformed_bodies_answer_as_the_full_parse(text: bytes) -> None:
    for _ in range(2):  # (a second time: nothing kept makes it differ)
        for hl in (None, len(text)):
            try:
                expected = parse_infer_request(text, hl, "m")
            except InferError as e:
                assert error_of(parse_infer, text, hl, "m") == e.message
            else:
                assert parse_infer(text, hl, "m")[0] == expected


def test_inputs_without_data_make_no_json_template() -> None:
    text = (b'{"inputs":[{"name":"T","shape":[1,3],"datatype":"FP32",'
            b'"parameters":{"shared_memory_region":"r","shared_memory_byte_size":12}}]}')
    for _ in range(2):
        request, plan, raw = parse_infer(text, None, "m")
        assert plan is None and raw is None and request == parse_infer_request(text, None, "m")
    assert not http_codec._json_templates


def response(outputs: list[tuple[str, str, list[int], bytes]], rid: str = "") -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name="m", model_version="1", id=rid)
    for name, datatype, shape, raw in outputs:
        out.outputs.add(name=name, datatype=datatype, shape=shape)
        out.raw_output_contents.append(raw)
    return out


def json_request(*names: str) -> tuple[pb.ModelInferRequest, http_codec.RenderPlan]:
    data = client_body({"A": (np.zeros((1, 2), np.float32), "FP32")}, names)
    request, plan, _ = parse_infer(data, None, "m")
    assert plan is not None
    return request, plan


# Triton's JSON answer, byte for byte as meshserve wrote it before the kept pieces (floats in
# their shortest round-tripping form of the output's own type, BOOL true/false, 64-bit integers
# exact, BYTES as strings)
FORMAT_OUTPUTS = [
    ("F", "FP32", [4], np.array([0.1, 1.0, -2.5e-8, 3.4028235e38], np.float32).tobytes()),
    ("H", "FP16", [2], np.array([0.1, 65504], np.float16).tobytes()),
    ("D", "FP64", [2], np.array([0.1, 1e300]).tobytes()),
    ("B", "BOOL", [2], np.array([True, False]).tobytes()),
    ("L", "INT64", [2], np.array([-(2**63), 2**63 - 1]).tobytes()),
    ("U", "UINT64", [2], np.array([2**64 - 1, 0], np.uint64).tobytes()),
    ("I", "INT8", [2], np.array([-128, 127], np.int8).tobytes()),
    ("S", "BYTES", [2], b'\x02\x00\x00\x00ab\x03\x00\x00\x00\xc3\xa9"'),
]
FORMAT_BODY = (
    b'{"model_name":"m","model_version":"1","outputs":['
    b'{"name":"F","datatype":"FP32","shape":[4],"data":[0.1,1.0,-2.5e-8,3.4028235e38]},'
    b'{"name":"H","datatype":"FP16","shape":[2],"data":[0.099975586,65504.0]},'
    b'{"name":"D","datatype":"FP64","shape":[2],"data":[0.1,1e300]},'
    b'{"name":"B","datatype":"BOOL","shape":[2],"data":[true,false]},'
    b'{"name":"L","datatype":"INT64","shape":[2],"data":[-9223372036854775808,9223372036854775807]},'
    b'{"name":"U","datatype":"UINT64","shape":[2],"data":[18446744073709551615,0]},'
    b'{"name":"I","datatype":"INT8","shape":[2],"data":[-128,127]},'
    b'{"name":"S","datatype":"BYTES","shape":[2],"data":["ab","\xc3\xa9\\""]}]}'
)


def test_json_answers_keep_triton_s_format_byte_for_byte() -> None:
    request, plan = json_request(*(o[0] for o in FORMAT_OUTPUTS))
    for _ in range(3):  # the full rendering, then kept pieces
        assert render_infer_response(response(FORMAT_OUTPUTS), request, plan) == (
            FORMAT_BODY, {"Content-Type": "application/json"})
    assert len(http_codec._rendered) == 1
    # non-finite floats: Python's json words (NaN, Infinity), as Triton writes them
    odd = [("F", "FP32", [4], np.array([np.nan, np.inf, -np.inf, 1.5], np.float32).tobytes())]
    request, plan = json_request("F")
    render_infer_response(response([("F", "FP32", [4], np.zeros(4, np.float32).tobytes())]), request, plan)
    body, _ = render_infer_response(response(odd), request, plan)
    assert body == (b'{"model_name":"m","model_version":"1","outputs":[{"name":"F","datatype":"FP32",'
                    b'"shape":[4],"data":[NaN,Infinity,-Infinity,1.5]}]}')


@pytest.mark.parametrize("datatype", sorted(DATA))
def test_kept_json_answers_equal_the_full_rendering(datatype: str) -> None:
    request, plan = json_request("OUT", "OUT1")
    for seed, values in enumerate((*DATA[datatype], DATA[datatype][0])):
        if datatype == "BYTES":
            raw = b"".join(len(v.encode()).to_bytes(4, "little") + v.encode() for v in values)
        else:
            raw = np.array(values, dtype=datatypes.numpy_dtype(datatype)).tobytes()
        answer = response([("OUT", datatype, [1, 3], raw), ("OUT1", "FP32", [2], np.float32([seed, 2.5]).tobytes())])
        assert render_infer_response(answer, request, plan) == render_infer_response(answer, request)
    assert len(http_codec._rendered) == 1


@pytest.mark.parametrize("change", ["id", "wrong size", "bad utf-8", "shape", "count"])
def test_what_the_kept_pieces_cannot_answer_is_rendered_in_full(change: str) -> None:
    request, plan = json_request("OUT")
    good = [("OUT", "FP32", [2], np.float32([1, 2]).tobytes())]
    render_infer_response(response(good), request, plan)
    assert len(http_codec._rendered) == 1
    if change == "id":
        answer = response(good, rid="r1")
    elif change == "wrong size":
        answer = response([("OUT", "FP32", [2], np.float32([1, 2, 3]).tobytes())])
    elif change == "bad utf-8":
        render_infer_response(response([("OUT", "BYTES", [1], b"\x01\x00\x00\x00a")]), request, plan)
        answer = response([("OUT", "BYTES", [1], b"\x01\x00\x00\x00\xff")])
    elif change == "shape":
        answer = response([("OUT", "FP32", [1, 2], np.float32([1, 2]).tobytes())])
    else:
        answer = response(good + good)
    try:
        expected = render_infer_response(answer, request)
    except InferError as e:
        with pytest.raises(InferError) as caught:
            render_infer_response(answer, request, plan)
        assert caught.value.message == e.message and caught.value.code == e.code
    else:
        assert render_infer_response(answer, request, plan) == expected


def test_mixed_binary_and_json_outputs_are_not_kept() -> None:
    inputs = [httpclient.InferInput("A", [1, 2], "FP32")]
    inputs[0].set_data_from_numpy(np.zeros((1, 2), np.float32), binary_data=False)
    outs = [httpclient.InferRequestedOutput("J", binary_data=False), httpclient.InferRequestedOutput("B")]
    data, _ = _get_inference_request(inputs=inputs, request_id="", outputs=outs, sequence_id=0,
                                     sequence_start=False, sequence_end=False, priority=0, timeout=None,
                                     custom_parameters=None)
    request, plan, _ = parse_infer(data.encode() if isinstance(data, str) else data, None, "m")
    for seed in range(3):
        answer = response([("J", "FP32", [2], np.float32([seed, 1]).tobytes()),
                           ("B", "FP32", [2], np.float32([1, seed]).tobytes())])
        assert render_infer_response(answer, request, plan) == render_infer_response(answer, request)
    assert not http_codec._rendered


def float_lists(n: int = 200) -> list[list[Any]]:
    rng = np.random.default_rng(3)
    floats = rng.standard_normal(n).tolist()
    ints = rng.integers(-(2**20), 2**20, n).tolist()
    return [
        floats, ints, [*floats[:-1], 7], [*ints[:-1], 0.5], [*floats[:-1], True], [*ints[:-1], False],
        [True] * n, [True, *floats[1:]], [*floats[:-1], None], [*floats[:-1], "1.5"], [*floats[:-1], [1.0]],
        [*ints[:-1], 2**53 + 1], [*ints[:-1], 2**63 + 5], [*ints[:-1], 2**70], [*floats[:-1], 1e300],
        [*floats[:-1], 70000.0], [*ints[:-1], 65504], [*ints[:-1], 65505], [*floats[:-1], 1e39],
        [*floats[:-1], float("inf")], [*floats[:-1], float("nan")], [16777217] * n, floats[:n * 3 // 4],
        [*floats[:-1], -0.0], [*floats[:-1], -(2**53) + 1], [*floats[:-1], 2**53 - 1], [*floats[:-2], 1e308, 1e308],
        [*floats[:-1], 3.4028235e38], [*floats[:-1], 16777217.0], [*floats[:-1], -float("inf")], [[1.0]] * n,
    ]


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
@pytest.mark.parametrize("n", [200, 128, 127, 16, 2])
def test_float_lists_convert_as_numpy_s_reading_does(datatype: str, n: int) -> None:
    # (_floats_to_raw: a struct's packing, numpy's checks from _FLOATS_MIN elements, the list's
    # own below; _numbers_to_raw: np.array's reading)
    for data in float_lists(n):
        try:
            expected: bytes | str = http_codec._numbers_to_raw("input 'T'", datatype, [n], n, data)
        except InferError as e:
            expected = e.message
        try:
            got: bytes | str = http_codec._json_data_to_raw("input 'T'", datatype, [n], n, data)
        except InferError as e:
            got = e.message
        assert got == expected, data[-3:]
    taken = http_codec._floats_to_raw(datatype, n, float_lists(n)[0])
    assert (taken is None) == (datatype == "FP16" and n < http_codec._FLOATS_MIN)  # (the fast path is taken)


# The float text JSON answers promise, whatever orjson is installed (orjson 3.13 began writing
# `1e+300`): the shortest text that reads back as the same value of the output's type, an
# exponent as rapidjson (Triton's writer) writes it (no `+`), NaN / Infinity / -Infinity words.
_RAPIDJSON_NUMBER = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?(e-?[1-9][0-9]*)?|NaN|-?Infinity")
FLOAT_EDGES = [0.0, -0.0, 0.1, 1.0, -2.5e-8, 1e-7, 1e16, 1e21, 123456789.0, 3.4028235e38, -3.4028235e38,
               1.17549435e-38, 1e-45, float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_text_is_the_promised_form_on_any_orjson(dtype: type) -> None:
    values = np.array(FLOAT_EDGES + [1e300, 2.2250738585072014e-308, 5e-324] if dtype is np.float64
                      else FLOAT_EDGES, dtype)
    text = http_codec._float_json(values)
    tokens = text[1:-1].split(b",")
    assert len(tokens) == len(values)
    for token, value in zip(tokens, values, strict=True):
        assert _RAPIDJSON_NUMBER.fullmatch(token), token
        back = dtype(json.loads(token))
        assert back.tobytes() == value.tobytes() or (np.isnan(back) and np.isnan(value)), (token, value)
        if np.isfinite(value):  # the shortest text: one digit fewer does not read back
            assert len(token.split(b"e")[0].lstrip(b"-").replace(b".", b"").strip(b"0")) <= 17
    assert b"e+" not in text and b"null" not in text


def test_json_answer_floats_have_no_plus_and_read_back_through_tritonclient_s_parser() -> None:
    outputs = [("F", "FP32", [3], np.array([3.4028235e38, np.nan, 1e-7], np.float32).tobytes()),
               ("D", "FP64", [2], np.array([1e300, -np.inf]).tobytes())]
    request, plan = json_request("F", "D")
    for _ in range(3):  # the full rendering, then kept pieces
        body, _ = render_infer_response(response(outputs), request, plan)
        assert b"e+" not in body
        assert b'"data":[3.4028235e38,NaN,1e-7]' in body and b'"data":[1e300,-Infinity]' in body
        doc = json.loads(body)  # tritonclient's HTTP client reads answers with json.loads
        assert np.array(doc["outputs"][0]["data"], np.float32).tobytes()[:4] == outputs[0][3][:4]
