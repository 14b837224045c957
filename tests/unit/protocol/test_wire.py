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
