"""http_codec's binary request templates (parse_infer) and rendered-header cache
(render_infer_response with a RenderPlan): every answer equals the full parse / render's,
for bodies made by the real tritonclient encoder."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import http_codec
from meshserve.protocol.errors import InferError
from meshserve.protocol.http_codec import parse_infer, parse_infer_request, render_infer_response


@pytest.fixture(autouse=True)
def _empty_caches() -> None:
    http_codec._templates.clear()
    http_codec._rendered.clear()


def body(arrays: dict[str, np.ndarray], *, binary_in: bool = True, outputs: tuple[str, ...] = ("OUT",),
         binary_out: bool = True, request_id: str = "", shm_output: bool = False) -> tuple[bytes, int | None]:
    inputs = []
    for name, arr in arrays.items():
        datatype = "BYTES" if arr.dtype == np.object_ else {"float32": "FP32", "int64": "INT64"}[str(arr.dtype)]
        t = httpclient.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr, binary_data=binary_in)
        inputs.append(t)
    outs = []
    for o in outputs:
        out = httpclient.InferRequestedOutput(o, binary_data=binary_out)
        if shm_output:
            out.set_shared_memory("region", 64)
        outs.append(out)
    data, json_size = _get_inference_request(inputs=inputs, request_id=request_id, outputs=outs,
                                             sequence_id=0, sequence_start=False, sequence_end=False,
                                             priority=0, timeout=None, custom_parameters=None)
    return data if isinstance(data, bytes) else data.encode(), json_size


def f32(seed: int, shape: tuple[int, ...] = (1, 16)) -> np.ndarray:
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def test_a_repeated_header_parses_as_the_full_parse_does() -> None:
    first, hl = body({"A": f32(0), "B": f32(1)})
    request, plan, raw = parse_infer(first, hl, "m", "2")
    assert plan is not None and raw is None and request == parse_infer_request(first, hl, "m", "2")
    assert len(http_codec._templates) == 1
    for seed in range(2, 6):  # the same header, other tensors: from the template
        again, hl2 = body({"A": f32(seed), "B": f32(seed + 10)})
        assert hl2 == hl
        request2, plan2, raw2 = parse_infer(again, hl2, "m", "2")
        assert plan2 is plan and raw2 is not None and pb.ModelInferRequest.FromString(raw2) == request2
        assert request2 == parse_infer_request(again, hl2, "m", "2")
        assert request2.raw_input_contents[0] == f32(seed).tobytes()
    assert len(http_codec._templates) == 1
    # another model name or version: its own template, its own names in the request
    other, plan3, _ = parse_infer(first, hl, "n", "")
    assert other.model_name == "n" and other.model_version == "" and plan3 is not plan


def test_a_template_is_not_used_for_a_body_of_another_length() -> None:
    good, hl = body({"A": f32(0)})
    parse_infer(good, hl, "m")
    with pytest.raises(InferError) as short:
        parse_infer(good[:-4], hl, "m")
    with pytest.raises(InferError) as full:
        parse_infer_request(good[:-4], hl, "m")
    assert short.value.message == full.value.message and "truncated" in short.value.message
    with pytest.raises(InferError) as extra:
        parse_infer(good + b"xx", hl, "m")
    assert "bytes after the binary data" in extra.value.message


def test_json_data_beside_binary_inputs_makes_no_template() -> None:
    # (an all-JSON body has its own template: test_http_codec_json_template.py)
    # a JSON header with one JSON-data input and one binary input
    mixed = httpclient.InferInput("J", [2], "INT64")
    mixed.set_data_from_numpy(np.array([1, 2], dtype=np.int64), binary_data=False)
    binary = httpclient.InferInput("B", [1, 16], "FP32")
    binary.set_data_from_numpy(f32(1), binary_data=True)
    raw, json_size = _get_inference_request(inputs=[mixed, binary], request_id="", outputs=None, sequence_id=0,
                                            sequence_start=False, sequence_end=False, priority=0, timeout=None,
                                            custom_parameters=None)
    for _ in range(2):
        request, plan, _ = parse_infer(raw, json_size, "m")
        assert plan is None and request == parse_infer_request(raw, json_size, "m")
    assert not http_codec._templates


def test_bytes_inputs_of_other_sizes_are_parsed_again() -> None:
    one, hl1 = body({"S": np.array([[b"ab", b"c"]], dtype=np.object_)})
    two, hl2 = body({"S": np.array([[b"abcd", b"c"]], dtype=np.object_)})
    r1, _, _ = parse_infer(one, hl1, "m")
    r2, _, _ = parse_infer(two, hl2, "m")
    assert r1 == parse_infer_request(one, hl1, "m") and r2 == parse_infer_request(two, hl2, "m")
    assert r1.raw_input_contents[0] != r2.raw_input_contents[0]


def test_shared_memory_requests_say_so() -> None:
    data, hl = body({"A": f32(0)}, shm_output=True)
    _, plan, _ = parse_infer(data, hl, "m")
    assert plan is not None and plan.shared_memory
    data, hl = body({"A": f32(0)})
    _, plan, _ = parse_infer(data, hl, "m")
    assert plan is not None and not plan.shared_memory


def response(raws: list[bytes], *, datatype: str = "FP32", shape: tuple[int, ...] = (1, 16), rid: str = "",
             arm: str = "") -> pb.ModelInferResponse:
    out = pb.ModelInferResponse(model_name="m", model_version="1", id=rid)
    for i, raw in enumerate(raws):
        out.outputs.add(name=f"OUT{i}" if i else "OUT", datatype=datatype, shape=shape)
        out.raw_output_contents.append(raw)
    if arm:
        out.parameters["arm"].string_param = arm
    return out


@pytest.mark.parametrize("binary_out", [True, False])
def test_rendered_answers_equal_the_full_rendering(binary_out: bool) -> None:
    data, hl = body({"A": f32(0)}, outputs=("OUT", "OUT1"), binary_out=binary_out)
    request, plan, _ = parse_infer(data, hl, "m")
    for seed in range(4):
        answer = response([f32(seed).tobytes(), f32(seed + 1).tobytes()])
        assert render_infer_response(answer, request, plan) == render_infer_response(answer, request)
    assert len(http_codec._rendered) == 1  # (JSON data: its pieces, test_http_codec_json_template.py)


@pytest.mark.parametrize("change", ["id", "parameters", "bytes sizes", "shape", "wrong size"])
def test_what_changes_the_header_is_rendered_again(change: str) -> None:
    data, hl = body({"A": f32(0)})
    request, plan, _ = parse_infer(data, hl, "m")
    render_infer_response(response([f32(0).tobytes()]), request, plan)
    assert len(http_codec._rendered) == 1
    if change == "id":
        answer = response([f32(1).tobytes()], rid="r7")
    elif change == "parameters":
        answer = response([f32(1).tobytes()], arm="b")
    elif change == "bytes sizes":
        answer = response([b"\x02\x00\x00\x00ab"], datatype="BYTES", shape=(1,))
        render_infer_response(answer, request, plan)
        answer = response([b"\x03\x00\x00\x00abc"], datatype="BYTES", shape=(1,))
    elif change == "shape":
        answer = response([f32(1, (2, 16)).tobytes()], shape=(2, 16))
    else:
        answer = response([f32(1, (2, 16)).tobytes()])
        with pytest.raises(InferError) as bad:
            render_infer_response(answer, request, plan)
        assert "needs 64" in bad.value.message
        return
    assert render_infer_response(answer, request, plan) == render_infer_response(answer, request)
