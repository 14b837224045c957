"""http_codec JSON renderers for the non-infer endpoints, load/unload bodies, compression."""
from __future__ import annotations

import base64
import gzip
import json
import zlib

import pytest
from google.protobuf import json_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.http_codec import (
    DECODE_SLICE,
    BodyDecoder,
    decode_body,
    encode_body,
    error_body,
    model_config_to_json,
    model_metadata_to_json,
    parse_cuda_shm_register,
    parse_load_request,
    parse_system_shm_register,
    parse_unload_request,
    repository_index_to_json,
    server_metadata_to_json,
    statistics_to_json,
)


def invalid(fn, *args, match: str = "", **kwargs) -> None:
    with pytest.raises(InferError) as info:
        fn(*args, **kwargs)
    assert info.value.code == Code.INVALID_ARG
    assert match in info.value.message, info.value.message


def all_values(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from all_values(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from all_values(v)
    else:
        yield obj


# --- model config -----------------------------------------------------------------------

def dynamic_config() -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="simple", platform="onnxruntime_onnx", max_batch_size=8)
    cfg.input.add(name="INPUT0", data_type=mc.TYPE_INT32, dims=[16], reshape=mc.ModelTensorReshape(shape=[4, 4]))
    cfg.output.add(name="OUTPUT0", data_type=mc.TYPE_STRING, dims=[-1])
    cfg.instance_group.add(count=2, kind=mc.ModelInstanceGroup.KIND_CPU)
    cfg.dynamic_batching.preferred_batch_size.extend([4, 8])
    cfg.dynamic_batching.max_queue_delay_microseconds = 100
    cfg.dynamic_batching.priority_queue_policy[1].default_timeout_microseconds = 2**40
    cfg.version_policy.specific.versions.extend([1, 3])
    return cfg


def test_config_int64_as_numbers_enum_names_and_defaults() -> None:
    doc = model_config_to_json(dynamic_config())
    assert doc["input"][0]["dims"] == [16]
    assert doc["input"][0]["reshape"] == {"shape": [4, 4]}
    assert doc["input"][0]["data_type"] == "TYPE_INT32"
    assert doc["output"][0]["data_type"] == "TYPE_STRING" and doc["output"][0]["dims"] == [-1]
    assert doc["instance_group"][0]["kind"] == "KIND_CPU"
    db = doc["dynamic_batching"]
    assert db["max_queue_delay_microseconds"] == 100 and db["preferred_batch_size"] == [4, 8]
    assert db["priority_levels"] == 0  # int64 default rendered, as a number
    assert db["priority_queue_policy"]["1"]["default_timeout_microseconds"] == 2**40
    assert doc["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert doc["max_batch_size"] == 8 and doc["platform"] == "onnxruntime_onnx"
    assert doc["backend"] == "" and doc["batch_input"] == [] and doc["parameters"] == {}
    # only the set scheduling member; unset messages absent
    for key in ("sequence_batching", "ensemble_scheduling", "model_transaction_policy", "response_cache"):
        assert key not in doc
    assert not any(isinstance(v, str) and v.lstrip("-").isdigit() for v in all_values(doc))
    # still a valid ModelConfig JSON
    assert json_format.ParseDict(doc, mc.ModelConfig()) == dynamic_config()


def test_config_sequence_and_optional_sections() -> None:
    cfg = mc.ModelConfig(name="seq", backend="python", max_batch_size=0)
    sb = cfg.sequence_batching
    sb.max_sequence_idle_microseconds = 5_000_000
    sb.direct.max_queue_delay_microseconds = 0
    ctl = sb.control_input.add(name="START")
    ctl.control.add(kind=mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START, fp32_false_true=[0, 1])
    state = sb.state.add(input_name="IN_STATE", output_name="OUT_STATE", data_type=mc.TYPE_FP32, dims=[1])
    state.initial_state.add(data_type=mc.TYPE_FP32, dims=[1], zero_data=True, name="init")
    cfg.model_transaction_policy.decoupled = False
    cfg.response_cache.enable = False
    doc = model_config_to_json(cfg)
    assert "dynamic_batching" not in doc and "ensemble_scheduling" not in doc
    s = doc["sequence_batching"]
    assert s["max_sequence_idle_microseconds"] == 5_000_000
    assert s["direct"]["max_queue_delay_microseconds"] == 0 and "oldest" not in s
    assert s["control_input"][0]["control"][0]["kind"] == "CONTROL_SEQUENCE_START"
    assert s["control_input"][0]["control"][0]["fp32_false_true"] == [0.0, 1.0]
    assert s["state"][0]["dims"] == [1]
    assert s["state"][0]["initial_state"][0]["dims"] == [1]
    assert s["state"][0]["initial_state"][0]["zero_data"] is True
    assert doc["model_transaction_policy"] == {"decoupled": False}
    assert doc["response_cache"] == {"enable": False}
    json.dumps(doc)


def test_config_ensemble_steps() -> None:
    cfg = mc.ModelConfig(name="ens", platform="ensemble")
    step = cfg.ensemble_scheduling.step.add(model_name="a", model_version=-1)
    step.input_map["IN"] = "x"
    doc = model_config_to_json(cfg)
    assert doc["ensemble_scheduling"]["step"][0]["model_version"] == -1
    assert doc["ensemble_scheduling"]["step"][0]["input_map"] == {"IN": "x"}
    assert "dynamic_batching" not in doc and "sequence_batching" not in doc


# --- metadata, stats, index -------------------------------------------------------------

def test_model_and_server_metadata() -> None:
    md = pb.ModelMetadataResponse(name="simple", versions=["1", "2"], platform="onnxruntime_onnx")
    md.inputs.add(name="INPUT0", datatype="INT32", shape=[-1, 16])
    md.outputs.add(name="OUTPUT0", datatype="BYTES", shape=[-1])
    assert model_metadata_to_json(md) == {
        "name": "simple", "versions": ["1", "2"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "BYTES", "shape": [-1]}],
    }
    sm = pb.ServerMetadataResponse(name="meshserve", version="0.1.0", extensions=["statistics", "sequence"])
    assert server_metadata_to_json(sm) == {"name": "meshserve", "version": "0.1.0",
                                           "extensions": ["statistics", "sequence"]}


def test_statistics_every_member_present_as_integers() -> None:
    stats = pb.ModelStatisticsResponse()
    s = stats.model_stats.add(name="simple", version="1", inference_count=10, execution_count=4)
    s.inference_stats.queue.count = 10
    s.inference_stats.queue.ns = 2**60
    b = s.batch_stats.add(batch_size=4)
    b.compute_infer.count = 1
    s.memory_usage.add(type="CPU", id=0, byte_size=1024)
    s.response_stats["0"].success.count = 3
    stats.model_stats.add(name="empty", version="2")
    doc = json.loads(json.dumps(statistics_to_json(stats)))
    first, empty = doc["model_stats"]
    members = {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
               "cache_hit", "cache_miss"}
    for entry in (first, empty):
        assert set(entry["inference_stats"]) == members
        for d in entry["inference_stats"].values():
            assert set(d) == {"count", "ns"} and all(type(v) is int for v in d.values())
        assert isinstance(entry["version"], str) and int(entry["version"])
        for key in ("last_inference", "inference_count", "execution_count"):
            assert type(entry[key]) is int
    assert first["inference_stats"]["queue"] == {"count": 10, "ns": 2**60}
    assert first["batch_stats"] == [{"batch_size": 4, "compute_input": {"count": 0, "ns": 0},
                                     "compute_infer": {"count": 1, "ns": 0},
                                     "compute_output": {"count": 0, "ns": 0}}]
    assert first["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": 1024}]
    assert first["response_stats"]["0"]["success"] == {"count": 3, "ns": 0}
    assert empty["batch_stats"] == [] and empty["memory_usage"] == [] and empty["response_stats"] == {}
    assert statistics_to_json(pb.ModelStatisticsResponse()) == {"model_stats": []}


