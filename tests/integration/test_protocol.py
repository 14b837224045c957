"""The v2 protocol end to end: real tritonclient (HTTP + gRPC, sync + asyncio) against real
processes — through the gateway, and straight at the ONNX service (itself a v2 server)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpaio
from google.protobuf.json_format import MessageToJson
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from meshserve.protocol.infer_checks import MAX_DIMS, MAX_PARAMETERS, MAX_TENSORS
from tests.models.generate import DATATYPES, MAX_BATCH

PROTOCOLS = ["http", "grpc"]


def client(proto: str, url: str, concurrency: int = 1):
    if proto == "http":
        return httpclient.InferenceServerClient(url, concurrency=concurrency)
    return grpcclient.InferenceServerClient(url)


def mod(proto: str):
    return httpclient if proto == "http" else grpcclient


@pytest.fixture(params=["gateway", "service"])
def target(request: pytest.FixtureRequest, stack) -> dict[str, str]:
    proc = stack.gateway if request.param == "gateway" else stack.service
    return {"http": proc.http, "grpc": proc.grpc, "name": request.param}


def sample(dt: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if dt == "BYTES":
        return np.array([f"s{i}-é".encode() for i in range(int(np.prod(shape)))], dtype=np.object_).reshape(shape)
    if dt == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.startswith("FP"):
        return rng.standard_normal(shape).astype({"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[dt])
    info = np.iinfo(np.dtype(dt.lower().replace("uint", "uint").replace("int", "int")))
    return rng.integers(info.min, info.max, size=shape, dtype=np.dtype(dt.lower()), endpoint=True)


def infer_one(proto: str, url: str, model: str, arrays: dict[str, np.ndarray], outputs: list[str] | None = None,
              binary: bool = True, version: str = "") -> dict[str, np.ndarray]:
    m = mod(proto)
    inputs = []
    for name, arr in arrays.items():
        inp = m.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        if proto == "http":
            inp.set_data_from_numpy(arr, binary_data=binary)
        else:
            inp.set_data_from_numpy(arr)
        inputs.append(inp)
    req_outputs = None
    if outputs is not None:
        req_outputs = [m.InferRequestedOutput(o, binary_data=binary) if proto == "http" else m.InferRequestedOutput(o)
                       for o in outputs]
    with client(proto, url) as c:
        res = c.infer(model, inputs, outputs=req_outputs, model_version=version)
        names = outputs or [o["name"] for o in (res.get_response()["outputs"] if proto == "http"
                                                else [{"name": o.name} for o in res.get_response().outputs])]
        return {n: res.as_numpy(n) for n in names}


# ---- health / metadata / config ------------------------------------------------------------

@pytest.mark.parametrize("proto", PROTOCOLS)
def test_health_and_metadata(proto: str, target: dict[str, str]) -> None:
    with client(proto, target[proto]) as c:
        assert c.is_server_live()
        assert c.is_server_ready()
        assert c.is_model_ready("add_sub")
        assert not c.is_model_ready("no_such_model")
        assert not c.is_model_ready("add_sub", "7")
        md = c.get_server_metadata()
        exts = md["extensions"] if proto == "http" else list(md.extensions)
        assert "binary_tensor_data" in exts and "statistics" in exts
        mm = c.get_model_metadata("add_sub")
        if proto == "grpc":
            mm = json.loads(MessageToJson(mm, preserving_proto_field_name=True))
        assert mm["name"] == "add_sub"
        assert [i["name"] for i in mm["inputs"]] == ["INPUT0", "INPUT1"]
        assert [int(d) for d in mm["inputs"][0]["shape"]] == [-1, 16]  # perf_analyzer drops the -1
        cfg = c.get_model_config("add_sub")
        cfg = cfg if proto == "http" else json.loads(MessageToJson(cfg.config, preserving_proto_field_name=True))
        assert int(cfg["max_batch_size"]) == MAX_BATCH
        assert "dynamic_batching" in cfg and "sequence_batching" not in cfg


def test_autocompleted_config(stack) -> None:
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        cfg = c.get_model_config("autocomplete")
    assert cfg["max_batch_size"] == 4
    assert [i["name"] for i in cfg["input"]] == ["INPUT0", "INPUT1"]
    assert cfg["input"][0]["data_type"] == "TYPE_INT32" and cfg["input"][0]["dims"] == [16]


# ---- inference -------------------------------------------------------------------------------

@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("dt", list(DATATYPES))
def test_every_datatype_round_trips(proto: str, dt: str, target: dict[str, str]) -> None:
    arr = sample(dt, (2, 5), np.random.default_rng(1))
    out = infer_one(proto, target[proto], f"identity_{dt.lower()}", {"INPUT0": arr})["OUTPUT0"]
    assert out.shape == arr.shape
    if dt == "BYTES":
        assert out.tolist() == arr.tolist()
    else:
        assert out.dtype == arr.dtype
        np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dt", ["INT32", "FP32", "BOOL", "BYTES", "FP64", "UINT64"])
def test_json_tensors_round_trip(dt: str, stack) -> None:
    arr = sample(dt, (1, 3), np.random.default_rng(2))
    if dt.startswith("FP"):
        arr = np.round(arr, 3)
    out = infer_one("http", stack.gateway.http, f"identity_{dt.lower()}", {"INPUT0": arr}, ["OUTPUT0"],
                    binary=False)["OUTPUT0"]
    if dt == "BYTES":  # JSON carries text: tritonclient returns str elements (as with Triton)
        assert out.tolist() == [[v.decode() for v in row] for row in arr.tolist()]
    else:
        np.testing.assert_allclose(out.astype(np.float64), arr.astype(np.float64))


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("batch", list(range(1, MAX_BATCH + 1)))
def test_add_sub_every_batch_size(proto: str, batch: int, stack) -> None:
    rng = np.random.default_rng(batch)
    a = rng.standard_normal((batch, 16)).astype(np.float32)
    b = rng.standard_normal((batch, 16)).astype(np.float32)
    out = infer_one(proto, getattr(stack.gateway, proto), "add_sub", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_allclose(out["OUTPUT0"], a + b, rtol=1e-6)
    np.testing.assert_allclose(out["OUTPUT1"], a - b, rtol=1e-6)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_requested_output_subset(proto: str, stack) -> None:
    a = np.ones((1, 16), np.float32)
    b = np.full((1, 16), 3, np.float32)
    m = mod(proto)
    inputs = [m.InferInput("INPUT0", [1, 16], "FP32"), m.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    with client(proto, getattr(stack.gateway, proto)) as c:
        res = c.infer("add_sub", inputs, outputs=[m.InferRequestedOutput("OUTPUT1")])
        np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
        assert res.as_numpy("OUTPUT0") is None


def test_mixed_binary_and_json_outputs(stack) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=False)
    inputs[1].set_data_from_numpy(a, binary_data=True)
    outs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    with httpclient.InferenceServerClient(stack.gateway.http) as c:
        res = c.infer("add_sub", inputs, outputs=outs)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a * 2)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a * 0)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_versions(proto: str, stack) -> None:
    x = np.ones((1, 4), np.float32)
    url = getattr(stack.gateway, proto)
    assert infer_one(proto, url, "scale", {"INPUT0": x}, version="1")["OUTPUT0"].tolist() == [[1.0] * 4]
    assert infer_one(proto, url, "scale", {"INPUT0": x}, version="2")["OUTPUT0"].tolist() == [[2.0] * 4]
    assert infer_one(proto, url, "scale", {"INPUT0": x})["OUTPUT0"].tolist() == [[2.0] * 4]  # highest


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_non_batching_model(proto: str, stack) -> None:
    a = np.arange(4, dtype=np.float32)
    out = infer_one(proto, getattr(stack.gateway, proto), "fixed_add", {"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(out["OUTPUT0"], a * 2)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_64_concurrent_requests_each_get_their_own_answer(proto: str, stack) -> None:
    url = getattr(stack.gateway, proto)

    def one(i: int) -> bool:
        a = np.full((1, 16), i, np.float32)
        b = np.arange(16, dtype=np.float32).reshape(1, 16)
        out = infer_one(proto, url, "add_sub", {"INPUT0": a, "INPUT1": b})
        return bool(np.array_equal(out["OUTPUT0"], a + b) and np.array_equal(out["OUTPUT1"], a - b))

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(results)


async def test_asyncio_clients(stack) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.ones((1, 16), np.float32)

    async def via(module, c, i: int) -> np.ndarray:  # module: tritonclient.{http,grpc}.aio; c: its client
        inputs = [module.InferInput("INPUT0", [1, 16], "FP32"), module.InferInput("INPUT1", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(a + i)
        inputs[1].set_data_from_numpy(b)
        res = await c.infer("add_sub", inputs)
        return res.as_numpy("OUTPUT0")

    hc = httpaio.InferenceServerClient(stack.gateway.http)
    gc = grpcaio.InferenceServerClient(stack.gateway.grpc)
    try:
        assert await hc.is_server_ready() and await gc.is_server_ready()
        outs = await asyncio.gather(*(via(httpaio, hc, i) for i in range(16)), *(via(grpcaio, gc, i) for i in range(16)))
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, a + (i % 16) + b)
    finally:
        await hc.close()
        await gc.close()


# ---- errors ----------------------------------------------------------------------------------

def _expect_error(proto: str, url: str, model: str, inputs: list, status_http: str, status_grpc: str,
                  fragment: str, outputs: list | None = None) -> None:
    with client(proto, url) as c, pytest.raises(InferenceServerException) as err:
        c.infer(model, inputs, outputs=outputs)
    want = status_http if proto == "http" else status_grpc
    assert err.value.status() == want, err.value
    assert fragment in err.value.message(), err.value.message()


def _fp32_inputs(m, shapes: dict[str, tuple[int, ...]], dt: str = "FP32") -> list:
    out = []
    for name, shape in shapes.items():
        inp = m.InferInput(name, list(shape), dt)
        inp.set_data_from_numpy(np.zeros(shape, dtype=np.float32 if dt == "FP32" else np.int32))
        out.append(inp)
    return out


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_error_statuses(proto: str, target: dict[str, str]) -> None:
    m, url = mod(proto), target[proto]
    ok = {"INPUT0": (1, 16), "INPUT1": (1, 16)}
    _expect_error(proto, url, "nope", _fp32_inputs(m, ok), "404", "StatusCode.NOT_FOUND", "'nope'")
    # wrong shape, wrong dtype, missing input, extra input, batch too large, unknown output
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, {"INPUT0": (1, 16), "INPUT1": (1, 8)}),
                  "400", "StatusCode.INVALID_ARGUMENT", "INPUT1")
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, ok, "INT32"), "400", "StatusCode.INVALID_ARGUMENT",
                  "expects 'FP32'")
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, {"INPUT0": (1, 16)}), "400",
                  "StatusCode.INVALID_ARGUMENT", "INPUT1")
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, {**ok, "BOGUS": (1, 16)}), "400",
                  "StatusCode.INVALID_ARGUMENT", "BOGUS")
    big = {"INPUT0": (MAX_BATCH + 1, 16), "INPUT1": (MAX_BATCH + 1, 16)}
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, big), "400", "StatusCode.INVALID_ARGUMENT",
                  f"<= {MAX_BATCH}")
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, ok), "400", "StatusCode.INVALID_ARGUMENT", "NOPE",
                  outputs=[m.InferRequestedOutput("NOPE")])


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_a_request_past_its_bounds_on_parts_is_refused(proto: str, target: dict[str, str]) -> None:
    """meshserve/protocol/infer_checks.py: at most MAX_TENSORS requested outputs (inputs,
    raw entries) and MAX_PARAMETERS parameters per request and per tensor; a request at the
    bounds is answered as before (its parts checked against the model as always)."""
    m, url = mod(proto), target[proto]
    ok = {"INPUT0": (1, 16), "INPUT1": (1, 16)}
    many = [m.InferRequestedOutput(f"OUT{i}") for i in range(MAX_TENSORS + 1)]
    _expect_error(proto, url, "add_sub", _fp32_inputs(m, ok), "400", "StatusCode.INVALID_ARGUMENT",
                  f"the request has {MAX_TENSORS + 1} requested outputs; at most {MAX_TENSORS}", outputs=many)
    with client(proto, url) as c:
        with pytest.raises(InferenceServerException) as err:
            c.infer("add_sub", _fp32_inputs(m, ok), parameters={f"p{i}": i for i in range(MAX_PARAMETERS + 1)})
        assert err.value.status() == ("400" if proto == "http" else "StatusCode.INVALID_ARGUMENT")
        # (tritonclient's HTTP client adds binary_data_output: one more than the caller's)
        assert re.fullmatch(rf"the request has 102[56] parameters; at most {MAX_PARAMETERS}", err.value.message())
        inputs = _fp32_inputs(m, ok)
        result = c.infer("add_sub", inputs, parameters={f"p{i}": i for i in range(MAX_PARAMETERS - 1)})
        assert result.as_numpy("OUTPUT0").shape == (1, 16)
    if proto == "http":  # (numpy, and so tritonclient, makes no array of more than 64 dimensions)
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1] * (MAX_DIMS + 1),
                                       "data": [0.0]}]}).encode()
        req = urllib.request.Request(f"http://{url}/v2/models/add_sub/infer", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=30)
        assert http_err.value.code == 400
        assert json.loads(http_err.value.read())["error"] == \
            f"input 'INPUT0' has {MAX_DIMS + 1} dimensions in its shape; at most {MAX_DIMS}"


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_control_requests_past_their_bounds_are_refused(proto: str, target: dict[str, str]) -> None:
    """A log settings update of MAX_PARAMETERS + 1 settings (a small message: counted where it is
    read) and a model load of MAX_PARAMETERS + 1 files of 100 bytes (over 64 KiB: read by the
    body worker) are refused, by tritonclient's own calls."""
    want = "400" if proto == "http" else "StatusCode.INVALID_ARGUMENT"
    with client(proto, target[proto]) as c:
        with pytest.raises(InferenceServerException) as err:
            c.update_log_settings({f"k{i}": True for i in range(MAX_PARAMETERS + 1)})
        assert err.value.status() == want and f"{MAX_PARAMETERS + 1} " in err.value.message(), err.value
        assert f"at most {MAX_PARAMETERS}" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            c.load_model("add_sub", files={f"file:1/f{i}": b"x" * 100 for i in range(MAX_PARAMETERS + 1)})
        assert err.value.status() == want and f"at most {MAX_PARAMETERS}" in err.value.message(), err.value
        assert c.is_model_ready("add_sub")


