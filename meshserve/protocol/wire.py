"""Small protobuf wire-format helpers for byte-level passthrough (no message parse)."""
from __future__ import annotations

# The gRPC message size limit of every hop: Triton's clients assume no limit (grpc's Python
# default is 4 MiB); a server's --max-request-bytes bounds what it accepts (meshserve.server.limits).
MAX_MESSAGE_BYTES = 2**31 - 1
# Field numbers from grpc_service.proto.
INFER_REQUEST_ID_TAG = b"\x1a"  # ModelInferRequest.id = 3, length-delimited
STREAM_RESPONSE_INFER_TAG = b"\x12"  # ModelStreamInferResponse.infer_response = 2, length-delimited
# gRPC's own server pushback trailer (gRFC A6): how long a client should wait before it retries,
# in ms; sent with RESOURCE_EXHAUSTED where HTTP sends Retry-After
RETRY_PUSHBACK_METADATA = "grpc-retry-pushback-ms"
# The gateway -> service hop's own parameters, its marker, stream errors and cancel: meshserve.protocol.hop.

# Triton's: on every ModelStreamInfer response (is it the request's last?), and the client's opt-in
# to an empty response that carries only the final flag
FINAL_RESPONSE_PARAMETER = "triton_final_response"
EMPTY_FINAL_REQUEST_PARAMETER = "triton_enable_empty_final_response"
ROUTE_ARM_PARAMETER = "meshserve_route_arm"  # which A/B target answered (gateway routes)
ROUTE_ARM_HEADER = "x-meshserve-route-arm"  # the same, as an HTTP response header
# gRPC trailing metadata of a service's RepositoryIndex answer: the kind it serves (onnx, ...), so
# that a gateway knows which replicas can load a model of a given kind
SERVICE_KIND_METADATA = "meshserve-service-kind"
# Triton's shared-memory tensor parameters (inputs and requested outputs; meshserve.server.shm)
SHM_REGION = "shared_memory_region"
SHM_BYTE_SIZE = "shared_memory_byte_size"
SHM_OFFSET = "shared_memory_offset"
# The byte-level scanners of a request's top-level fields (gateway/upstream/merging.py, gateway/cache.py)
# read at most this many fields, then leave the request to the parsed message's reads: a message
# of many small fields (a model name sent two million times, 4 MiB) cost them ~2 us a field on
# a 2-core box. The usual request has under ten; infer_checks bounds what the message holds.
SCAN_FIELDS_MAX = 256
SCAN_STEPS = range(SCAN_FIELDS_MAX)  # (a for loop over it: the bound costs no counter)
_REQUEST_PARAMETERS_TAG = b"\x22"  # ModelInferRequest.parameters = 4 (map entries, length-delimited)


def varint(n: int) -> bytes:
    if n < 0x80:  # the common case: one byte
        return bytes((n,))
    if n < 0x4000:  # two bytes: lengths of spans, small messages
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def varint_at(raw: bytes, p: int, n: int) -> tuple[int, int]:
    """(the varint at ``p``, the position after it), reading ``raw`` up to ``n``; (-1, -1) where
    it is cut short or does not end by its fifth byte (no length meshserve reads is that large).
    The one reader of the byte-level scanners (gateway/upstream/merging.py, gateway/cache.py,
    meshserve/protocol/http_codec.py)."""
    value = shift = 0
    while True:
        if p >= n or shift > 28:
            return -1, -1
        b = raw[p]
        p += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, p
        shift += 7


def field_end(raw: bytes, p: int, n: int) -> int:
    """The end of a length-delimited field whose length varint starts at ``p`` (-1: malformed, as
    ``varint_at``): its own loop, not a call of ``varint_at``, on the merge check's per-field path."""
    length = shift = 0
    while True:
        if p >= n or shift > 28:
            return -1
        b = raw[p]
        p += 1
        length |= (b & 0x7F) << shift
        if b < 0x80:
            return p + length
        shift += 7


def length_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


def with_request_id(raw_request: bytes, request_id: str) -> bytes:
    """A serialized ModelInferRequest (or ModelInferResponse: `id` is field 3 in both) with `id`
    replaced: a singular field's last occurrence wins."""
    return raw_request + length_delimited(INFER_REQUEST_ID_TAG, request_id.encode())


def without_response_id(raw_response: bytes) -> bytes | None:
    """A serialized ModelInferResponse less its ``id`` (field 3) where it is laid out as protobuf
    and the coalescer's split (gateway/upstream/merging.py) write it: model_name (1) and
    model_version (2) if any, each with a one-byte length, then the id (one-byte length), then
    parameters (4), outputs (5) or raw_output_contents (6). None for any other layout (the
    caller parses). Fields are in number order there, so nothing after is another id; the
    fields after it are not walked (a walk costs more than protobuf's parse of a small answer).
    The cache keeps an answer without its id (gateway/cache.py:_without_id)."""
    n = len(raw_response)
    p = 0
    if n > 2 and raw_response[0] == 0x0A and raw_response[1] < 0x80:
        p = 2 + raw_response[1]
    if p + 2 < n and raw_response[p] == 0x12 and raw_response[p + 1] < 0x80:
        p += 2 + raw_response[p + 1]
    if p + 2 < n and raw_response[p] == 0x1A and raw_response[p + 1] < 0x80 \
            and (end := p + 2 + raw_response[p + 1]) < n and raw_response[end] in _AFTER_ID:
        return raw_response[:p] + raw_response[end:]
    return None


_AFTER_ID = frozenset((0x22, 0x2A, 0x32))  # ModelInferResponse parameters, outputs, raw_output_contents


def with_int_parameter(raw_request: bytes, key: str, value: int) -> bytes:
    """A serialized ModelInferRequest with parameters[key].int64_param = value (appended map
    entry; for maps the last entry of a key wins)."""
    return _with_parameter(raw_request, key, b"\x10" + varint(value & 0xFFFFFFFFFFFFFFFF))  # int64_param = 2


def bool_parameter_entry(key: str, value: bool) -> bytes:
    """The bytes that, appended to a serialized ModelInferRequest or ModelInferResponse (both hold
    ``parameters`` as field 4), set parameters[key].bool_param = value."""
    return _parameter_entry(key, b"\x08\x01" if value else b"\x08\x00")  # bool_param = 1


def with_string_parameter(raw_request: bytes, key: str, value: str) -> bytes:
    """The same with parameters[key].string_param = value."""
    return _with_parameter(raw_request, key, length_delimited(b"\x1a", value.encode()))  # string_param = 3


def _parameter_entry(key: str, param: bytes) -> bytes:
    """A parameters map entry {key: InferParameter ``param`` (serialized)}, as appended bytes."""
    entry = length_delimited(b"\x0a", key.encode()) + length_delimited(b"\x12", param)
    return length_delimited(_REQUEST_PARAMETERS_TAG, entry)


def _with_parameter(raw_request: bytes, key: str, param: bytes) -> bytes:
    """``raw_request`` + a parameters map entry {key: InferParameter ``param`` (serialized)}."""
    return raw_request + _parameter_entry(key, param)


def stream_response(raw_infer_response: bytes) -> bytes:
    """Serialize ModelStreamInferResponse{infer_response} around already-serialized bytes."""
    return length_delimited(STREAM_RESPONSE_INFER_TAG, raw_infer_response)