def test_repository_index() -> None:
    idx = pb.RepositoryIndexResponse()
    idx.models.add(name="a", version="1", state="READY")
    idx.models.add(name="b", version="2", state="UNAVAILABLE", reason="unloaded")
    idx.models.add(name="c")
    assert repository_index_to_json(idx) == [
        {"name": "a", "version": "1", "state": "READY"},
        {"name": "b", "version": "2", "state": "UNAVAILABLE", "reason": "unloaded"},
        {"name": "c", "state": ""},
    ]


def test_error_body() -> None:
    assert json.loads(error_body('bad "x"\n')) == {"error": 'bad "x"\n'}


# --- load / unload ----------------------------------------------------------------------

def test_load_request() -> None:
    assert parse_load_request(b"") == {}
    assert parse_load_request(b"  \n") == {}
    assert parse_load_request(b"{}") == {}
    config = json.dumps({"name": "m", "backend": "onnxruntime"})
    body = json.dumps({"parameters": {
        "config": config,
        "file:1/model.onnx": base64.b64encode(b"\x00\x01onnx").decode(),
        "poll": True, "n": 3, "s": "x",
    }}).encode()
    params = parse_load_request(body)
    assert params["config"].string_param == config
    assert params["file:1/model.onnx"].bytes_param == b"\x00\x01onnx"
    assert params["poll"].bool_param is True and params["n"].int64_param == 3 and params["s"].string_param == "x"
    assert all(isinstance(p, pb.ModelRepositoryParameter) for p in params.values())


