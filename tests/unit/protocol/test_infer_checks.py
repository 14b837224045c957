"""meshserve/protocol/infer_checks.py: how many parts one request may have (check_counts, the
HTTP and generate codecs' counts of the JSON), the byte-level scanners' bound on the fields
they walk (wire.SCAN_FIELDS_MAX: gateway/upstream/merging.py, gateway/cache.py), and which gRPC
messages the body worker parses (heavy, http_codec.parse_grpc_infer_request)."""
from __future__ import annotations

import json
import struct
from collections.abc import Callable

import pytest

from gateway import cache
from gateway.upstream import merging
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import generate_codec, http_codec, wire
from meshserve.protocol.errors import InferError
from meshserve.protocol.infer_checks import (
    COUNT_FROM,
    HEAVY_BYTES,
    HEAVY_FROM,
    MAX_BYTES_ELEMENTS,
    MAX_DIMS,
    MAX_PARAMETERS,
    MAX_PARAMETERS_TOTAL,
    MAX_TENSORS,
    check_bytes_elements,
    check_counts,
    check_message_counts,
    heavy,
)


def request(inputs: int = 1, outputs: int = 0, raw: int = 1, params: int = 0, tensor_params: int = 0,
            output_params: int = 0, dims: int = 2) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m")
    for i in range(inputs):
        t = r.inputs.add(name=f"i{i}", datatype="FP32", shape=[1] * dims)
        for k in range(tensor_params if i == 0 else 0):
            t.parameters[f"k{k}"].int64_param = k
    for i in range(outputs):
        o = r.outputs.add(name=f"o{i}")
        for k in range(output_params if i == 0 else 0):
            o.parameters[f"k{k}"].bool_param = True
    r.raw_input_contents.extend([b"\0\0\0\0"] * raw)
    for k in range(params):
        r.parameters[f"p{k}"].string_param = "v"
    return r


OVER: dict[str, tuple[dict[str, int], str]] = {
    "inputs": ({"inputs": MAX_TENSORS + 1}, f"the request has {MAX_TENSORS + 1} inputs; at most {MAX_TENSORS}"),
    "outputs": ({"outputs": MAX_TENSORS + 1},
                f"the request has {MAX_TENSORS + 1} requested outputs; at most {MAX_TENSORS}"),
    "raw": ({"raw": MAX_TENSORS + 1},
            f"the request has {MAX_TENSORS + 1} raw_input_contents entries; at most {MAX_TENSORS}"),
    "params": ({"params": MAX_PARAMETERS + 1},
               f"the request has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}"),
    "tensor params": ({"tensor_params": MAX_PARAMETERS + 1},
                      f"input 'i0' has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}"),
    "output params": ({"outputs": 1, "output_params": MAX_PARAMETERS + 1},
                      f"requested output 'o0' has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}"),
    "dims": ({"dims": MAX_DIMS + 1}, f"input 'i0' has {MAX_DIMS + 1} dimensions in its shape; at most {MAX_DIMS}"),
}


@pytest.mark.parametrize("case", list(OVER))
def test_check_counts_refuses_one_part_over_its_bound(case: str) -> None:
    kwargs, message = OVER[case]
    with pytest.raises(InferError) as err:
        check_counts(request(**kwargs))
    assert err.value.message == message and err.value.code.name == "INVALID_ARG"


def test_check_counts_takes_a_request_at_every_bound() -> None:
    check_counts(request(inputs=MAX_TENSORS, outputs=MAX_TENSORS, raw=MAX_TENSORS, params=MAX_PARAMETERS,
                         tensor_params=MAX_PARAMETERS, output_params=MAX_PARAMETERS, dims=MAX_DIMS))


def json_request(inputs: int = 1, outputs: int = 0, params: int = 0, tensor_params: int = 0,
                 output_params: int = 0, dims: int = 2) -> bytes:
    doc = {"inputs": [{"name": f"i{i}", "datatype": "FP32", "shape": [1] * dims, "data": [0.0],
                       "parameters": {f"k{k}": k for k in range(tensor_params if i == 0 else 0)}}
                      for i in range(inputs)],
           "parameters": {f"p{k}": "v" for k in range(params)}}
    if outputs:
        doc["outputs"] = [{"name": f"o{i}", "parameters": {f"k{k}": True for k in range(output_params if i == 0 else 0)}}
                          for i in range(outputs)]
    return json.dumps(doc).encode()


