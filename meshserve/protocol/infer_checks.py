"""Checks every front door applies to a parsed ModelInferRequest before it goes anywhere."""
from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import Message

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import wire
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



# A string sequence id is kept for as long as its sequence lives, after the request that named it
# is answered: in a service's batcher (services/base/scheduling/sequence.py, up to the model's
# max_sequence_idle_microseconds after its last request) and with tenants in the gateway's
# binding of the sequence to its tenant (gateway/auth.py). Unbounded, 300 open sequences of 1 MB
# ids held 290 MB of a service until they went idle (docs/security.md, "Session 22: sequence
# ids"). Triton sets no bound; a UUID is 36 characters, tritonclient's and perf_analyzer's ids
# are numbers or short strings.
SEQUENCE_ID_MAX = 1024  # characters of a string sequence_id


def check_sequence_id(corrid: str) -> str:
    """``corrid`` (a request's string sequence_id), refused past ``SEQUENCE_ID_MAX`` characters."""
    if len(corrid) > SEQUENCE_ID_MAX:
        raise InferError.invalid(
            f"a string sequence_id may have at most {SEQUENCE_ID_MAX} characters, this one has {len(corrid)}")
    return corrid


# A BYTES element costs far more than its bytes once a model runs on it: a Python object on each
# side of the runtime and a std::string inside onnxruntime, ~280 bytes an element end to end, and
# a Python loop step in each walk of the framing (the count, the decode, the answer's encode).
# One 16 MB message of 4 million empty elements took a service 8 s and 92 -> 1,227 MiB, with a
# good client's worst latency 1.1 s (docs/security.md, "Session 22: BYTES elements"). Checked
# from the declared shape, before any element is walked. Triton sets no bound.
MAX_BYTES_ELEMENTS = 1 << 18  # BYTES elements of one request, all its BYTES inputs together


def check_bytes_elements(total: int, where: str) -> None:
    """``total``: the BYTES elements of a request so far (by their shapes); past
    ``MAX_BYTES_ELEMENTS``, INVALID_ARGUMENT naming ``where`` (the input that passed it)."""
    if total > MAX_BYTES_ELEMENTS:
        raise InferError.invalid(
            f"{where}: the request's BYTES inputs hold {total} elements, more than {MAX_BYTES_ELEMENTS}")


# ---- how many parts one request may have --------------------------------------------------------
# Past these a request is refused (INVALID_ARGUMENT, HTTP 400) before anything walks its parts:
# each part costs Python work at every hop (the gateway's shared-memory check, its merging and
# pipeline, a service's preparation), ~3 us per input on a 2-core box. Before these bounds one
# gRPC message of 9.5 MiB (5 million empty inputs, 2 bytes each) held a gateway's event loop for
# 7 s, a service's for 4.7 s; a million request parameters (16 MiB), 2.4 s (docs/security.md,
# "Session 21: the parts of one request"). Triton sets none of these; no model of ours nor any of
# NVIDIA's examples comes near them.
MAX_TENSORS = 1024  # inputs, requested outputs, raw_input_contents entries: each
MAX_PARAMETERS = 1024  # the request's parameters, and each tensor's
MAX_DIMS = 64  # a shape's dimensions (numpy 2's NPY_MAXDIMS)
# ... and all the request's parameters together, its tensors' included: the bounds above allow
# 1024 x 1024, and 1,000 requested outputs of 1,000 parameters each (11 MiB) held a gateway's loop
# 1.1 s a request. A request of 1024 inputs in shared memory has 3,072 (three each).
MAX_PARAMETERS_TOTAL = 4096
PARAMETERS_IN_ALL = "parameters in all (its tensors' included)"  # (what the refusal past it counts)
# A serialized request of at most this many bytes is not counted (check_counts): it has at most
# COUNT_FROM // 2 parts, so what they cost is bounded by its size, and the common request
# (~100-2,000 bytes) pays nothing (a upb read is ~3k instructions).
COUNT_FROM = 4096


def check_message_counts(message: Message, where: str = "the request", seen: list[int] | None = None) -> None:
    """Raise INVALID_ARGUMENT where a repeated field or map of ``message``, or of a message in
    it, has more than MAX_PARAMETERS entries, or all of them together more than
    MAX_PARAMETERS_TOTAL: the other unary requests' bound (their maps of parameters and
    settings; a model load's files), checked where the message is parsed (grpc_frontend._reader,
    or the body worker's http_codec.parse_grpc_message)."""
    if seen is None:
        seen = [0]
    for field, value in message.ListFields():
        if isinstance(value, (str, bytes)):
            continue
        if hasattr(value, "__len__"):  # a repeated field or a map
            if len(value) > MAX_PARAMETERS:
                raise too_many(where, len(value), f"'{field.name}' entries", MAX_PARAMETERS)
            seen[0] += len(value)
            if seen[0] > MAX_PARAMETERS_TOTAL:
                raise InferError.invalid(
                    f"{where} has more than {MAX_PARAMETERS_TOTAL} entries in its maps and lists together")
            for item in (value.values() if hasattr(value, "values") else value):
                if isinstance(item, Message):
                    check_message_counts(item, where, seen)
        elif isinstance(value, Message):
            check_message_counts(value, where, seen)