def test_load_request_errors() -> None:
    invalid(parse_load_request, b"{", match="failed to parse the load request JSON")
    invalid(parse_load_request, b"[]", match="must be an object")
    invalid(parse_load_request, b'{"parameters": 3}', match="'parameters' must be a JSON object")
    invalid(parse_load_request, b'{"parameters": {"config": {"name": "m"}}}',
            match="load parameter 'config' must be a string")
    invalid(parse_load_request, b'{"parameters": {"file:1/m.onnx": "***"}}',
            match="load parameter 'file:1/m.onnx' is not valid base64")
    invalid(parse_load_request, b'{"parameters": {"x": 1.5}}', match="load parameter 'x': unsupported")


def test_unload_request() -> None:
    assert parse_unload_request(b"") == {}
    params = parse_unload_request(json.dumps({"parameters": {"unload_dependents": False}}).encode())
    assert params["unload_dependents"].WhichOneof("parameter_choice") == "bool_param"
    assert params["unload_dependents"].bool_param is False
    invalid(parse_unload_request, b'{"parameters": {"unload_dependents": "yes"}}',
            match="unload parameter 'unload_dependents' must be a boolean")


# --- compression ------------------------------------------------------------------------

PAYLOAD = b'{"inputs": []}' * 100


@pytest.mark.parametrize(("coding", "compress"), [
    ("gzip", gzip.compress),
    ("GZIP", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients send it
    ("identity", lambda b: b),
    (None, lambda b: b),
    ("", lambda b: b),
    ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b))),
])
def test_decode_body(coding, compress) -> None:
    assert decode_body(compress(PAYLOAD), coding) == PAYLOAD


def test_decode_body_multi_member_gzip() -> None:
    assert decode_body(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip") == b"abcd"


def rejected(code: Code, fn, *args, match: str = "", **kwargs) -> None:
    with pytest.raises(InferError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code, info.value
    assert match in info.value.message, info.value.message


def test_decode_body_errors() -> None:
    # an unsupported coding is 415 and an oversized output 413 (issue 17), not 400
    rejected(Code.UNSUPPORTED_MEDIA_TYPE, decode_body, PAYLOAD, "br", match="unsupported Content-Encoding 'br'")
    assert InferError.unsupported_media("x").http_status == 415
    invalid(decode_body, gzip.compress(PAYLOAD)[:-10], "gzip", match="truncated gzip")
    invalid(decode_body, b"not gzip at all", "gzip", match="malformed gzip")
    invalid(decode_body, zlib.compress(PAYLOAD) + b"xx", "deflate", match="stray bytes")
    invalid(decode_body, b"", "gzip", match="truncated gzip")
    rejected(Code.TOO_LARGE, decode_body, gzip.compress(b"\0" * 10_000_000), "gzip", max_size=1000,
             match="exceeds 1000 bytes")
    assert InferError.too_large("x").http_status == 413
    assert decode_body(gzip.compress(PAYLOAD), "gzip", max_size=len(PAYLOAD)) == PAYLOAD


def feed_in_pieces(decoder: BodyDecoder, data: bytes, piece: int) -> tuple[bytes, int]:
    out, largest = [], 0
    for i in range(0, len(data), piece):
        for chunk in decoder.feed(data[i:i + piece]):
            largest = max(largest, len(chunk))
            out.append(chunk)
    decoder.finish()
    return b"".join(out), largest


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 30])
@pytest.mark.parametrize(("coding", "compress"), [
    ("gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),
    ("gzip", lambda b: gzip.compress(b[:100]) + gzip.compress(b[100:])),
    ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b))),
])
def test_body_decoder_streams_any_split(piece, coding, compress) -> None:
    data = bytes(range(256)) * 40 + PAYLOAD
    assert feed_in_pieces(BodyDecoder(coding, len(data)), compress(data), piece)[0] == data