# the same bounds, counted in the JSON (no raw entries there; a requested output is "output 'o0'")
JSON_OVER = {**{case: OVER[case] for case in OVER if case not in ("raw", "output params")},
             "output params": (OVER["output params"][0],
                               f"output 'o0' has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}")}


@pytest.mark.parametrize("case", list(JSON_OVER))
def test_the_http_codec_counts_the_json_as_it_reads_it(case: str) -> None:
    kwargs, message = JSON_OVER[case]
    with pytest.raises(InferError) as err:
        http_codec.parse_infer_request(json_request(**kwargs), None, "m")
    assert err.value.message == message


def test_the_http_codec_takes_a_request_at_the_bounds() -> None:
    body = json_request(inputs=MAX_TENSORS, outputs=MAX_TENSORS, params=MAX_PARAMETERS,
                        tensor_params=MAX_PARAMETERS, output_params=MAX_PARAMETERS, dims=MAX_DIMS)
    parsed = http_codec.parse_infer_request(body, None, "m")
    assert len(parsed.inputs) == len(parsed.outputs) == MAX_TENSORS and len(parsed.parameters) == MAX_PARAMETERS
    check_counts(parsed)


def test_a_generate_request_of_too_many_keys_is_refused_before_they_are_read() -> None:
    md = pb.ModelMetadataResponse(name="m")
    md.inputs.add(name="text", datatype="BYTES", shape=[1])
    at = {"text": "hi", **{f"p{k}": k for k in range(MAX_PARAMETERS)}}
    assert len(generate_codec.parse_generate_request(json.dumps(at).encode(), "m", "", md).parameters) == MAX_PARAMETERS
    with pytest.raises(InferError) as err:
        generate_codec.parse_generate_request(json.dumps({**at, "one-more": 1}).encode(), "m", "", md)
    assert err.value.message == f"the generate request has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}"
    many = {"text": "hi", **{f"p{k}": k for k in range(MAX_PARAMETERS + 5)}}
    with pytest.raises(InferError) as err:
        generate_codec.parse_generate_request(json.dumps(many).encode(), "m", "", md)
    assert err.value.message.startswith(f"the generate request has {MAX_PARAMETERS + 6} keys")
    nested = {"text": "hi", "parameters": {f"p{k}": k for k in range(MAX_PARAMETERS + 1)}}
    with pytest.raises(InferError) as err:
        generate_codec.parse_generate_request(json.dumps(nested).encode(), "m", "", md)
    assert err.value.message == (f"the generate request's 'parameters' has {MAX_PARAMETERS + 1} keys; "
                                 f"at most {MAX_PARAMETERS}")


SCANNERS: dict[str, Callable[[bytes], object]] = {
    "merging._metadata": merging._metadata,
    "merging._layout": merging._layout,
    "cache.raw_key": lambda raw: cache.raw_key(raw, "1"),
}


@pytest.mark.parametrize("scanner", list(SCANNERS))
def test_the_byte_level_scanners_stop_after_scan_fields_max(scanner: str) -> None:
    scan = SCANNERS[scanner]
    usual = request(inputs=2, raw=2).SerializeToString()
    assert scan(usual) is not None  # (the usual request: read by its bytes)
    # a request of the usual layout with a model name sent again and again (protobuf keeps the
    # last): the scan stops at the bound (before, it walked all 2 million fields, ~4 s)
    names = b"\x0a\x01m" * (wire.SCAN_FIELDS_MAX - 6)  # (with the usual 5 fields: one under the bound)
    assert scan(names + usual) is not None
    assert scan(b"\x0a\x01m" * wire.SCAN_FIELDS_MAX + usual) is None
    assert scan(b"\x0a\x00" * 2_000_000 + usual) is None


# ---- which messages the body worker parses (infer_checks.heavy, http_codec.parse_grpc_infer_request)

def big_raw_request() -> bytes:
    """tritonclient's and perf_analyzer's large request: the tensors in raw_input_contents."""
    r = request(inputs=2, raw=0, params=3)
    r.raw_input_contents.extend([b"\1" * (2 << 20), b"\2" * (2 << 20)])
    return r.SerializeToString()


def test_a_large_request_of_raw_tensors_is_parsed_in_place() -> None:
    raw = big_raw_request()
    assert len(raw) > HEAVY_FROM and not heavy(raw)


