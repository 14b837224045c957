"""http_codec.render_infer_raw: a serialized answer (as a gateway holds its service's, or as
gateway/upstream/merging.py:split cuts a merged one) rendered from its bytes equals the
rendering of its message, binary and JSON outputs, the first time (from the message) and from
what was kept; bytes of any other form are left to the message (None)."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from gateway.upstream.merging import split
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import http_codec
from meshserve.protocol.errors import InferError
from meshserve.protocol.http_codec import parse_infer, render_infer_raw, render_infer_response


@pytest.fixture(autouse=True)
def _empty_caches() -> None:
    http_codec._templates.clear()
    http_codec._json_templates.clear()
    http_codec._rendered.clear()
    http_codec._raw_rendered.clear()
    http_codec._raw_last = None


def request_of(outputs: tuple[str, ...], binary_out: bool) -> tuple[pb.ModelInferRequest, http_codec.RenderPlan]:
    t = httpclient.InferInput("IN", [1, 16], "FP32")
    t.set_data_from_numpy(np.zeros((1, 16), np.float32), binary_data=True)
    outs = [httpclient.InferRequestedOutput(o, binary_data=binary_out) for o in outputs]
    data, json_size = _get_inference_request(inputs=[t], request_id="", outputs=outs, sequence_id=0,
                                             sequence_start=False, sequence_end=False, priority=0,
                                             timeout=None, custom_parameters=None)
    request, plan, _ = parse_infer(data if isinstance(data, bytes) else data.encode(), json_size, "m")
    assert plan is not None
    return request, plan


def answer(outputs: list[tuple[str, str, list[int], bytes]], rid: str = "", arm: str = "") -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name="m", model_version="1", id=rid)
    for name, datatype, shape, raw in outputs:
        out.outputs.add(name=name, datatype=datatype, shape=shape)
        out.raw_output_contents.append(raw)
    if arm:
        out.parameters["arm"].string_param = arm
    return out


def f32(seed: int, n: int = 16) -> bytes:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32).tobytes()


def strings(*items: bytes) -> bytes:
    return b"".join(len(s).to_bytes(4, "little") + s for s in items)


@pytest.mark.parametrize("binary_out", [True, False])
@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BYTES", "INT64"])
def test_rendered_from_bytes_as_from_the_message(binary_out: bool, datatype: str) -> None:
    request, plan = request_of(("A", "B"), binary_out)
    for seed in range(4):
        if datatype == "BYTES":
            raws = [strings(b"x" * seed, "é".encode()), strings(b"%d" % seed, b"")]
            shape = [1, 2]
        else:
            size = {"FP32": 4, "FP16": 2, "INT64": 8}[datatype]
            raws = [np.random.default_rng(seed).bytes(16 * size), np.random.default_rng(seed + 9).bytes(16 * size)]
            if datatype == "FP32":
                raws = [f32(seed), f32(seed + 9)]
            shape = [1, 16]
        message = answer([("A", datatype, shape, raws[0]), ("B", datatype, shape, raws[1])])
        got = render_infer_raw(message.SerializeToString(), request, plan)
        assert got == render_infer_response(message, request)
    assert len(http_codec._raw_rendered) == 1  # (kept after the first; the others from its bytes)


def test_split_members_are_rendered_from_their_bytes() -> None:
    request, plan = request_of(("OUT",), True)
    members = [pb.ModelInferRequest(model_name="m") for _ in range(3)]
    rows = [1, 2, 1]
    merged = answer([("OUT", "FP32", [4, 16], f32(5, 64))])
    for raw in split(merged, members, rows):
        got = render_infer_raw(raw, request, plan)
        assert got is not None and got == render_infer_response(pb.ModelInferResponse.FromString(raw), request)
    assert len(http_codec._raw_rendered) == 2  # (one row, two rows)


@pytest.mark.parametrize("form", ["id", "parameters", "outputs after the data", "unknown field", "truncated",
                                  "no data", "empty"])
def test_other_forms_are_left_to_the_message(form: str) -> None:
    request, plan = request_of(("OUT",), True)
    plain = answer([("OUT", "FP32", [1, 16], f32(1))])
    if form == "id":
        raw = answer([("OUT", "FP32", [1, 16], f32(1))], rid="r1").SerializeToString()
    elif form == "parameters":
        raw = answer([("OUT", "FP32", [1, 16], f32(1))], arm="b").SerializeToString()
    elif form == "outputs after the data":
        head = pb.ModelInferResponse(model_name="m", model_version="1")
        data = pb.ModelInferResponse()
        data.raw_output_contents.append(f32(1))
        tail = pb.ModelInferResponse()
        tail.outputs.add(name="OUT", datatype="FP32", shape=[1, 16])
        raw = head.SerializeToString() + data.SerializeToString() + tail.SerializeToString()
        assert pb.ModelInferResponse.FromString(raw) == plain
    elif form == "unknown field":
        raw = plain.SerializeToString() + b"\x3a\x01x"  # field 7, length-delimited
    elif form == "truncated":
        raw = plain.SerializeToString()[:-3]
    elif form == "no data":
        raw = pb.ModelInferResponse(model_name="m", model_version="1").SerializeToString()
    else:
        raw = b""
    assert render_infer_raw(raw, request, plan) is None


def test_a_kept_rendering_that_does_not_fit_is_rendered_in_full() -> None:
    request, plan = request_of(("OUT",), False)
    render_infer_raw(answer([("OUT", "BYTES", [1, 1], strings(b"ab"))]).SerializeToString(), request, plan)
    other = answer([("OUT", "BYTES", [1, 1], strings(b"abc"))])
    assert render_infer_raw(other.SerializeToString(), request, plan) == render_infer_response(other, request)
    request, plan = request_of(("OUT",), True)
    render_infer_raw(answer([("OUT", "FP32", [1, 16], f32(1))]).SerializeToString(), request, plan)
    wrong = answer([("OUT", "FP32", [1, 16], f32(1, 8))])  # 32 bytes for 16 FP32: the full rendering's error
    with pytest.raises(InferError) as bad:
        render_infer_raw(wrong.SerializeToString(), request, plan)
    assert "needs 64" in bad.value.message


@pytest.mark.parametrize("binary_out", [True, False])
def test_the_last_structure_is_taken_only_for_the_same_bytes_around_the_data(binary_out: bool) -> None:
    """render_infer_raw's `_raw_last`: an answer of the plan and size of the last one, with its
    bytes before the data and each output's tag and length, takes its spans; an answer of the
    same size whose model version or outputs' lengths differ is walked again (rendered right)."""
    request, plan = request_of(("A", "B"), binary_out)

    def two(version: str, a: bytes, b: bytes) -> pb.ModelInferResponse:
        message = answer([("A", "BYTES", [1, 1], strings(a)), ("B", "BYTES", [1, 1], strings(b))])
        message.model_version = version
        return message

    for message in (two("1", b"x" * 10, b"y" * 20), two("1", b"p" * 10, b"q" * 20),  # the same structure
                    two("2", b"x" * 10, b"y" * 20),  # another version, the same size
                    two("2", b"r" * 10, b"s" * 20),  # (its structure kept)
                    two("2", b"x" * 20, b"y" * 10),  # the same head and size, the data split elsewhere
                    two("2", b"z" * 20, b"w" * 10)):
        raw = message.SerializeToString()
        assert render_infer_raw(raw, request, plan) == render_infer_response(message, request)
    last = http_codec._raw_last
    assert last is not None and last[1] == len(raw) and last[4] == http_codec._output_spans(raw)[1]  # type: ignore[index]


def test_long_lengths_are_read() -> None:
    request, plan = request_of(("OUT",), True)
    for seed in range(2):
        message = answer([("OUT", "FP32", [1, 70000], f32(seed, 70000))])  # a 3-byte length varint
        assert render_infer_raw(message.SerializeToString(), request, plan) == render_infer_response(message, request)


def test_a_long_head_is_left_to_the_message() -> None:
    request, plan = request_of(("OUT",), True)
    message = answer([("OUT", "FP32", [1, 16], f32(1))])
    message.model_name = "m" * (http_codec.TEMPLATE_MAX_HEADER + 1)  # (not a key to keep)
    assert render_infer_raw(message.SerializeToString(), request, plan) is None
    assert not http_codec._raw_rendered