def test_body_decoder_bounds_each_step_and_the_total() -> None:
    # 50 MB of zeros is ~50 kB of gzip: one network chunk must not inflate into 50 MB at once
    bomb = gzip.compress(bytes(50_000_000), 1)
    out, largest = feed_in_pieces(BodyDecoder("gzip", 50_000_000), bomb, 1 << 16)
    assert len(out) == 50_000_000 and largest <= DECODE_SLICE
    decoder = BodyDecoder("gzip", 3_000_000)
    with pytest.raises(InferError) as info:
        feed_in_pieces(decoder, bomb, 1 << 16)
    assert info.value.code == Code.TOO_LARGE and "3000000" in info.value.message
    # a chain is bounded at every stage
    with pytest.raises(InferError) as info:
        feed_in_pieces(BodyDecoder("gzip, gzip", 3_000_000), gzip.compress(bomb), 1 << 16)
    assert info.value.code == Code.TOO_LARGE


def test_body_decoder_identity_and_unsupported() -> None:
    assert BodyDecoder(None, 10).identity and BodyDecoder("identity", 10).identity
    assert not BodyDecoder("gzip", 10).identity
    for coding in ("br", "zstd", "compress", "gzip, br"):
        rejected(Code.UNSUPPORTED_MEDIA_TYPE, BodyDecoder, coding, 10, match="unsupported Content-Encoding")


@pytest.mark.parametrize(("accept", "coding"), [
    (None, None), ("", None), ("identity", None), ("br", None),
    ("gzip", "gzip"), ("deflate", "deflate"), ("gzip, deflate", "gzip"),
    ("deflate;q=1.0, gzip;q=0.5", "deflate"), ("gzip;q=0, deflate", "deflate"),
    ("*", "gzip"), ("*;q=0", None), ("GZip", "gzip"), ("gzip;q=bogus", None),
])
def test_encode_body(accept, coding) -> None:
    body, used = encode_body(PAYLOAD, accept)
    assert used == coding
    if coding == "gzip":
        assert gzip.decompress(body) == PAYLOAD
        assert body == encode_body(PAYLOAD, accept)[0]  # deterministic (mtime 0)
    elif coding == "deflate":
        assert zlib.decompress(body) == PAYLOAD
    else:
        assert body is PAYLOAD


def test_shared_memory_register_bodies() -> None:
    """What tritonclient's register_{system,cuda}_shared_memory send, and the mistakes."""
    assert parse_system_shm_register(json.dumps({"key": "/k", "offset": 8, "byte_size": 64}).encode()) == ("/k", 8, 64)
    assert parse_system_shm_register(b'{"key": "/k", "byte_size": 64}') == ("/k", 0, 64)
    invalid(parse_system_shm_register, b'{"byte_size": 64}', match="'key' is missing")
    invalid(parse_system_shm_register, b'{"key": 5, "byte_size": 64}', match="'key' must be a string")
    invalid(parse_system_shm_register, b'{"key": "/k"}', match="'byte_size' must be a non-negative integer, got null")
    invalid(parse_system_shm_register, b'{"key": "/k", "byte_size": -1}', match="'byte_size'")
    invalid(parse_system_shm_register, b'{"key": "/k", "byte_size": true}', match="'byte_size'")
    invalid(parse_system_shm_register, b'[]', match="register request body must be a JSON object, got array")
    invalid(parse_system_shm_register, b'{"key"', match="failed to parse the system shared memory register request JSON")
    handle = base64.b64encode(bytes(range(64))).decode()
    body = json.dumps({"raw_handle": {"b64": handle}, "device_id": 1, "byte_size": 32}).encode()
    assert parse_cuda_shm_register(body) == (bytes(range(64)), 1, 32)
    invalid(parse_cuda_shm_register, b'{"raw_handle": "x", "byte_size": 1}', match="'raw_handle' must be an object")
    invalid(parse_cuda_shm_register, b'{"raw_handle": {"b64": "%%"}, "byte_size": 1}', match="not valid base64")
