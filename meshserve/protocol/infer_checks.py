"""Checks every front door applies to a parsed ModelInferRequest before it goes anywhere."""
from __future__ import annotations

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError


def reject_mixed_contents(request: pb.ModelInferRequest) -> None:
    """Triton refuses typed `contents` on any input of a request that also carries
    `raw_input_contents` (INVALID_ARGUMENT, with this message); so do we, at the gateway and at
    every service. The common case (raw only) costs one truth test."""
    if request.raw_input_contents:
        for tensor in request.inputs:
            if tensor.HasField("contents"):
                raise InferError.invalid(
                    "contents field must not be specified when using raw_input_contents for "
                    f"'{tensor.name}' for model '{request.model_name}'")
