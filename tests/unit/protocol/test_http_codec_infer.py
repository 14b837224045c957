"""http_codec inference bodies, checked against the real tritonclient (2.73) encoder/decoder."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import datatypes, http_codec
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.http_codec import (
    HEADER_LENGTH,
    decode_body,
    encode_body,
    parse_header_length,
    parse_infer_request,
    render_infer_response,
)

NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
           "FP16", "FP32", "FP64"]
ALL = NUMERIC + ["BYTES"]


def sample(datatype: str, shape: tuple[int, ...] = (2, 3), *, utf8: bool = True) -> np.ndarray:
    """A deterministic array that includes the datatype's extremes."""
    n = int(np.prod(shape))
    rng = np.random.default_rng(7)
    if datatype == "BOOL":
        arr = rng.integers(0, 2, n).astype(bool)
    elif datatype == "BYTES":
        pool = ["", "a", "héllo wörld", "日本語", "x" * 70] if utf8 else [b"\x00\xff\xfe", b"", b"ok"]
        arr = np.array([pool[i % len(pool)] for i in range(n)], dtype=np.object_)
        if not utf8:
            return arr.reshape(shape)
        arr = np.array([s.encode() for s in arr], dtype=np.object_)
    elif datatype.startswith("FP"):
        dt = datatypes.numpy_dtype(datatype)
        arr = (rng.standard_normal(n) * 100).astype(dt)
        extremes = [np.finfo(dt).max, -np.inf, np.finfo(dt).tiny]
        arr[: min(n, 3)] = extremes[: min(n, 3)]
    else:
        dt = datatypes.numpy_dtype(datatype)
        info = np.iinfo(dt)
        arr = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        arr[: min(n, 2)] = [info.min, info.max][: min(n, 2)]
    return arr.reshape(shape)


def expected_raw(arr: np.ndarray) -> bytes:
    if arr.dtype == np.object_:
        return datatypes.serialize_bytes(arr.ravel())
    return arr.tobytes()


def build(inputs, outputs=None, request_id="", sequence_id=0, sequence_start=False, sequence_end=False,
          priority=0, timeout=None, custom_parameters=None) -> tuple[bytes, int | None]:
    body, json_size = _get_inference_request(
        inputs=inputs, request_id=request_id, outputs=outputs, sequence_id=sequence_id,
        sequence_start=sequence_start, sequence_end=sequence_end, priority=priority,
        timeout=timeout, custom_parameters=custom_parameters)
    return (body if isinstance(body, bytes) else body.encode()), json_size


def make_input(name: str, arr: np.ndarray, datatype: str, binary: bool) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def invalid(fn, *args, code: Code = Code.INVALID_ARG, match: str = "") -> InferError:
    with pytest.raises(InferError) as info:
        fn(*args)
    assert info.value.code == code, info.value
    assert match in info.value.message, info.value.message
    return info.value


# --- requests ---------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", ALL)
def test_request_every_datatype_round_trips(datatype: str, binary: bool) -> None:
    arr = sample(datatype)
    body, json_size = build([make_input("INPUT0", arr, datatype, binary)])
    assert (json_size is not None) == binary
    req = parse_infer_request(body, json_size, "simple", "3")
    assert req.model_name == "simple" and req.model_version == "3"
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [("INPUT0", datatype, [2, 3])]
    assert list(req.raw_input_contents) == [expected_raw(arr)]
    assert "binary_data_size" not in req.inputs[0].parameters
    assert req.parameters["binary_data_output"].bool_param is True  # no outputs requested


def test_request_fp16_json_keeps_nan() -> None:
    arr = np.array([np.nan, 1.5, -0.0], dtype=np.float16)
    body, size = build([make_input("X", arr, "FP16", False)])
    raw = parse_infer_request(body, size, "m").raw_input_contents[0]
    out = np.frombuffer(raw, np.float16)
    assert np.isnan(out[0]) and out[1] == 1.5 and np.signbit(out[2])


def test_request_bytes_binary_non_utf8() -> None:
    arr = sample("BYTES", (3,), utf8=False)
    body, size = build([make_input("S", arr, "BYTES", True)])
    assert parse_infer_request(body, size, "m").raw_input_contents[0] == expected_raw(arr)


