"""Byte-level edits of serialized requests (meshserve/protocol/wire.py) parse as protobuf would."""
from __future__ import annotations

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import wire


def test_appended_parameters_parse_and_the_last_entry_of_a_key_wins() -> None:
    req = pb.ModelInferRequest(model_name="m", id="r")
    req.parameters["n"].int64_param = 1
    raw = wire.with_int_parameter(req.SerializeToString(), "n", -5)
    raw = wire.with_string_parameter(raw, "s", "ü" * 100)  # a multi-byte length
    raw = wire.with_int_parameter(raw, "big", 2**40)
    out = pb.ModelInferRequest.FromString(raw)
    assert out.parameters["n"].int64_param == -5
    assert out.parameters["s"].string_param == "ü" * 100
    assert out.parameters["big"].int64_param == 2**40
    assert out.model_name == "m" and out.id == "r"


def test_varint_matches_protobuf() -> None:
    for n in (0, 1, 127, 128, 300, 0x3FFF, 0x4000, 0x1FFFFF, 2**35, 2**64 - 1):
        assert pb.InferParameter(uint64_param=n).SerializeToString() == b"\x28" + wire.varint(n), n  # field 5


def test_an_answers_id_is_cut_at_the_wire_level_only_where_protobuf_put_it() -> None:
    """``without_response_id`` gives protobuf's own bytes of the answer without its id (parse,
    ClearField, serialize) for the layouts protobuf and the coalescer's split write, and None
    (the caller parses) for any layout it does not read: a length of two bytes before or at the
    id, an id with nothing after it, no id."""

    def answer(**fields: str) -> pb.ModelInferResponse:
        m = pb.ModelInferResponse(**fields)
        m.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 4])
        m.raw_output_contents.append(b"\x1a\x01" * 8)  # (bytes that look like an id field)
        return m

    for fields in ({"model_name": "add_sub", "model_version": "1", "id": "abc"}, {"id": "x"},
                   {"model_version": "2", "id": "é"}, {"model_name": "m", "id": "q" * 127}):
        m = answer(**fields)
        m.parameters["p"].int64_param = 3
        for raw in (m.SerializeToString(), answer(**fields).SerializeToString()):
            cut = wire.without_response_id(raw)
            expected = pb.ModelInferResponse.FromString(raw)
            expected.ClearField("id")
            assert cut is not None and cut == expected.SerializeToString()
    for fields in ({"model_name": "m" * 128, "id": "a"}, {"model_version": "1" * 200, "id": "a"},
                   {"model_name": "m", "id": "q" * 128}, {"model_name": "m"}):
        assert wire.without_response_id(answer(**fields).SerializeToString()) is None
    assert wire.without_response_id(pb.ModelInferResponse(model_name="m", id="a").SerializeToString()) is None