def too_many(whose: str, count: int, what: str, bound: int) -> InferError:
    """The refusal of a request past one of the bounds above: "the request has 2000 inputs; at most 1024"."""
    return InferError.invalid(f"{whose} has {count} {what}; at most {bound}")


def check_counts(request: pb.ModelInferRequest) -> None:
    """Raise INVALID_ARGUMENT where ``request`` has more parts than MAX_TENSORS, MAX_PARAMETERS
    or MAX_DIMS allow: a length read per container, and per tensor (at most MAX_TENSORS of them
    once the first reads pass). The gRPC front door calls it on a request parsed from more than
    COUNT_FROM bytes, before anything else reads it; the HTTP codec counts the JSON as it reads it."""
    inputs, outputs = request.inputs, request.outputs
    for count, what in ((len(inputs), "inputs"), (len(outputs), "requested outputs"),
                        (len(request.raw_input_contents), "raw_input_contents entries")):
        if count > MAX_TENSORS:
            raise too_many("the request", count, what, MAX_TENSORS)
    if (count := len(request.parameters)) > MAX_PARAMETERS:
        raise too_many("the request", count, "parameters", MAX_PARAMETERS)
    total = len(request.parameters)
    for tensor in inputs:
        if (count := len(tensor.parameters)) > MAX_PARAMETERS:
            raise too_many(f"input '{tensor.name}'", count, "parameters", MAX_PARAMETERS)
        if (count := len(tensor.shape)) > MAX_DIMS:
            raise too_many(f"input '{tensor.name}'", count, "dimensions in its shape", MAX_DIMS)
        total += len(tensor.parameters)
    for output in outputs:
        if (count := len(output.parameters)) > MAX_PARAMETERS:
            raise too_many(f"requested output '{output.name}'", count, "parameters", MAX_PARAMETERS)
        total += len(output.parameters)
    if total > MAX_PARAMETERS_TOTAL:
        raise too_many("the request", total, PARAMETERS_IN_ALL, MAX_PARAMETERS_TOTAL)


# ---- which messages are parsed off the event loop -------------------------------------------------
# protobuf's parse is C but not free: ~40 ms per MiB of 2-byte fields on a slow 2-core box (an
# empty input, a map entry of one key sent again), ~15-20 ms per MiB of one-byte bytes_contents
# elements, ~0.2 ms per MiB of raw_input_contents or packed numbers. A gRPC message over
# HEAVY_FROM bytes whose fields other than raw_input_contents hold more than HEAVY_BYTES, or that
# has more top-level fields than wire.SCAN_FIELDS_MAX, is parsed by the body worker
# (http_codec.parse_grpc_infer_request), which sends back a message that parses at memcpy speed.
# A client's usual large request (tritonclient's and perf_analyzer's: the tensors in
# raw_input_contents) is parsed in place as before, after a walk of its few top-level fields.
HEAVY_FROM = 1 << 20
HEAVY_BYTES = 256 << 10


def heavy(raw: bytes) -> bool:
    """Is the serialized ModelInferRequest ``raw`` (over HEAVY_FROM bytes) to be parsed off the
    event loop? Its top-level fields are walked, tag and length only, at most SCAN_FIELDS_MAX."""
    n = len(raw)
    pos = other = 0
    for _ in wire.SCAN_STEPS:
        if pos >= n:
            return other > HEAVY_BYTES
        key, p = wire.varint_at(raw, pos, n)
        wire_type = key & 7
        if key < 0 or wire_type != 2:  # (no field of the request is anything but length-delimited)
            return True
        length, p = wire.varint_at(raw, p, n)
        if length < 0:
            return True
        if key != _RAW_KEY:
            other += p - pos + length
        pos = p + length
    return True


_RAW_KEY = 7 << 3 | 2  # raw_input_contents (7), length-delimited


def missing_inputs(model: str, inputs: int, required: int, got: list[str], missing: list[str]) -> InferError:
    """Triton's refusal of a request without all of its model's required inputs (core's
    infer_request.cc, ValidateRequestInputs; NVIDIA's L0_input_validation checks its text), without
    its "[request id: ...]" prefix, as every error here. ``inputs``: the model's inputs, ``required``
    how many of them are; ``got``: the request's (Triton lists them in its map's order; here in the
    request's), ``missing``: in the config's order."""
    def listed(names: list[str]) -> str:
        return "[" + ",".join(f"'{n}'" for n in names) + "]"

    expected = f"expected {inputs} inputs" if required == inputs else \
        f"expected number of inputs between {required} and {inputs}"
    return InferError.invalid(
        f"{expected} but got {len(got)} inputs for model '{model}'. Got input(s) {listed(got)}, but missing "
        f"required input(s) {listed(missing)}. Please provide all required input(s).")


def unexpected_input(name: str, model: str, inputs: Iterable[str]) -> InferError:
    """Triton's refusal of an input its model does not have, the model's inputs named after it
    (the services' ``prepare`` and the gateway's ensembles)."""
    return InferError.invalid(f"unexpected inference input '{name}' for model '{model}'; "
                              f"model inputs are {sorted(inputs)}")


def datatype_mismatch(name: str, datatype: str, model: str, expected: str) -> InferError:
    """Triton's refusal of an input of another datatype than its model's (the services'
    ``prepare`` and the gateway's ensembles)."""
    return InferError.invalid(f"inference input '{name}' data-type is '{datatype}', but model '{model}' "
                              f"expects '{expected}'")