def test_a_streamed_request_past_its_bounds_is_answered_in_band(target: dict[str, str]) -> None:
    m = grpcclient
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(target["grpc"]) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            ok = {"INPUT0": (1, 16), "INPUT1": (1, 16)}
            c.async_stream_infer("add_sub", _fp32_inputs(m, ok), request_id="many",
                                 outputs=[m.InferRequestedOutput(f"OUT{i}") for i in range(MAX_TENSORS + 1)])
            c.async_stream_infer("add_sub", _fp32_inputs(m, ok), request_id="fine")
            got = [answers.get(timeout=30) for _ in range(2)]
        finally:
            c.stop_stream()
    errors = [e for _, e in got if e is not None]
    results = [r for r, _ in got if r is not None]
    assert len(errors) == 1 and f"at most {MAX_TENSORS}" in errors[0].message(), got
    assert len(results) == 1 and results[0].get_response().id == "fine"


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_unknown_version(proto: str, target: dict[str, str]) -> None:
    m = mod(proto)
    inputs = _fp32_inputs(m, {"INPUT0": (1, 4)})
    with client(proto, target[proto]) as c, pytest.raises(InferenceServerException) as err:
        c.infer("scale", inputs, model_version="7")
    assert err.value.status() == ("404" if proto == "http" else "StatusCode.NOT_FOUND")
    assert "version 7" in err.value.message()


