"""Checks every front door applies to a parsed ModelInferRequest before it goes anywhere."""
from __future__ import annotations

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError


def reject_mixed_contents(request: pb.ModelInferRequest) -> None:
    """Triton refuses typed `contents` on any input of a request that also carries
    `raw_input_contents` (INVALID_ARGUMENT, with this message); so do we. A service checks every
    request it prepares (services/base/model.py, per input inside its own input loop; this whole
    walk when the raw count is off, as Triton names the contents first); the gateway checks the
    requests it merges (coalesce.merge_key) and the ensembles it runs, and forwards the rest to a
    service unchanged. (A separate walk on every request at the gateway's front door cost ~8k
    instructions, 2.4% of the gateway's work per request, under callgrind.)"""
    if request.raw_input_contents:
        inputs = request.inputs
        for i in range(len(inputs)):
            if (tensor := inputs[i]).HasField("contents"):
                raise mixed_contents(tensor.name, request.model_name)


def mixed_contents(tensor: str, model: str) -> InferError:
    """Triton's error for an input with typed contents in a request with raw contents."""
    return InferError.invalid(
        f"contents field must not be specified when using raw_input_contents for '{tensor}' for model '{model}'")


def int_value(p: pb.InferParameter) -> int | None:
    """An integer request parameter sent as any integer-valued member of its oneof (int64, uint64,
    a decimal string, a whole double); None when it is none of these."""
    which = p.WhichOneof("parameter_choice")
    if which == "int64_param":
        return p.int64_param
    if which == "uint64_param":
        return p.uint64_param
    if which == "string_param":
        s = p.string_param
        return int(s) if s.isascii() and s.removeprefix("-").isdecimal() else None
    if which == "double_param" and float(p.double_param).is_integer():
        return int(p.double_param)
    return None