def test_request_mixed_inputs_parameters_and_outputs() -> None:
    a = sample("INT32", (1, 16))
    b = sample("FP32", (1, 4))
    c = sample("BYTES", (2,))
    inputs = [make_input("A", a, "INT32", True), make_input("B", b, "FP32", False),
              make_input("C", c, "BYTES", True)]
    outputs = [httpclient.InferRequestedOutput("OUT0", binary_data=False),
               httpclient.InferRequestedOutput("OUT1", class_count=3)]
    body, size = build(inputs, outputs, request_id="req-7", sequence_id=2**64 - 1, sequence_start=True,
                       sequence_end=False, priority=2, timeout=1500,
                       custom_parameters={"temperature": 0.5, "tag": "x", "n": -3, "flag": True})
    req = parse_infer_request(body, size, "m")
    assert req.id == "req-7"
    assert list(req.raw_input_contents) == [a.tobytes(), b.tobytes(), expected_raw(c)]
    p = req.parameters
    assert p["sequence_id"].uint64_param == 2**64 - 1  # too big for int64
    assert p["sequence_start"].bool_param is True
    assert p["sequence_end"].WhichOneof("parameter_choice") == "bool_param"
    assert p["priority"].int64_param == 2 and p["timeout"].int64_param == 1500
    assert p["temperature"].double_param == 0.5 and p["tag"].string_param == "x"
    assert p["n"].int64_param == -3 and p["flag"].bool_param is True
    assert "binary_data_output" not in p
    assert [o.name for o in req.outputs] == ["OUT0", "OUT1"]
    assert req.outputs[0].parameters["binary_data"].bool_param is False
    assert req.outputs[1].parameters["binary_data"].bool_param is True
    assert req.outputs[1].parameters["classification"].int64_param == 3


def test_request_header_length_equal_to_body_perf_analyzer_style() -> None:
    body = json.dumps({"id": "", "inputs": [{"name": "X", "shape": [2], "datatype": "INT64",
                                             "data": [1, -2]}]}).encode()
    req = parse_infer_request(body, len(body), "m")
    assert req.id == "" and req.raw_input_contents[0] == np.array([1, -2], "<i8").tobytes()


def test_request_nested_and_ragged_data_flattened_row_major() -> None:
    body = json.dumps({"inputs": [
        {"name": "N", "shape": [2, 2], "datatype": "INT16", "data": [[1, 2], [3, 4]]},
        {"name": "R", "shape": [3], "datatype": "FP32", "data": [[1.5], [2, 3]]},
        {"name": "S", "shape": [1, 2], "datatype": "BYTES", "data": [["a", "b"]]},
        {"name": "E", "shape": [0, 4], "datatype": "UINT8", "data": []},
        {"name": "I", "shape": [2], "datatype": "FP64", "data": [1, 2]},  # ints into floats
    ]}).encode()
    raws = parse_infer_request(body, None, "m").raw_input_contents
    assert raws[0] == np.array([1, 2, 3, 4], "<i2").tobytes()
    assert raws[1] == np.array([1.5, 2, 3], "<f4").tobytes()
    assert raws[2] == datatypes.serialize_bytes([b"a", b"b"])
    assert raws[3] == b""
    assert raws[4] == np.array([1, 2], "<f8").tobytes()


def test_request_input_parameters_kept_and_bf16_binary() -> None:
    blob = b"\x80\x3f\x00\x40"  # two bf16 values
    header = json.dumps({"inputs": [{"name": "H", "shape": [2], "datatype": "BF16",
                                     "parameters": {"binary_data_size": 4, "custom": "v"}}]}).encode()
    req = parse_infer_request(header + blob, len(header), "m")
    assert req.raw_input_contents[0] == blob
    assert dict(req.inputs[0].parameters)["custom"].string_param == "v"
    assert "binary_data_size" not in req.inputs[0].parameters


def test_request_compressed_bodies() -> None:
    arr = sample("FP32", (4, 4))
    body, size = build([make_input("X", arr, "FP32", True)])
    for coding in ("gzip", "deflate"):
        compressed, used = encode_body(body, coding)
        assert used == coding
        req = parse_infer_request(decode_body(compressed, coding), size, "m")
        assert req.raw_input_contents[0] == arr.tobytes()