def test_stream_answers_each_request_and_a_malformed_message_ends_the_stream_with_an_error(
        target: dict[str, str]) -> None:
    """ModelStreamInfer over a plain grpc channel: good requests answered in band; a message
    that is not a ModelInferRequest ends the call with INTERNAL, as a unary call's does."""
    import grpc

    from meshserve._proto import grpc_service_pb2 as pb

    good = pb.ModelInferRequest(model_name="add_sub", id="ok-1")
    for name in ("INPUT0", "INPUT1"):
        good.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        good.raw_input_contents.append(np.arange(16, dtype=np.float32).tobytes())
    with grpc.insecure_channel(target["grpc"]) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                     request_serializer=None, response_deserializer=None)
        answers = call(iter([good.SerializeToString()]), timeout=30)
        first = pb.ModelStreamInferResponse.FromString(next(answers))
        assert first.error_message == "" and first.infer_response.id == "ok-1"
        out = np.frombuffer(first.infer_response.raw_output_contents[0], dtype=np.float32)
        assert np.array_equal(out, 2 * np.arange(16, dtype=np.float32))
        bad = call(iter([good.SerializeToString(), b"\xff\xff\xff"]), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            list(bad)
        # a client's mistake: INVALID_ARGUMENT, as for a unary call (never INTERNAL; docs/security.md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "deserializing" in (err.value.details() or "")


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_a_missing_input_is_refused_in_tritons_words(proto: str, target: dict[str, str]) -> None:
    """Triton's text (core's ValidateRequestInputs, which NVIDIA's L0_input_validation asserts),
    through the real tritonclient; it was "...; missing ['INPUT0']"."""
    m = mod(proto)
    inp = m.InferInput("INPUT1", [1, 16], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 16), np.float32))
    with client(proto, target[proto]) as c, pytest.raises(InferenceServerException) as err:
        c.infer("add_sub", [inp])
    assert err.value.message() == ("expected 2 inputs but got 1 inputs for model 'add_sub'. Got input(s) ['INPUT1'], "
                                   "but missing required input(s) ['INPUT0']. Please provide all required input(s).")