@pytest.mark.parametrize("case", ["small fields", "typed contents", "a large parameter", "a varint field"])
def test_a_large_message_of_other_fields_goes_to_the_worker(case: str) -> None:
    r = pb.ModelInferRequest(model_name="m")
    if case == "small fields":
        raw = r.SerializeToString() + b"\x2a\x00" * (HEAVY_FROM // 2 + 1)
    elif case == "typed contents":
        r.inputs.add(name="x", datatype="BYTES", shape=[1]).contents.bytes_contents.extend([b"ab"] * 400_000)
        raw = r.SerializeToString()
    elif case == "a large parameter":
        r.parameters["p"].string_param = "x" * (HEAVY_BYTES + 1)
        r.raw_input_contents.append(b"\0" * HEAVY_FROM)
        raw = r.SerializeToString()
    else:  # (an unknown field of wire type 0: no field of a request is one)
        raw = b"\xf8\x01\x01" + big_raw_request()
    assert len(raw) > HEAVY_FROM and heavy(raw)


def test_the_workers_parse_sends_back_a_message_that_parses_at_memcpy_speed() -> None:
    r = pb.ModelInferRequest(model_name="m", id="the-id")
    r.parameters["keep"].int64_param = 7
    a = r.inputs.add(name="a", datatype="BYTES", shape=[3])
    a.contents.bytes_contents.extend([b"x", b"", b"yz"])
    b = r.inputs.add(name="b", datatype="FP32", shape=[2])
    b.contents.fp32_contents.extend([1.5, -2.0])
    c = r.inputs.add(name="c", datatype="INT32", shape=[2])
    c.parameters["shared_memory_region"].string_param = "region"
    # the same map key sent 1000 times, an unknown field, the name sent twice: one entry, none, one
    raw = (b"\x0a\x01z" + r.SerializeToString() + b"\x22\x00" * 1000 + b"\xf8\x01\x05")
    parsed = http_codec.parse_grpc_infer_request([raw[:100], raw[100:]])  # (the chunks it arrived in)
    assert parsed.model_name == "m" and parsed.id == "the-id" and dict(parsed.parameters)["keep"].int64_param == 7
    assert set(parsed.parameters) == {"keep", ""}
    assert not any(t.HasField("contents") for t in parsed.inputs)
    assert list(parsed.raw_input_contents) == [  # (no entry for the input in shared memory, as a gRPC client sends it)
        b"\1\0\0\0x" + b"\0\0\0\0" + b"\2\0\0\0yz", struct.pack("<2f", 1.5, -2.0)]
    assert b"\xf8\x01" not in parsed.SerializeToString()  # (the unknown field dropped)


@pytest.mark.parametrize("case", ["malformed", "counts", "mixed"])
def test_the_workers_parse_refuses_what_the_loop_would(case: str) -> None:
    r = request(inputs=1, raw=1)
    if case == "malformed":
        raw, want = b"\x0a\x05ab", "malformed ModelInferRequest"
    elif case == "counts":
        raw, want = request(outputs=MAX_TENSORS + 1).SerializeToString(), "requested outputs; at most"
    else:
        r.inputs[0].contents.fp32_contents.append(1.0)
        raw, want = r.SerializeToString(), "contents field must not be specified when using raw_input_contents"
    with pytest.raises(InferError) as err:
        http_codec.parse_grpc_infer_request(raw)
    assert want in err.value.message


# ---- the other requests with maps (check_message_counts, parse_grpc_message, the JSON bodies) -----

def test_check_message_counts_bounds_every_map_and_list_nested_too() -> None:
    load = pb.RepositoryModelLoadRequest(model_name="m")
    for i in range(MAX_PARAMETERS):
        load.parameters[f"file:1/f{i}"].bytes_param = b"x"
    check_message_counts(load)
    load.parameters["one-more"].bool_param = True
    with pytest.raises(InferError) as err:
        check_message_counts(load)
    assert err.value.message == f"the request has {MAX_PARAMETERS + 1} 'parameters' entries; at most {MAX_PARAMETERS}"
    trace = pb.TraceSettingRequest()
    trace.settings["trace_level"].value.extend(["TIMESTAMPS"] * (MAX_PARAMETERS + 1))  # (inside a map's value)
    with pytest.raises(InferError) as err:
        check_message_counts(trace)
    assert err.value.message == f"the request has {MAX_PARAMETERS + 1} 'value' entries; at most {MAX_PARAMETERS}"


def test_the_workers_parse_of_another_request_sends_back_one_entry_per_key() -> None:
    raw = pb.LogSettingsRequest(settings={"log_info": pb.LogSettingsRequest.SettingValue(bool_param=True)})
    body = raw.SerializeToString() * 5000 + b"\xf8\x01\x05"  # the same key 5000 times, an unknown field
    back = http_codec.parse_grpc_message([body[:7], body[7:]], "LogSettingsRequest")
    assert back == raw.SerializeToString()
    with pytest.raises(InferError) as err:
        http_codec.parse_grpc_message(b"\x0a\x05ab", "LogSettingsRequest")
    assert err.value.message.startswith("Exception deserializing request")
    for name in ("DESCRIPTOR", "no_such_type", "_sym_db"):
        with pytest.raises(InferError):
            http_codec.parse_grpc_message(b"", name)


def test_a_unary_methods_reader_parses_counts_or_leaves_to_the_worker() -> None:
    from meshserve.server import body_worker
    from meshserve.server.grpc_frontend import _reader, _Unread

    read = _reader(pb.RepositoryModelLoadRequest)
    small = pb.RepositoryModelLoadRequest(model_name="m")
    assert read(small.SerializeToString()) == small
    many = pb.RepositoryModelLoadRequest(model_name="m")
    for i in range(MAX_PARAMETERS + 1):
        many.parameters[f"k{i}"].bool_param = True
    raw = many.SerializeToString()
    assert COUNT_FROM < len(raw) <= body_worker.OFFLOAD_BYTES
    with pytest.raises(ValueError, match=f"at most {MAX_PARAMETERS}"):  # (the server's INVALID_ARGUMENT)
        read(raw)
    big = pb.RepositoryModelLoadRequest(model_name="m")
    big.parameters["file:1/model.onnx"].bytes_param = b"\0" * (body_worker.OFFLOAD_BYTES + 1)
    unread = read(big.SerializeToString())
    assert isinstance(unread, _Unread) and unread.type_name == "RepositoryModelLoadRequest"


@pytest.mark.parametrize("parse,body,message", [
    (lambda b: http_codec.parse_json_object(b, "log settings"), {f"k{i}": 1 for i in range(MAX_PARAMETERS + 1)},
     f"the log settings body has {MAX_PARAMETERS + 1} keys; at most {MAX_PARAMETERS}"),
    (http_codec.parse_trace_settings, {"trace_level": ["TIMESTAMPS"] * (MAX_PARAMETERS + 1)},
     f"trace setting 'trace_level' has {MAX_PARAMETERS + 1} values; at most {MAX_PARAMETERS}"),
    (http_codec.parse_load_request, {"parameters": {f"k{i}": 1 for i in range(MAX_PARAMETERS + 1)}},
     f"the load request has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}"),
    (http_codec.parse_unload_request, {"parameters": {f"k{i}": 1 for i in range(MAX_PARAMETERS + 1)}},
     f"the unload request has {MAX_PARAMETERS + 1} parameters; at most {MAX_PARAMETERS}"),
    (http_codec.parse_system_shm_register, {f"k{i}": 1 for i in range(MAX_PARAMETERS + 1)},
     f"the system shared memory register request body has {MAX_PARAMETERS + 1} keys; at most {MAX_PARAMETERS}"),
], ids=["log settings", "trace values", "load", "unload", "shm register"])
def test_the_http_control_bodies_are_counted(parse: Callable[[bytes], object], body: object, message: str) -> None:
    with pytest.raises(InferError) as err:
        parse(json.dumps(body).encode())
    assert err.value.message == message


def test_the_workers_parse_bounds_what_typed_contents_decode_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed zero is one byte and an INT64 eight once raw: the raw tensors the worker would
    make are bounded by http_codec.DECODED_MAX (--max-request-bytes) before any is made."""
    monkeypatch.setattr(http_codec, "DECODED_MAX", 8000)
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name="a", datatype="INT64", shape=[1000]).contents.int64_contents.extend([0] * 1000)
    assert len(http_codec.parse_grpc_infer_request(r.SerializeToString()).raw_input_contents[0]) == 8000
    r.inputs.add(name="b", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"")
    with pytest.raises(InferError) as err:
        http_codec.parse_grpc_infer_request(r.SerializeToString())
    assert err.value.message == "the request's typed contents hold 8004 bytes as tensors, more than 8000 (--max-request-bytes)"


def test_all_the_parameters_of_a_request_together_are_bounded() -> None:
    """MAX_PARAMETERS per map allows 1024 x 1024: 1,000 requested outputs of 1,000 parameters
    (11 MiB) held a gateway's loop 1.1 s a request. All of a request's parameters together, its
    tensors' included, are at most MAX_PARAMETERS_TOTAL (protobuf, JSON, and the other requests'
    maps and lists)."""
    r = request(inputs=1, raw=1)
    for i in range(5):
        o = r.outputs.add(name=f"o{i}")
        for k in range(1000):
            o.parameters[f"k{k}"].bool_param = True
    with pytest.raises(InferError) as err:
        check_counts(r)
    assert err.value.message == (f"the request has 5000 parameters in all (its tensors' included); "
                                 f"at most {MAX_PARAMETERS_TOTAL}")
    doc = {"inputs": [{"name": "i0", "datatype": "FP32", "shape": [1], "data": [0.0]}],
           "outputs": [{"name": f"o{i}", "parameters": {f"k{k}": True for k in range(1000)}} for i in range(5)]}
    with pytest.raises(InferError) as err:
        http_codec.parse_infer_request(json.dumps(doc).encode(), None, "m")
    assert err.value.message == (f"the request has 5000 parameters in its requested outputs; at most "
                                 f"{MAX_PARAMETERS_TOTAL}")
    trace = pb.TraceSettingRequest()
    for i in range(5):
        trace.settings[f"s{i}"].value.extend(["x"] * 1000)
    with pytest.raises(InferError) as err:
        check_message_counts(trace)
    assert err.value.message == f"the request has more than {MAX_PARAMETERS_TOTAL} entries in its maps and lists together"


def test_bytes_elements_are_bounded_by_the_declared_shape() -> None:
    """check_bytes_elements (the services' validation sums every BYTES input's shape; the HTTP
    codec checks each JSON input before decoding its strings)."""
    check_bytes_elements(MAX_BYTES_ELEMENTS, "input 'X'")
    with pytest.raises(InferError) as err:
        check_bytes_elements(MAX_BYTES_ELEMENTS + 1, "input 'X'")
    assert err.value.message == (f"input 'X': the request's BYTES inputs hold {MAX_BYTES_ELEMENTS + 1} elements, "
                                 f"more than {MAX_BYTES_ELEMENTS}")
    body = json.dumps({"inputs": [{"name": "X", "datatype": "BYTES", "shape": [1, MAX_BYTES_ELEMENTS + 1],
                                   "data": ["a"]}]}).encode()
    with pytest.raises(InferError, match="BYTES inputs hold"):  # before the one string is decoded
        http_codec.parse_infer_request(body, None, "m")
    # the request's BYTES inputs together, as a service counts them: two halves and one more
    half = MAX_BYTES_ELEMENTS // 2
    two = {"inputs": [{"name": n, "datatype": "BYTES", "shape": [1, half + i], "data": ["a"] * (half + i)}
                      for i, n in enumerate(("X", "Y"))]}
    with pytest.raises(InferError) as err:
        http_codec.parse_infer_request(json.dumps(two).encode(), None, "m")
    assert err.value.message.startswith(f"input 'Y': the request's BYTES inputs hold {MAX_BYTES_ELEMENTS + 1} ")
    two["inputs"][1]["shape"] = [1, half]
    two["inputs"][1]["data"] = ["a"] * half
    assert len(http_codec.parse_infer_request(json.dumps(two).encode(), None, "m").raw_input_contents) == 2
    md = pb.ModelMetadataResponse(name="m")
    for n in ("X", "Y"):
        md.inputs.add(name=n, datatype="BYTES", shape=[-1])
    generate = {"X": ["a"] * half, "Y": ["a"] * (half + 1)}
    with pytest.raises(InferError) as err:
        generate_codec.parse_generate_request(json.dumps(generate).encode(), "m", "", md)
    assert err.value.message.startswith(f"input 'Y': the request's BYTES inputs hold {MAX_BYTES_ELEMENTS + 1} ")