def test_request_accepts_bytearray_and_memoryview() -> None:
    arr = sample("INT8", (5,))
    body, size = build([make_input("X", arr, "INT8", True)])
    for b in (bytearray(body), memoryview(body)):
        assert parse_infer_request(b, size, "m").raw_input_contents[0] == arr.tobytes()


# --- request errors ---------------------------------------------------------------------

def _json_body(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def test_error_malformed_json() -> None:
    invalid(parse_infer_request, b'{"inputs": [', None, "m", match="failed to parse the request JSON")
    invalid(parse_infer_request, b"\xff\xfe\x00garbage", None, "m", match="failed to parse")
    invalid(parse_infer_request, b"[1, 2]", None, "m", match="must be an object")
    invalid(parse_infer_request, b"[" * 100000, None, "m", match="failed to parse")


def test_error_missing_or_bad_inputs() -> None:
    invalid(parse_infer_request, b'{"outputs": []}', None, "m", match="no 'inputs'")
    invalid(parse_infer_request, b'{"inputs": {}}', None, "m", match="'inputs' must be a JSON array")
    invalid(parse_infer_request, _json_body([{"shape": [1], "datatype": "FP32", "data": [1]}]), None, "m",
            match="input 0 has no 'name'")
    invalid(parse_infer_request, _json_body([{"name": "X", "datatype": "FP32", "data": [1]}]), None, "m",
            match="input 'X' has no 'shape'")
    invalid(parse_infer_request, _json_body([{"name": "X", "shape": [1], "datatype": "FP32"}]), None, "m",
            match="input 'X' has neither 'data' nor")
    dup = {"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}
    invalid(parse_infer_request, _json_body([dup, dup]), None, "m", match="input 'X' already exists in request")  # (Triton's words)
    invalid(parse_infer_request, json.dumps({"id": 5, "inputs": []}).encode(), None, "m",
            match="'id' must be a string")


@pytest.mark.parametrize("shape", [[-1, 4], ["2"], [1.5], "16", [True]])
def test_error_bad_shape(shape) -> None:
    body = _json_body([{"name": "X", "shape": shape, "datatype": "FP32", "data": [1]}])
    invalid(parse_infer_request, body, None, "m", match="input 'X': 'shape' must be an array")


def test_error_bad_datatype() -> None:
    body = _json_body([{"name": "X", "shape": [1], "datatype": "FLOAT32", "data": [1]}])
    invalid(parse_infer_request, body, None, "m", match="input 'X': unknown datatype 'FLOAT32'")


def test_error_element_count_mismatch() -> None:
    body = _json_body([{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(8))}])
    invalid(parse_infer_request, body, None, "m", match="input 'INPUT0': shape [1,16] needs 16 elements, got 8")
    body = _json_body([{"name": "S", "shape": [3], "datatype": "BYTES", "data": ["a"]}])
    invalid(parse_infer_request, body, None, "m", match="input 'S': shape [3] needs 3 elements, got 1")
    body = _json_body([{"name": "R", "shape": [4], "datatype": "INT32", "data": [[1, 2], [3]]}])
    invalid(parse_infer_request, body, None, "m", match="input 'R': shape [4] needs 4 elements, got 3")
    body = _json_body([{"name": "D", "shape": [1], "datatype": "INT32", "data": 5}])
    invalid(parse_infer_request, body, None, "m", match="input 'D': 'data' must be a JSON array")


def test_error_binary_size_mismatch_declared_vs_shape() -> None:
    arr = sample("INT32", (1, 16))
    inp = make_input("INPUT0", arr, "INT32", True)
    inp.set_shape([1, 8])
    body, size = build([inp])
    invalid(parse_infer_request, body, size, "m",
            match="input 'INPUT0': binary_data_size is 64 bytes but shape [1,8] of INT32 needs 32")


def test_error_binary_extra_and_truncated_bytes() -> None:
    a, b = sample("FP32", (4,)), sample("BYTES", (2,))
    body, size = build([make_input("A", a, "FP32", True), make_input("B", b, "BYTES", True)])
    assert size is not None
    invalid(parse_infer_request, body + b"\0\0", size, "m", match="binary data of the last binary input 'B'")
    invalid(parse_infer_request, body[:-3], size, "m", match="input 'B': binary_data_size")
    invalid(parse_infer_request, body[:size + 5], size, "m", match="input 'A': binary_data_size is 16 bytes")
    json_only = _json_body([{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}])
    invalid(parse_infer_request, json_only + b"junk", len(json_only), "m", match="no input has a 'binary_data_size'")
    invalid(parse_infer_request, body, None, "m", match="failed to parse")  # header missing: not JSON
    invalid(parse_infer_request, body, len(body) + 1, "m", match="has only")
    invalid(parse_infer_request, body, 0, "m", match="a raw binary request")  # (the front doors read those with the config)


def test_error_binary_input_without_header() -> None:
    body = _json_body([{"name": "A", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}])
    invalid(parse_infer_request, body, None, "m", match="input 'A' has binary_data_size 4 but the request has no")


def test_error_data_and_binary_both() -> None:
    header = _json_body([{"name": "A", "shape": [1], "datatype": "INT8", "data": [1],
                          "parameters": {"binary_data_size": 1}}])
    invalid(parse_infer_request, header + b"\x01", len(header), "m", match="input 'A' has both 'data'")


@pytest.mark.parametrize(("datatype", "data", "fragment"), [
    ("UINT8", [1, 300], "element 1 of 'data' (300) is out of range for UINT8 [0, 255]"),
    ("INT8", [-129], "(-129) is out of range for INT8"),
    ("UINT16", [-1], "(-1) is out of range for UINT16"),
    ("INT32", [2**31], "is out of range for INT32"),
    ("INT64", [2**63], "is out of range for INT64"),
    ("INT64", [-1, 2**63], "element 1 of 'data' (9223372036854775808) is out of range for INT64"),
    ("UINT64", [-1, 2**63], "element 0 of 'data' (-1) is out of range for UINT64"),
    ("UINT64", [2**64], "is out of range for UINT64"),
    ("FP16", [1.0, 70000.0], "element 1 of 'data' (70000.0) is out of range for FP16"),
    ("FP32", [1e39], "out of range for FP32"),
    ("FP64", [10**400], "out of range for FP64"),
    ("INT32", [1, 1.5], "element 1 of 'data' is 1.5; INT32 data must be integers"),
    ("INT32", ["1"], "element 0 of 'data' is \"1\"; INT32 data must be integers"),
    ("FP32", [1, None], "element 1 of 'data' is null; FP32 data must be numbers"),
    ("FP32", [True], "element 0 of 'data' is true; FP32 data must be numbers"),
    ("INT32", [True, False], "element 0 of 'data' is true; INT32 data must be integers"),
    ("BOOL", [1, 0], "element 0 of 'data' is 1; BOOL data must be true/false"),
    ("BYTES", ["a", 3], "element 1 of 'data' is 3; BYTES data must be JSON strings"),
    ("BYTES", ["\ud800"], "not valid Unicode"),
    ("FP32", [{"a": 1}], "element 0 of 'data' is {\"a\": 1}"),
    ("BF16", [1.0], "BF16 tensors must be sent as binary"),
])
def test_error_bad_json_values(datatype: str, data: list, fragment: str) -> None:
    body = _json_body([{"name": "IN", "shape": [len(data)], "datatype": datatype, "data": data}])
    err = invalid(parse_infer_request, body, None, "m", match=fragment)
    assert "input 'IN'" in err.message


def test_shared_memory_tensors() -> None:
    """An input in a shared-memory region has no data and no raw_input_contents entry (as in a
    gRPC request: meshserve.server.shm fills it in); its region parameters and those of a
    requested output are kept for the shared-memory step."""
    shm_in = httpclient.InferInput("IN", [4], "FP32")
    shm_in.set_shared_memory("region0", 16, offset=8)
    plain = make_input("X", sample("FP32", (1,)), "FP32", True)
    out = httpclient.InferRequestedOutput("OUT")
    out.set_shared_memory("region1", 16)
    body, size = build([plain, shm_in], [out])
    req = parse_infer_request(body, size, "m")
    assert [t.name for t in req.inputs] == ["X", "IN"] and len(req.raw_input_contents) == 1
    params = req.inputs[1].parameters
    assert (params["shared_memory_region"].string_param, params["shared_memory_byte_size"].int64_param,
            params["shared_memory_offset"].int64_param) == ("region0", 16, 8)
    assert req.outputs[0].parameters["shared_memory_region"].string_param == "region1"
    both = [{"name": "IN", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4],
             "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}}]
    invalid(parse_infer_request, _json_body(both), None, "m", match="input 'IN' has 'shared_memory_region' and also data")


def test_response_output_in_shared_memory_has_metadata_only() -> None:
    a = sample("FP32", (2,))
    resp = make_response({"O": ("FP32", a), "P": ("FP32", a)})
    resp.raw_output_contents[0] = b""  # written to the region by meshserve.server.shm
    resp.outputs[0].parameters["shared_memory_region"].string_param = "r"
    resp.outputs[0].parameters["shared_memory_byte_size"].int64_param = a.nbytes
    body, headers = render_infer_response(resp, make_request({"O": False, "P": True}))
    result = client_result(body, headers)
    out = result.get_output("O")
    assert out == {"name": "O", "datatype": "FP32", "shape": [2]}  # as Triton: no data, no parameters
    assert_same(result.as_numpy("P"), a)


def test_error_bad_parameters() -> None:
    base = [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]
    invalid(parse_infer_request, _json_body(base, parameters={"p": {"a": 1}}), None, "m",
            match="request parameter 'p': unsupported JSON object")
    invalid(parse_infer_request, _json_body(base, parameters={"p": 2**64}), None, "m",
            match="does not fit in 64 bits")
    invalid(parse_infer_request, _json_body(base, parameters=[1]), None, "m",
            match="request 'parameters' must be a JSON object")
    invalid(parse_infer_request, _json_body(base, parameters={"binary_data_output": 1}), None, "m",
            match="'binary_data_output' must be a boolean")
    invalid(parse_infer_request, _json_body(base, outputs=[{"name": "O", "parameters": {"binary_data": "yes"}}]),
            None, "m", match="output 'O': 'binary_data' must be a boolean")
    invalid(parse_infer_request, _json_body(base, outputs=[{"name": "O", "parameters": {"classification": -1}}]),
            None, "m", match="output 'O': 'classification' must be a non-negative integer")
    invalid(parse_infer_request, _json_body(base, outputs=[{"name": "O"}, {"name": "O"}]), None, "m",
            match="output 'O' already exists in request")  # (Triton's words since 2026-04; 2.51 answered it once)
    bad_size = [{"name": "X", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": "4"}}]
    invalid(parse_infer_request, _json_body(bad_size) + b"1234", len(_json_body(bad_size)), "m",
            match="input 'X': 'binary_data_size' must be a non-negative integer")


def test_parse_header_length() -> None:
    assert parse_header_length(None) is None
    assert parse_header_length(" 42 ") == 42
    for bad in ("-1", "abc", "", "4.0", "٣"):
        invalid(parse_header_length, bad, match=HEADER_LENGTH)


# --- responses --------------------------------------------------------------------------

def make_response(outputs: dict[str, tuple[str, np.ndarray]], **kw) -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name=kw.pop("model_name", "simple"),
                                 model_version=kw.pop("model_version", "1"), **kw)
    for name, (datatype, arr) in outputs.items():
        resp.outputs.add(name=name, datatype=datatype, shape=list(arr.shape))
        resp.raw_output_contents.append(expected_raw(arr))
    return resp


def make_request(outputs: dict[str, bool | None] | None = None, binary_data_output: bool | None = None,
                 request_id: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="simple", model_version="", id=request_id)
    if binary_data_output is not None:
        req.parameters["binary_data_output"].bool_param = binary_data_output
    for name, binary in (outputs or {}).items():
        out = req.outputs.add(name=name)
        if binary is not None:
            out.parameters["binary_data"].bool_param = binary
    return req


def client_result(body: bytes, headers: dict[str, str], content_encoding: str | None = None):
    length = headers.get(HEADER_LENGTH)
    return httpclient.InferResult.from_response_body(
        body, verbose=False, header_length=None if length is None else int(length),
        content_encoding=content_encoding)


def as_expected_client_value(arr: np.ndarray, binary: bool) -> np.ndarray:
    """What tritonclient's as_numpy yields: BYTES in JSON come back as str."""
    if arr.dtype == np.object_ and not binary:
        return np.array([b.decode() for b in arr.ravel()], dtype=np.object_).reshape(arr.shape)
    return arr


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    if want.dtype == np.object_:
        assert got.dtype == np.object_ and got.tolist() == want.tolist()
    else:
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", ALL)
def test_response_every_datatype_round_trips_through_tritonclient(datatype: str, binary: bool) -> None:
    arr = sample(datatype, (2, 5))
    resp = make_response({"OUT": (datatype, arr)})
    body, headers = render_infer_response(resp, make_request(binary_data_output=binary))
    if binary:
        assert headers["Content-Type"] == "application/octet-stream"
        assert int(headers[HEADER_LENGTH]) < len(body)
    else:
        assert headers == {"Content-Type": "application/json"}
        assert "parameters" not in json.loads(body)["outputs"][0]
    result = client_result(body, headers)
    assert_same(result.as_numpy("OUT"), as_expected_client_value(arr, binary))
    doc = result.get_response()
    assert doc["model_name"] == "simple" and doc["model_version"] == "1" and "id" not in doc


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_response_json_nan_and_inf(datatype: str) -> None:
    arr = np.array([np.nan, np.inf, -np.inf, -0.0], dtype=datatypes.numpy_dtype(datatype))
    body, headers = render_infer_response(make_response({"O": (datatype, arr)}), make_request())
    got = client_result(body, headers).as_numpy("O")
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and np.signbit(got[3])


def test_response_requested_output_subset_mixed_binary_and_json() -> None:
    a, b, c = sample("INT32", (1, 16)), sample("FP16", (3,)), sample("BYTES", (2,))
    resp = make_response({"OUT0": ("INT32", a), "OUT1": ("FP16", b), "OUT2": ("BYTES", c)})
    # OUT1 binary, OUT0 JSON, OUT2 falls back to binary_data_output (true)
    req = make_request({"OUT1": True, "OUT0": False, "OUT2": None}, binary_data_output=True)
    body, headers = render_infer_response(resp, req)
    result = client_result(body, headers)
    assert_same(result.as_numpy("OUT0"), a)
    assert_same(result.as_numpy("OUT1"), b)
    assert_same(result.as_numpy("OUT2"), c)
    outs = result.get_response()["outputs"]
    assert "data" in outs[0] and "parameters" not in outs[0]
    assert outs[1]["parameters"] == {"binary_data_size": b.nbytes} and "data" not in outs[1]
    assert outs[2]["parameters"] == {"binary_data_size": len(expected_raw(c))}
    # binary section = binary outputs in output order
    start = int(headers[HEADER_LENGTH])
    assert body[start:] == b.tobytes() + expected_raw(c)


def test_response_outputs_listed_without_binary_flag_default_to_json() -> None:
    a = sample("FP32", (2,))
    body, headers = render_infer_response(make_response({"O": ("FP32", a)}), make_request({"O": None}))
    assert HEADER_LENGTH not in headers
    assert_same(client_result(body, headers).as_numpy("O"), a)


def test_response_id_parameters_and_version_fallback() -> None:
    a = sample("UINT8", (3,))
    resp = make_response({"O": ("UINT8", a)}, model_version="")
    resp.parameters["sequence_id"].uint64_param = 2**64 - 1
    resp.parameters["note"].string_param = "ok"
    resp.parameters["score"].double_param = 0.25
    resp.parameters["final"].bool_param = True
    resp.parameters["unset"].CopyFrom(pb.InferParameter())
    req = make_request(request_id="abc")
    req.model_version = "2"
    body, headers = render_infer_response(resp, req)
    doc = json.loads(body)
    assert doc["id"] == "abc" and doc["model_version"] == "2"
    assert doc["parameters"] == {"sequence_id": 2**64 - 1, "note": "ok", "score": 0.25, "final": True}
    resp.id = "from-model"
    assert json.loads(render_infer_response(resp, req)[0])["id"] == "from-model"


def test_response_bf16_json_values_and_binary() -> None:
    raw = np.array([1.0, -2.5, 3.140625], dtype=np.float32).view(np.uint32) >> 16
    blob = raw.astype("<u2").tobytes()
    resp = pb.ModelInferResponse(model_name="m", model_version="1")
    resp.outputs.add(name="O", datatype="BF16", shape=[3])
    resp.raw_output_contents.append(blob)
    body, headers = render_infer_response(resp, make_request())
    assert json.loads(body)["outputs"][0]["data"] == [1.0, -2.5, 3.140625]
    body, headers = render_infer_response(resp, make_request(binary_data_output=True))
    assert body[int(headers[HEADER_LENGTH]):] == blob


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_response_typed_contents(binary: bool) -> None:
    resp = pb.ModelInferResponse(model_name="m", model_version="1")
    cases = {
        "B": ("BOOL", "bool_contents", np.array([True, False, True])),
        "I8": ("INT8", "int_contents", np.array([-128, 0, 127], np.int8)),
        "U16": ("UINT16", "uint_contents", np.array([0, 65535, 7], np.uint16)),
        "I64": ("INT64", "int64_contents", np.array([-(2**63), 2**63 - 1, 0], np.int64)),
        "U64": ("UINT64", "uint64_contents", np.array([2**64 - 1, 0, 1], np.uint64)),
        "F32": ("FP32", "fp32_contents", np.array([0.1, -1e30, 3.5], np.float32)),
        "F64": ("FP64", "fp64_contents", np.array([0.1, -1e300, 3.5], np.float64)),
        "S": ("BYTES", "bytes_contents", np.array([b"a", b"", "ü".encode()], np.object_)),
    }
    for name, (dt, field, arr) in cases.items():
        out = resp.outputs.add(name=name, datatype=dt, shape=[3])
        getattr(out.contents, field).extend(arr.tolist())
    body, headers = render_infer_response(resp, make_request(binary_data_output=binary))
    result = client_result(body, headers)
    for name, (_, _, arr) in cases.items():
        assert_same(result.as_numpy(name), as_expected_client_value(arr, binary))


def test_response_compressed_round_trip() -> None:
    a = sample("FP32", (64,))
    body, headers = render_infer_response(make_response({"O": ("FP32", a)}), make_request(binary_data_output=True))
    for accept, coding in (("gzip", "gzip"), ("deflate", "deflate"), ("deflate;q=0.5, gzip;q=0.9", "gzip")):
        compressed, used = encode_body(body, accept)
        assert used == coding
        assert_same(client_result(compressed, headers, content_encoding=used).as_numpy("O"), a)


def test_response_no_outputs_is_pure_json() -> None:
    resp = pb.ModelInferResponse(model_name="m", model_version="1")
    body, headers = render_infer_response(resp, make_request(binary_data_output=True))
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body) == {"model_name": "m", "model_version": "1", "outputs": []}


def test_response_errors() -> None:
    bad = pb.ModelInferResponse(model_name="m", model_version="1")
    bad.outputs.add(name="S", datatype="BYTES", shape=[1])
    bad.raw_output_contents.append(struct.pack("<I", 2) + b"\xff\xfe")
    invalid(render_infer_response, bad, make_request(), match="output 'S': element 0 is not valid UTF-8")
    body, headers = render_infer_response(bad, make_request(binary_data_output=True))  # binary is fine
    assert client_result(body, headers).as_numpy("S").tolist() == [b"\xff\xfe"]

    short = make_response({"O": ("FP32", sample("FP32", (4,)))})
    short.outputs[0].shape[:] = [5]
    for flag in (True, False):
        invalid(render_infer_response, short, make_request(binary_data_output=flag), code=Code.INTERNAL,
                match="output 'O' holds 16 bytes but shape [5] of FP32 needs 20")

    truncated = pb.ModelInferResponse(model_name="m")
    truncated.outputs.add(name="S", datatype="BYTES", shape=[2])
    truncated.raw_output_contents.append(struct.pack("<I", 1) + b"a")
    invalid(render_infer_response, truncated, make_request(), code=Code.INTERNAL, match="output 'S'")

    mismatch = make_response({"O": ("FP32", sample("FP32", (4,)))})
    mismatch.raw_output_contents.append(b"")
    invalid(render_infer_response, mismatch, make_request(), code=Code.INTERNAL, match="raw_output_contents")

    fp16_typed = pb.ModelInferResponse(model_name="m")
    fp16_typed.outputs.add(name="H", datatype="FP16", shape=[1])
    invalid(render_infer_response, fp16_typed, make_request(), code=Code.INTERNAL, match="output 'H'")

    typed_count = pb.ModelInferResponse(model_name="m")
    typed_count.outputs.add(name="I", datatype="INT32", shape=[3]).contents.int_contents.extend([1])
    invalid(render_infer_response, typed_count, make_request(), code=Code.INTERNAL,
            match="output 'I' holds 1 elements in contents.int_contents but shape [3] needs 3")


def test_json_data_decoded_past_decoded_max_is_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """http_codec.DECODED_MAX (the process's --max-request-bytes): the request's tensors decoded
    from JSON may hold at most that many bytes; past it, 413 before the input past the bound is
    decoded (fixed-size types by their shape, BYTES once decoded). At the bound: decoded."""
    monkeypatch.setattr(http_codec, "DECODED_MAX", 1000)

    def body(*inputs: tuple[str, list[int], str, list[object]]) -> bytes:
        return json.dumps({"inputs": [{"name": n, "shape": s, "datatype": d, "data": x}
                                      for n, s, d, x in inputs]}).encode()

    at = http_codec.parse_infer_request(body(("a", [1, 200], "FP32", [0] * 200), ("b", [50], "INT32", [0] * 50)),
                                        None, "m")
    assert [len(r) for r in at.raw_input_contents] == [800, 200]
    for past in (body(("a", [1, 200], "FP32", [0] * 200), ("b", [51], "INT32", [0] * 51)),
                 body(("a", [2], "BYTES", ["x" * 600, "y" * 600]))):
        with pytest.raises(InferError) as err:
            http_codec.parse_infer_request(past, None, "m")
        assert err.value.code == Code.TOO_LARGE
        assert err.value.message.endswith("the request's tensors decode to more than 1000 bytes (--max-request-bytes)")


def test_a_raw_binary_request_takes_its_input_from_the_config() -> None:
    """http_codec.raw_binary_request: Triton's core rules (infer_request.cc, Normalize) and words."""
    from google.protobuf import text_format

    from meshserve._proto import model_config_pb2 as mc
    from meshserve.protocol.http_codec import raw_binary_request

    def config(text: str) -> mc.ModelConfig:
        return text_format.Parse(text, mc.ModelConfig())

    batched = config('max_batch_size: 8 input [ { name: "X" data_type: TYPE_FP16 dims: [ 3, -1 ] } ]')
    req = raw_binary_request(bytes(24), batched, "m", "2")
    assert (req.model_name, req.model_version, req.inputs[0].name, req.inputs[0].datatype) == ("m", "2", "X", "FP16")
    assert list(req.inputs[0].shape) == [1, 3, 4] and req.raw_input_contents[0] == bytes(24)
    assert req.parameters["binary_data_output"].bool_param
    fixed = config('input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]')
    assert list(raw_binary_request(bytes(8), fixed, "m", "").inputs[0].shape) == [2]  # (no batch dimension)
    one = config('input [ { name: "S" data_type: TYPE_STRING dims: [ 1 ] } ]')
    assert raw_binary_request(b"427", one, "m", "").raw_input_contents[0] == b"\x03\x00\x00\x00427"
    for text, message in [
        ('input [ { name: "S" data_type: TYPE_STRING dims: [ -1 ] } ]',
         "For BYTE datatype raw input 'S', the model must have input shape [1]"),
        ('input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]',
         "The shape of the raw input 'X' can not be deduced because there are more than one variable-sized dimension"),
        ('input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 1 ] } ]',
         "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'm' model configuration"),
    ]:
        with pytest.raises(InferError) as err:
            raw_binary_request(b"1234", config(text), "m", "")
        assert err.value.message == message