def test_typed_contents_of_another_kind_than_the_datatype_are_refused_in_tritons_words(target: dict[str, str]) -> None:
    """An FP32 input whose values travel in int_contents: Triton 2.51's INVALID_ARGUMENT text
    (measured; grpc/infer_handler.cc). It was "needs 64 bytes, got 0" (the contents read as empty)."""
    import grpc

    from meshserve._proto import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 16]).contents.int_contents.extend(range(16))
    with grpc.insecure_channel(target["grpc"]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            call(request.SerializeToString(), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("unexpected explicit tensor data for input tensor 'INPUT0' for model 'add_sub' "
                                   "of type 'INT32', expected datatype 'FP32'")


@pytest.mark.parametrize("dt", ["BYTES", "FP32"])
def test_a_large_request_of_typed_contents_is_read_off_the_loop_and_answered(dt: str, target: dict[str, str]) -> None:
    """A gRPC request over infer_checks.HEAVY_FROM whose tensors travel in typed contents (the
    KServe SDK's way) is parsed by the body worker, its contents moved to raw_input_contents
    (http_codec.parse_grpc_infer_request): answered as before, unary and streamed. A streamed one
    past the bounds is answered in band and the stream goes on, as for a message read in place
    (http_codec.parse_grpc_stream_request: the code before ended the stream); a malformed one
    ends it with INVALID_ARGUMENT."""
    import grpc

    from meshserve._proto import grpc_service_pb2 as pb
    from meshserve.protocol.infer_checks import HEAVY_FROM, heavy

    n = 40_000 if dt == "BYTES" else 400_000  # 1.3 / 1.6 MiB
    req = pb.ModelInferRequest(model_name=f"identity_{dt.lower()}", id="typed")
    tensor = req.inputs.add(name="INPUT0", datatype=dt, shape=[1, n])
    if dt == "BYTES":
        values = [b"%06d" % i + b"-" * 24 for i in range(n)]
        tensor.contents.bytes_contents.extend(values)
    else:
        floats = np.arange(n, dtype=np.float32)
        tensor.contents.fp32_contents.extend(floats.tolist())
    raw = req.SerializeToString()
    assert len(raw) > HEAVY_FROM and heavy(raw)
    over = pb.ModelInferRequest(model_name="add_sub", id="over")
    over.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16]).contents.fp32_contents.extend([0.0] * 16)
    over_raw = over.SerializeToString() + b"\x32\x00" * HEAVY_FROM  # empty requested outputs

    def check(answer: pb.ModelInferResponse) -> None:
        assert answer.id == "typed" and list(answer.outputs[0].shape) == [1, n]
        data = answer.raw_output_contents[0]
        if dt == "BYTES":
            got = []
            at = 0
            while at < len(data):
                size = int.from_bytes(data[at:at + 4], "little")
                got.append(data[at + 4:at + 4 + size])
                at += 4 + size
            assert got == values
        else:
            assert np.array_equal(np.frombuffer(data, np.float32), floats)

    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(target["grpc"], options=options) as channel:
        check(pb.ModelInferResponse.FromString(
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(raw, timeout=60)))
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        first = pb.ModelStreamInferResponse.FromString(next(stream(iter([raw]), timeout=60)))
        assert first.error_message == ""
        check(first.infer_response)
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(over_raw, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "requested outputs; at most" in (err.value.details() or "")
        refused, served = (pb.ModelStreamInferResponse.FromString(m)
                           for m in stream(iter([over_raw, raw]), timeout=60))
        assert "requested outputs; at most" in refused.error_message, refused.error_message
        assert (refused.infer_response.id, refused.infer_response.model_name) == ("over", "add_sub")
        assert served.error_message == ""
        check(served.infer_response)
        malformed = over_raw + b"\x0a\xff\xff\xff\x07"  # (a last field longer than the message)
        assert heavy(malformed)
        with pytest.raises(grpc.RpcError) as err:
            list(stream(iter([malformed]), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ModelInferRequest" in (err.value.details() or "")


def test_large_answers_made_off_the_loop_come_whole(target: dict[str, str]) -> None:
    """Answers with much to write as JSON (infer and generate: rendered by the body worker) and
    large answers compressed for their client (tritonclient's response_compression_algorithm: on
    the deflate threads) come whole and exact (tests/adversarial/test_large_answers.py: they
    leave the event loop to the others)."""
    x = np.random.default_rng(5).standard_normal((1, 100_000)).astype(np.float32)  # 400 KB, ~1 MB as JSON
    with httpclient.InferenceServerClient(target["http"]) as c:
        for binary, compression in [(False, None), (False, "gzip"), (True, "deflate"), (True, "gzip")]:
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            res = c.infer("identity_fp32", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)],
                          response_compression_algorithm=compression)
            assert np.array_equal(res.as_numpy("OUTPUT0"), x), (binary, compression)
    body = json.dumps({"INPUT0": x[0].tolist()}).encode()
    for path in ("generate", "generate_stream"):
        req = urllib.request.Request(f"http://{target['http']}/v2/models/identity_fp32/{path}", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read()
        if path == "generate_stream":
            assert text.startswith(b"data: ") and text.endswith(b"\n\n") and text.count(b"data: ") == 1
            text = text[len(b"data: "):-2]
        got = np.array(json.loads(text)["OUTPUT0"], dtype=np.float32)
        assert np.array_equal(got, x[0]), path


def test_a_raw_binary_request_is_read_with_its_models_config(target: dict[str, str]) -> None:
    """Triton's raw binary request (Inference-Header-Content-Length: 0, the body the one input's
    bytes): batch 1, the variable dimension from the body's size, every output binary; a model of
    more inputs or a BYTES input of more than one element refused in Triton's words (NVIDIA's
    qa/L0_http asserts them). It was refused as unsupported."""
    x = np.arange(8, dtype=np.float32)
    raw = {"Inference-Header-Content-Length": "0"}
    req = urllib.request.Request(f"http://{target['http']}/v2/models/identity_fp32/infer", data=x.tobytes(),
                                 headers=raw, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        n = int(r.headers["Inference-Header-Content-Length"])
        body = r.read()
    header = json.loads(body[:n])
    assert header["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 8],
                                  "parameters": {"binary_data_size": 32}}]
    assert body[n:] == x.tobytes()
    status, err = _post(f"http://{target['http']}/v2/models/add_sub/infer", x.tobytes(), raw)
    assert status == 400 and err["error"] == ("Raw request must only have 1 input (found 1) to be deduced but got 2 "
                                              "inputs in 'add_sub' model configuration"), err
    status, err = _post(f"http://{target['http']}/v2/models/identity_bytes/infer", b"427", raw)
    assert status == 400 and err["error"] == ("For BYTE datatype raw input 'INPUT0', the model must have input "
                                              "shape [1]"), err


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,fragment", [
    (b"{not json", "JSON"),
    (b'{"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1, 2]}]}', "16"),
    (b'{"inputs": 5}', "inputs"),
])
def test_bad_http_bodies_are_400_not_500(body: bytes, fragment: str, target: dict[str, str]) -> None:
    status, err = _post(f"http://{target['http']}/v2/models/add_sub/infer", body)
    assert status == 400, err
    assert fragment in err["error"]


