"""services/python/bls.py: a BLS request's parameters travel as the HTTP codec reads JSON ones
(meshserve/protocol/http_codec.py:set_parameter): the same types, the same ranges, the same refusal."""
from __future__ import annotations

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import http_codec
from services.python import bls, pb_utils


def _as_http_codec_reads(params: dict) -> dict[str, pb.InferParameter]:
    msg = pb.ModelInferRequest()
    for key, value in params.items():
        http_codec.set_parameter(msg.parameters[key], value, key)
    return dict(msg.parameters)


def test_parameters_are_converted_as_the_http_codec_converts_them() -> None:
    params = {"flag": True, "n": -7, "big": 2**63, "ratio": 0.5, "name": "x"}
    msg = bls.to_proto(pb_utils.InferenceRequest(model_name="m", parameters=params))
    assert dict(msg.parameters) == _as_http_codec_reads(params)
    # (before: ratio became the string "0.5", and 2**63 did not fit an int64: ValueError in the model)
    assert msg.parameters["ratio"].double_param == 0.5 and msg.parameters["big"].uint64_param == 2**63


def test_a_parameter_no_request_can_carry_is_the_calls_invalid_argument_error() -> None:
    request = pb_utils.InferenceRequest(model_name="m", parameters={"nested": {"a": 1}})
    response = bls.BlsClient("127.0.0.1:9").infer(request)  # refused before anything is sent
    assert response.has_error()
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert response.error().message() == ("Model m - Error when running inference: BLS request parameter 'nested': "
                                          "unsupported JSON object value {\"a\": 1}; expected a string, number or boolean")
