"""Checks every front door applies to a parsed ModelInferRequest before it goes anywhere."""
from __future__ import annotations

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError


def reject_mixed_contents(request: pb.ModelInferRequest) -> None:
    """Triton refuses typed `contents` on any input of a request that also carries
    `raw_input_contents` (INVALID_ARGUMENT, with this message); so do we, at the gateway and at
    every service. Without raw contents it costs one truth test; with them, one HasField per
    input (by index: iterating a upb repeated field ends in an IndexError, 1.5k instructions)."""
    if request.raw_input_contents:
        inputs = request.inputs
        for i in range(len(inputs)):
            if (tensor := inputs[i]).HasField("contents"):
                raise InferError.invalid(
                    "contents field must not be specified when using raw_input_contents for "
                    f"'{tensor.name}' for model '{request.model_name}'")