def test_binary_size_mismatch_is_400(target: dict[str, str]) -> None:
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}]}).encode()
    status, err = _post(f"http://{target['http']}/v2/models/add_sub/infer", header + b"\0" * 100,
                        {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400, err


def test_backend_down_is_unavailable(model_repo) -> None:
    from tests.conftest import start, take_down

    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0"])
    gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                     "--discovery-interval", "60"])
    try:
        a = np.zeros((1, 16), np.float32)
        assert infer_one("grpc", gateway.grpc, "add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].shape == (1, 16)
        take_down(service, gateway)
        for proto, status in (("http", "503"), ("grpc", "StatusCode.UNAVAILABLE")):
            m = mod(proto)
            with client(proto, getattr(gateway, proto)) as c, pytest.raises(InferenceServerException) as err:
                c.infer("add_sub", _fp32_inputs(m, {"INPUT0": (1, 16), "INPUT1": (1, 16)}))
            assert err.value.status() == status, err.value
    finally:
        gateway.stop()
        service.stop()


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_hop_parameters_from_a_client_are_refused_by_the_gateway_and_ignored_by_a_service(
        proto: str, target: dict[str, str]) -> None:
    """The ``meshserve_*`` request parameters belong to the gateway -> service hop. A client
    that sends one to a gateway gets INVALID_ARGUMENT naming it; a service that a client talks
    to directly believes them only on a gateway's stream, so a 1-row request claiming to hold 5
    merged requests is served as the one request it is (before, it was refused as a bad merge)."""
    m = mod(proto)
    arrays = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}
    inputs = []
    for name, arr in arrays.items():
        inp = m.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    with client(proto, target[proto]) as c:
        if target["name"] == "gateway":
            with pytest.raises(InferenceServerException) as err:
                c.infer("add_sub", inputs, parameters={"meshserve_merged_requests": 5})
            assert err.value.status() == ("400" if proto == "http" else "StatusCode.INVALID_ARGUMENT")
            assert "'meshserve_merged_requests' is reserved" in err.value.message()
        else:
            res = c.infer("add_sub", inputs, parameters={"meshserve_merged_requests": 5})
            np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), np.full((1, 16), 2, np.float32))
