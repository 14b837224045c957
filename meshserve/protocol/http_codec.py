"""The HTTP/REST body codec: KServe v2 JSON + Triton's binary tensor extension <-> protobuf.

This is the only place in meshserve that parses or renders HTTP bodies. The internal
representation is the gRPC message (`ModelInferRequest` / `ModelInferResponse`) with every
tensor in `raw_input_contents` / `raw_output_contents`: little-endian, row-major, BYTES as
4-byte little-endian length + bytes per element.

Binary tensors are sliced from the body straight into the protobuf (no numpy on that path);
JSON `data` is converted to raw bytes exactly once. Every client mistake becomes an
`InferError` (INVALID_ARG -> 400) naming the input, never a bare Python exception; a response
that contradicts itself (sizes vs shape) is INTERNAL.

Compression (`Content-Encoding` / `Accept-Encoding`) is applied to the whole body, outside
this framing: frontends call `decode_body` before `parse_infer_request` and `encode_body`
after `render_infer_response`; `Inference-Header-Content-Length` always counts the
uncompressed JSON part (that is what tritonclient expects).
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import orjson
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes, infer_checks, wire
from meshserve.protocol.errors import InferError

__all__ = [
    "HEADER_LENGTH",
    "BodyDecoder",
    "decode_body",
    "encode_body",
    "error_body",
    "model_config_to_json",
    "model_metadata_to_json",
    "parse_header_length",
    "parse_index_request",
    "parse_json_object",
    "parse_trace_settings",
    "parse_infer_request",
    "parse_infer",
    "ForwardedRequest",
    "parse_load_request",
    "parse_system_shm_register",
    "parse_cuda_shm_register",
    "parse_unload_request",
    "render_infer_raw",
    "render_infer_response",
    "repository_index_to_json",
    "server_metadata_to_json",
    "statistics_to_json",
]

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"

# Parameter names of the binary tensor and classification extensions (PROTOCOL.md §2.3, §3.3).
BINARY_DATA_SIZE = "binary_data_size"
BINARY_DATA = "binary_data"
BINARY_DATA_OUTPUT = "binary_data_output"
CLASSIFICATION = "classification"
SHM_REGION = wire.SHM_REGION  # a tensor in a registered shared-memory region (meshserve.server.shm)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT64_MAX = 2**64 - 1
_LEN = struct.Struct("<I")


# --- JSON ----------------------------------------------------------------------------------
# orjson (C) reads inference bodies and writes every body; the stdlib json module keeps the
# rules where orjson differs: orjson refuses NaN / Infinity (tritonclient sends them for
# non-finite floats and reads them back), a UTF-8 BOM, UTF-16/32 bodies and lone surrogates, and
# reads an integer beyond 64 bits as a float (json keeps it exact). So an inference body orjson
# refuses is read by json, and one that the parse then refuses is read again by json, so the
# error is decided on exact integers and worded as before (errors are the rare path); a
# parameter that orjson read as a float holding an integer beyond 64 bits is such an error.
# Control-plane bodies (load, shared memory, trace settings) keep json alone. Measured on the
# add_sub / mlp bodies perf_analyzer sends: docs/perf/json-orjson.md.

_NUMPY = orjson.OPT_SERIALIZE_NUMPY

# The float text of JSON answers (FP16, BF16, FP32, FP64 `data`), the same whatever orjson is
# installed: each element the shortest text that reads back as the same value of the output's
# own type (FP16 and BF16 as the float32 that holds them exactly); an exponent as rapidjson,
# Triton's JSON writer, writes one: `e`, a `-` only when negative, no `+` (1e300, 3.4028235e38,
# 1e-7); NaN, Infinity and -Infinity as those words (rapidjson's kWriteNanAndInfFlag words, which
# tritonclient reads back). orjson 3.13 began writing `1e+300`; orjson writes non-finite floats
# as null. Triton itself writes an FP32 element widened to a double (0.1 as
# 0.10000000149011612): the same float32 when read back, in more bytes.
_EXP_PLUS = b"e+" in orjson.dumps(1e300)


def _float_json(values: np.ndarray | list[Any], dtype: Any = None) -> bytes:
    """A float output's JSON array (a flat array, or the typed contents' values as ``dtype``)."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype)
    data = orjson.dumps(arr, option=_NUMPY)
    # (one-byte needles: a memchr each. A number array's only "+" is an exponent's and its only
    # "n" a null's; `b"e+" in data` and `b"null" in data` took 40k instructions per mlp answer
    # of 512 floats, 5.4 kB: docs/perf/http1-server.md)
    if _EXP_PLUS and b"+" in data:
        data = data.replace(b"e+", b"e")
    if b"n" in data:
        tokens = data[1:-1].split(b",")
        for i in np.flatnonzero(~np.isfinite(arr)):
            v = arr[i]
            tokens[i] = b"NaN" if v != v else (b"Infinity" if v > 0 else b"-Infinity")
        data = b"[" + b",".join(tokens) + b"]"
    return data


_BIG = float(2**63)  # an integral float at least this large may have been an integer literal


class _Inexact(Exception):
    """orjson's reading cannot decide this body: read it again with json."""


def _dumps(obj: Any) -> bytes:
    """Compact JSON: orjson, numpy arrays written straight from their buffers; stdlib json for
    what orjson refuses (a string with a lone surrogate, an integer beyond 64 bits)."""
    try:
        return orjson.dumps(obj, option=_NUMPY)
    except TypeError:
        return json.dumps(_plain(obj), separators=(",", ":")).encode("ascii")


def _plain(obj: Any) -> Any:
    """``obj`` with numpy arrays as lists (for the stdlib encoder). A float output's text
    (_float_json's fragment) becomes its values again: the stdlib writes them as equal doubles
    (the rare path: a response string orjson refuses)."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, orjson.Fragment):
        return json.loads(obj.contents)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


# a `\uD...` escape, or a surrogate's own UTF-8 bytes (ED A0-BF ..: not valid UTF-8, but json.loads
# decodes bytes with "surrogatepass" and takes them)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]|\xed[\xa0-\xbf]")


def _loads(data: bytes | bytearray | memoryview, what: str) -> Any:
    """The exact JSON decoder for request bodies (stdlib json): every failure is INVALID_ARG naming `what`."""
    if isinstance(data, memoryview):
        data = bytes(data)
    try:
        doc = json.loads(data)
    except json.JSONDecodeError as e:
        raise InferError.invalid(f"failed to parse the {what} JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise InferError.invalid(f"failed to parse the {what} JSON: not valid UTF-8 ({e})") from None
    except RecursionError:
        raise InferError.invalid(f"failed to parse the {what} JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than int() takes (sys.int_info)
        raise InferError.invalid(f"failed to parse the {what} JSON: {e}") from None
    # json accepts an escaped lone surrogate ("\ud800"), or its raw UTF-8 bytes, and yields a
    # str that cannot be encoded (into a protobuf field, a gRPC header, a log line). Only those
    # can produce one, so only bodies holding them pay for the walk. (One regex pass: 0.17 us on a
    # binary request's header, where `b"\\ud" in data or ...` took 0.46 us, as `bytes in bytes`
    # first tries the needle as an int and formats a TypeError.)
    if _SURROGATE_ESCAPE.search(data) is not None:
        _check_unicode(doc, what)
    return doc


def _check_unicode(doc: Any, what: str) -> None:
    """INVALID_ARG naming the first string (or key) of `doc` with a lone surrogate."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            items: Iterable[tuple[Any, str]] = ()
            bad = not _encodable(value)
        elif isinstance(value, dict):
            items = ((v, f"{path}.{k}" if path else k) for k, v in value.items())
            bad = False
            for key in value:
                if not _encodable(key):
                    path, bad = f"{path}.{key}" if path else key, True
                    break
        elif isinstance(value, list):
            items = ((v, f"{path}[{i}]") for i, v in enumerate(value) if isinstance(v, (str, list, dict)))
            bad = False
        else:
            continue
        if bad:
            shown = path.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            raise InferError.invalid(
                f"{_tensor_of(doc, path)}the {what} JSON has a string that is not valid Unicode (a lone "
                f"surrogate escape such as \\ud800) at '{shown or '(top level)'}'")
        stack.extend(reversed(list(items)))


def _tensor_of(doc: Any, path: str) -> str:
    """"input 'NAME': " when `path` lies inside request input (or output) NAME, else ""."""
    for key, kind in (("inputs", "input"), ("outputs", "output")):
        if path.startswith(key + "[") and isinstance(doc, dict) and isinstance(doc.get(key), list):
            index = path[len(key) + 1:].split("]", 1)[0]
            item = doc[key][int(index)] if index.isdigit() and int(index) < len(doc[key]) else None
            name = item.get("name") if isinstance(item, dict) else None
            if isinstance(name, str) and _encodable(name):
                return f"{kind} '{name}': "
    return ""


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _show(value: Any) -> str:
    """A short JSON rendering of a client value for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _shape_str(shape: Iterable[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


# --- parameters -------------------------------------------------------------------------

def set_parameter(target: pb.InferParameter, value: Any, where: str, fast: bool = False) -> None:
    """JSON value -> InferParameter (bool, int64 / uint64 by range, double, string; anything else:
    INVALID_ARG naming ``where``). ``fast``: the value was read by orjson, which reads an integer
    beyond 64 bits as a float. The generate extension (generate_codec) and BLS requests
    (services/python/bls.py) carry their parameters by the same rule."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            target.int64_param = value
        elif 0 <= value <= _UINT64_MAX:
            target.uint64_param = value
        else:
            raise InferError.invalid(f"{where}: integer {value} does not fit in 64 bits")
    elif isinstance(value, float):
        if fast and abs(value) >= _BIG and value.is_integer():
            raise _Inexact  # 1e19 (a double) or 10000000000000000000 (refused)? json tells
        target.double_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        raise InferError.invalid(
            f"{where}: unsupported JSON {_json_type(value)} value {_show(value)}; "
            "expected a string, number or boolean")


def _param_value(p: pb.InferParameter) -> Any:
    """InferParameter -> JSON value, None when no member is set."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _param_flag(params: Mapping[str, pb.InferParameter], key: str, default: bool) -> bool:
    """Read a boolean parameter leniently (a gRPC caller may use an int or a string)."""
    p = params.get(key)
    if p is None:
        return default
    value = _param_value(p)
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1")
    return bool(value)


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InferError.invalid(f"{where} must be a JSON object, got {_json_type(value)}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InferError.invalid(f"{where} must be a string, got {_json_type(value)} {_show(value)}")
    return value


def _entry_name(item: Any, what: str, index: int, seen: set[str], repeated: str) -> str:
    """The name of entry ``index`` of a request's 'inputs' or 'outputs' (``what``: "request
    input" or "requested output"), checked: a JSON object whose 'name' is a string not in
    ``seen`` (then added; ``repeated``: the message for a name seen before, {} the name)."""
    if not isinstance(item, dict):
        raise InferError.invalid(f"{what} {index} must be a JSON object, got {_json_type(item)}")
    if "name" not in item:
        raise InferError.invalid(f"{what} {index} has no 'name'")
    name = _string(item["name"], f"{what} {index} 'name'")
    if name in seen:
        raise InferError.invalid(repeated.format(name))
    seen.add(name)
    return name


# --- inference request ------------------------------------------------------------------

def parse_header_length(value: str | None) -> int | None:
    """Parse the `Inference-Header-Content-Length` header value (None when absent)."""
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        raise InferError.invalid(
            f"{HEADER_LENGTH} must be a non-negative integer, got '{value[:40]}'")
    return int(text)


def parse_infer_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    model_name: str,
    model_version: str = "",
) -> pb.ModelInferRequest:
    """Parse a (decompressed) v2 inference request body into a `ModelInferRequest`.

    `header_length` is the `Inference-Header-Content-Length` value (None: the whole body is
    JSON). Binary inputs are sliced, in input order, from the bytes after the JSON header;
    JSON `data` is converted to raw little-endian bytes. Every input ends up in
    `raw_input_contents`, except those in shared memory (`shared_memory_region`): they keep their
    parameters and have no entry, as in a gRPC request. Raises `InferError` (INVALID_ARG).
    """
    view = memoryview(body)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    total = len(view)
    if header_length is None:
        header = view
    elif header_length == 0:  # (the front doors read these with the model's config: raw_binary_request)
        raise InferError.invalid(
            f"a raw binary request ({HEADER_LENGTH}: 0) needs its model's configuration; "
            "send a JSON header describing the input followed by its binary data")
    elif header_length < 0 or header_length > total:
        raise InferError.invalid(
            f"{HEADER_LENGTH} is {header_length} but the request body has only {total} bytes")
    else:
        header = view[:header_length]
    # whole-body JSON: hand bytes/bytearray to the parser as they are (no copy)
    text = body if header is view and isinstance(body, (bytes, bytearray)) else header
    try:
        doc = orjson.loads(text)
    except (orjson.JSONDecodeError, RecursionError):
        pass  # NaN / Infinity, a BOM, UTF-16, a lone surrogate, or an error json words
    else:
        try:
            return _infer_request(doc, view, header_length, len(header), model_name, model_version, True)
        except (InferError, _Inexact):
            pass  # decided on json's exact reading below
    return _infer_request(_loads(text, "request"), view, header_length, len(header), model_name, model_version,
                          False)


# --- the binary request's template ------------------------------------------------------
# A client of the binary extension sends the same JSON header again and again (the same model,
# names, shapes and sizes; only the tensors' bytes differ). The request parse_infer_request makes
# of a body is a function of the header's bytes, the model's name and version, and the binary
# section; and each binary input's raw_input_contents entry is a slice of that section. So the
# first parse of a header is kept as a template: the request serialized without its
# raw_input_contents, and the slices' sizes. The next body with that header (and a binary
# section of the same length) becomes its request by one protobuf parse of the template's bytes
# followed by the slices as raw_input_contents fields (what a gRPC request costs), without
# decoding the JSON or building the message field by field. Headers up to TEMPLATE_MAX_HEADER
# bytes, at most TEMPLATES_MAX templates (all dropped when full: a client that never repeats a
# header costs a parse and a dict entry, as before).

TEMPLATE_MAX_HEADER = 4096
# The bytes a request's tensors may hold once their JSON 'data' is decoded: the process's
# --max-request-bytes (meshserve/server/process.py sets it; the body worker's processes get it in
# their environment). A JSON element can be 2 bytes ("0,") and decode to 4-8: a 61 MiB body of
# zeros became 128 MB of tensors, the gateway's RSS peaked at 527 MiB, and the service refused
# the forwarded message (the client saw 503 "stream to the service broke"). Now 413 before the
# data past the bound is decoded.
DECODED_MAX_ENV = "MESHSERVE_DECODED_MAX"
DECODED_MAX = int(os.environ.get(DECODED_MAX_ENV) or 64 << 20)
TEMPLATES_MAX = 256
_RAW_INPUT_TAG = bytes([(pb.ModelInferRequest.RAW_INPUT_CONTENTS_FIELD_NUMBER << 3) | 2])  # length-delimited


class RenderPlan:
    """One template's requests, as render_infer_response's cache knows them (compared by
    identity: its requests have the same parameters, ids and requested outputs), and whether
    they name a shared-memory region (an input's or requested output's parameter)."""

    __slots__ = ("shared_memory",)

    def __init__(self, request: pb.ModelInferRequest) -> None:
        self.shared_memory = any(SHM_REGION in t.parameters for t in (*request.inputs, *request.outputs))


class _Template:
    __slots__ = ("skeleton", "slices", "binary_bytes", "plan", "id")

    def __init__(self, request: pb.ModelInferRequest) -> None:
        sizes = [len(r) for r in request.raw_input_contents]
        bare = pb.ModelInferRequest()
        bare.CopyFrom(request)
        del bare.raw_input_contents[:]
        self.skeleton = bare.SerializeToString()
        self.slices = tuple((_RAW_INPUT_TAG + wire.varint(n), n) for n in sizes)
        self.binary_bytes = sum(sizes)
        self.plan = RenderPlan(request)
        self.id = request.id  # (the header's: every request of the template has it)


class ForwardedRequest:
    """A templated request whose message is made only when something reads it (``parse_infer``
    with ``forwarded``: a gateway's core that forwards the request's bytes, ``raw``, as they are
    and, on its usual path, reads nothing of the message but its model name, version and id,
    which the template knows). Any other attribute is the message's, parsed from ``raw`` on
    its first read (``message``; a write to a field writes the message). Measured: the upb parse
    of an add_sub request (~1.9 us, docs/perf/side-by-side-round-3.md, "Session 15") was
    every gateway HTTP request's, though the gateway forwards ``raw`` and its pipeline reads the
    request's layout from those bytes. Only a core that says so gets one (the http front end
    asks ``forwards_bytes``: never where a stage passes the message to protobuf itself, as the
    cache's and the A/B routes' copies do)."""

    __slots__ = ("raw", "_name", "_version", "_id", "_message")

    def __init__(self, raw: bytes, name: str, version: str, request_id: str) -> None:
        self.raw = raw
        self._name = name
        self._version = version
        self._id = request_id
        self._message: pb.ModelInferRequest | None = None

    def message(self) -> pb.ModelInferRequest:
        """The request's message (parsed from ``raw`` once)."""
        message = self._message
        if message is None:
            message = self._message = pb.ModelInferRequest.FromString(self.raw)
        return message

    def __getattr__(self, name: str) -> Any:  # (only for names the class does not have: the message's)
        return getattr(self.message(), name)

    # the three fields the template knows, read without the message until it is made (then its
    # own: a write, or a method of the message, may have changed them)
    model_name = property(lambda self: self._name if self._message is None else self._message.model_name,
                          lambda self, value: setattr(self.message(), "model_name", value))
    model_version = property(lambda self: self._version if self._message is None else self._message.model_version,
                             lambda self, value: setattr(self.message(), "model_version", value))
    id = property(lambda self: self._id if self._message is None else self._message.id,
                  lambda self, value: setattr(self.message(), "id", value))


class _Templates(dict[tuple[str, str, bytes], _Template]):
    """The templates by (model name, version, header bytes), and the last one found or made
    (``last``: (name, version, header, template), forgotten with the rest by ``clear``): a
    request of the same name and version whose body starts with that header has that key, so it
    takes the template without the key's slice of the body and its hash (a client's requests
    come with one header: measured in docs/perf/side-by-side-round-3.md, "Session 15")."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[str, str, bytes, _Template] | None = None

    def clear(self) -> None:
        self.last = None
        super().clear()


_templates = _Templates()


def parse_infer(body: bytes | bytearray | memoryview, header_length: int | None, model_name: str,
                model_version: str = "", forwarded: bool = False
                ) -> tuple[pb.ModelInferRequest, RenderPlan | None, bytes | None]:
    """parse_infer_request, through the binary request's template (see above) when the body
    has a binary section, or the JSON request's (below) when it is all JSON. Also returns the
    request's RenderPlan for render_infer_response and, when made from a template, the request
    serialized (what a gateway forwards as it is, as it does a gRPC client's bytes); None for
    either when the body has no template yet. ``forwarded``: a request made from a template
    that names no shared-memory region is a ``ForwardedRequest`` of those bytes (its message
    made only if read)."""
    if header_length is None or header_length == len(body):  # all JSON (perf_analyzer sends the length)
        if header_length != 0 and isinstance(body, (bytes, bytearray)):
            return _parse_json_infer(body, header_length, model_name, model_version, forwarded)
        return parse_infer_request(body, header_length, model_name, model_version), None, None
    if not 0 < header_length <= TEMPLATE_MAX_HEADER or header_length > len(body):
        return parse_infer_request(body, header_length, model_name, model_version), None, None
    view = memoryview(body)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    last = _templates.last
    if last is not None and last[0] == model_name and last[1] == model_version and len(last[2]) == header_length \
            and body.__class__ is bytes and body.startswith(last[2]):  # type: ignore[union-attr]  # (bytes)
        template: _Template | None = last[3]
    else:
        key = (model_name, model_version, bytes(view[:header_length]))
        template = _templates.get(key)
        if template is not None:
            _templates.last = (model_name, model_version, key[2], template)
    if template is not None and len(view) - header_length == template.binary_bytes:
        parts: list[bytes | memoryview] = [template.skeleton]
        offset = header_length
        for prefix, size in template.slices:
            parts.append(prefix)
            parts.append(view[offset:offset + size])
            offset += size
        raw = b"".join(parts)
        if forwarded and not template.plan.shared_memory:
            return ForwardedRequest(raw, model_name, model_version, template.id), template.plan, raw  # type: ignore[return-value]
        return pb.ModelInferRequest.FromString(raw), template.plan, raw
    request = parse_infer_request(view, header_length, model_name, model_version)
    if sum(map(len, request.raw_input_contents)) != len(view) - header_length:
        return request, None, None  # (an input sent as JSON 'data' with elements: not a slice of the body)
    template = _Template(request)
    if len(_templates) >= TEMPLATES_MAX:
        _templates.clear()
    key = (model_name, model_version, bytes(view[:header_length]))
    _templates[key] = template
    _templates.last = (model_name, model_version, key[2], template)
    return request, template.plan, None


# --- the JSON request's template ----------------------------------------------------------
# A client of plain JSON (perf_analyzer's and tritonclient's JSON requests) sends the same
# request again and again but for the numbers in its inputs' 'data'. The request that
# _infer_request makes of a decoded body is a function of the body without those 'data' lists
# (names, datatypes, shapes, parameters, outputs, id) and of each list's own conversion
# (_json_data_to_raw, given the input's datatype and shape). So the orjson document with every
# input's 'data' taken out is the key (orjson.dumps of it: its skeleton, up to
# TEMPLATE_MAX_HEADER bytes), and its first parse is kept: the request serialized without
# raw_input_contents and each input's name, datatype and shape. The next body of that skeleton
# converts its lists only and is one protobuf parse of the skeleton plus the converted bytes as
# raw_input_contents fields (as the binary template). A list that does not convert, or a body
# orjson does not read, is parsed in full (so every error is the full parse's, word for word).
# Measured: docs/perf/json-templates.md.

class _JsonTemplate:
    __slots__ = ("skeleton", "inputs", "plan", "id")

    def __init__(self, request: pb.ModelInferRequest) -> None:
        bare = pb.ModelInferRequest()
        bare.CopyFrom(request)
        del bare.raw_input_contents[:]
        self.skeleton = bare.SerializeToString()
        self.inputs = tuple((f"input '{t.name}'", t.datatype, list(t.shape), datatypes.element_count(t.shape))
                            for t in request.inputs)
        self.plan = RenderPlan(request)
        self.id = request.id  # (the skeleton's: every request of the template has it)


_json_templates: dict[tuple[str, str, bool, bytes], _JsonTemplate] = {}


def _parse_json_infer(body: bytes | bytearray, header_length: int | None, model_name: str,
                      model_version: str, forwarded: bool = False
                      ) -> tuple[pb.ModelInferRequest, RenderPlan | None, bytes | None]:
    """parse_infer of an all-JSON body (its template: see above)."""
    try:
        doc = orjson.loads(body)
        items = doc["inputs"]
        lists = [item.pop("data") for item in items]
        skeleton = orjson.dumps(doc)
    except (orjson.JSONDecodeError, RecursionError, TypeError, KeyError, AttributeError):
        # not JSON orjson reads, not an object with a list of input objects that all have 'data'
        return parse_infer_request(body, header_length, model_name, model_version), None, None
    key = (model_name, model_version, header_length is None, skeleton)
    template = _json_templates.get(key)
    if template is not None:
        parts: list[bytes] = [template.skeleton]
        try:
            for (where, datatype, shape, count), data in zip(template.inputs, lists, strict=True):
                raw = _json_data_to_raw(where, datatype, shape, count, data)
                parts.append(_RAW_INPUT_TAG + wire.varint(len(raw)))
                parts.append(raw)
        except InferError:  # the full parse words it (on json's exact reading where orjson's is refused)
            return parse_infer_request(body, header_length, model_name, model_version), None, None
        serialized = b"".join(parts)
        if forwarded and not template.plan.shared_memory:
            return (ForwardedRequest(serialized, model_name, model_version, template.id),  # type: ignore[return-value]
                    template.plan, serialized)
        return pb.ModelInferRequest.FromString(serialized), template.plan, serialized
    for item, data in zip(items, lists, strict=True):
        item["data"] = data
    try:
        request = _infer_request(doc, memoryview(body), header_length, len(body), model_name, model_version, True)
    except (InferError, _Inexact):  # decided on json's exact reading
        return parse_infer_request(body, header_length, model_name, model_version), None, None
    if len(skeleton) <= TEMPLATE_MAX_HEADER and len(request.raw_input_contents) == len(lists):
        if len(_json_templates) >= TEMPLATES_MAX:
            _json_templates.clear()
        template = _json_templates[key] = _JsonTemplate(request)
        return request, template.plan, None
    return request, None, None


def _infer_request(doc: Any, view: memoryview, header_length: int | None, json_end: int, model_name: str,
                   model_version: str, fast: bool) -> pb.ModelInferRequest:
    """parse_infer_request on the decoded JSON header (``fast``: read by orjson)."""
    total = len(view)
    if not isinstance(doc, dict):
        raise InferError.invalid(f"the request JSON must be an object, got {_json_type(doc)}")

    req = pb.ModelInferRequest(model_name=model_name, model_version=model_version)
    if "id" in doc:
        req.id = _string(doc["id"], "request 'id'")
    for key, value in _parameters(doc.get("parameters"), "request 'parameters'", "the request").items():
        if key == BINARY_DATA_OUTPUT and not isinstance(value, bool):
            raise InferError.invalid(
                f"request parameter '{BINARY_DATA_OUTPUT}' must be a boolean, got {_show(value)}")
        set_parameter(req.parameters[key], value, f"request parameter '{key}'", fast)

    if "inputs" not in doc:
        raise InferError.invalid("the request JSON has no 'inputs'")
    inputs = doc["inputs"]
    if not isinstance(inputs, list):
        raise InferError.invalid(f"request 'inputs' must be a JSON array, got {_json_type(inputs)}")
    if len(inputs) > infer_checks.MAX_TENSORS:
        raise infer_checks.too_many("the request", len(inputs), "inputs", infer_checks.MAX_TENSORS)

    offset = json_end  # next unread byte of the binary section
    parameters = len(req.parameters)  # the request's and its tensors' (at most MAX_PARAMETERS_TOTAL)
    decoded = 0  # bytes of the tensors decoded from JSON 'data' so far (at most DECODED_MAX)
    strings = 0  # BYTES elements by the shapes so far (at most MAX_BYTES_ELEMENTS, as a service counts them)
    last_binary = ""
    seen: set[str] = set()
    raw = req.raw_input_contents
    for index, item in enumerate(inputs):
        name = _entry_name(item, "request input", index, seen, "input '{}' already exists in request")  # (Triton's words)
        where = f"input '{name}'"
        datatype, shape = _parse_tensor_spec(item, where)

        tensor = req.inputs.add(name=name, datatype=datatype, shape=shape)
        params = _parameters(item.get("parameters"), f"{where} 'parameters'", where)
        parameters = _counted(parameters + len(params), infer_checks.PARAMETERS_IN_ALL)
        binary_size: int | None = None
        for key, value in params.items():
            if key == BINARY_DATA_SIZE:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InferError.invalid(
                        f"{where}: '{BINARY_DATA_SIZE}' must be a non-negative integer, got {_show(value)}")
                binary_size = value
            else:
                set_parameter(tensor.parameters[key], value, f"{where} parameter '{key}'", fast)

        count = datatypes.element_count(shape)
        if datatype == "BYTES":  # (before any of its strings is decoded)
            strings += count
            infer_checks.check_bytes_elements(strings, where)
        if SHM_REGION in params:
            # in a shared-memory region: no data here and no raw_input_contents entry (as a gRPC
            # client sends it); meshserve.server.shm reads it into the request
            if binary_size is not None or "data" in item:
                raise InferError.invalid(
                    f"{where} has '{SHM_REGION}' and also "
                    f"{'data' if 'data' in item else BINARY_DATA_SIZE}; send the tensor one way")
        elif binary_size is not None:
            if "data" in item:
                raise InferError.invalid(
                    f"{where} has both 'data' and a '{BINARY_DATA_SIZE}' parameter; send one of them")
            size = datatypes.element_size(datatype)
            if size and binary_size != count * size:
                raise InferError.invalid(
                    f"{where}: {BINARY_DATA_SIZE} is {binary_size} bytes but shape {_shape_str(shape)} "
                    f"of {datatype} needs {count * size}")
            if header_length is None and binary_size:
                raise InferError.invalid(
                    f"{where} has {BINARY_DATA_SIZE} {binary_size} but the request has no "
                    f"{HEADER_LENGTH} header, so the whole body was read as JSON")
            if offset + binary_size > total:
                raise InferError.invalid(
                    f"{where}: {BINARY_DATA_SIZE} is {binary_size} bytes but only {total - offset} "
                    f"bytes of binary data are left in the request body (truncated body?)")
            raw.append(bytes(view[offset:offset + binary_size]))
            offset += binary_size
            last_binary = name
        elif "data" in item:
            size = datatypes.element_size(datatype) or 4  # (BYTES: its 4-byte length prefixes at least)
            if decoded + count * size > DECODED_MAX:
                raise _decoded_past(where)
            raw.append(_json_data_to_raw(where, datatype, shape, count, item["data"]))
            decoded += len(raw[-1])
            if decoded > DECODED_MAX:  # (BYTES elements: their length known once decoded)
                raise _decoded_past(where)
        else:
            raise InferError.invalid(
                f"{where} has neither 'data' nor a '{BINARY_DATA_SIZE}' parameter")

    if offset != total:
        extra = total - offset
        if last_binary:
            raise InferError.invalid(
                f"the request body has {extra} bytes after the binary data of the last binary "
                f"input '{last_binary}'; the {BINARY_DATA_SIZE} values do not add up to the body")
        raise InferError.invalid(
            f"the request body has {extra} bytes after the JSON header but no input has a "
            f"'{BINARY_DATA_SIZE}' parameter")

    outputs = doc.get("outputs")
    if outputs is not None:
        _counted(parameters + _parse_requested_outputs(req, outputs, fast), infer_checks.PARAMETERS_IN_ALL)
    return req


def _parameters(value: Any, where: str, whose: str) -> dict[str, Any]:
    """``_object(value, where)``, a JSON 'parameters' object, of at most MAX_PARAMETERS keys
    (``whose``: the request or tensor named in the refusal)."""
    params = _object(value, where)
    if len(params) > infer_checks.MAX_PARAMETERS:
        raise infer_checks.too_many(whose, len(params), "parameters", infer_checks.MAX_PARAMETERS)
    return params


def _counted(parameters: int, what: str) -> int:
    """``parameters``, the request's counted so far, while they are at most MAX_PARAMETERS_TOTAL."""
    if parameters > infer_checks.MAX_PARAMETERS_TOTAL:
        raise infer_checks.too_many("the request", parameters, what, infer_checks.MAX_PARAMETERS_TOTAL)
    return parameters


def _decoded_past(where: str) -> InferError:
    return InferError.too_large(f"{where}: the request's tensors decode to more than {DECODED_MAX} bytes "
                                f"(--max-request-bytes)")


def _parse_tensor_spec(item: dict[str, Any], where: str) -> tuple[str, list[int]]:
    if "datatype" not in item:
        raise InferError.invalid(f"{where} has no 'datatype'")
    datatype = _string(item["datatype"], f"{where} 'datatype'")
    if not datatypes.is_valid(datatype):
        raise InferError.invalid(
            f"{where}: unknown datatype '{datatype}'; expected one of {', '.join(datatypes.DATATYPES)}")
    if "shape" not in item:
        raise InferError.invalid(f"{where} has no 'shape'")
    shape = item["shape"]
    if isinstance(shape, list) and len(shape) > infer_checks.MAX_DIMS:
        raise infer_checks.too_many(where, len(shape), "dimensions in its shape", infer_checks.MAX_DIMS)
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _INT64_MAX for d in shape):
        raise InferError.invalid(
            f"{where}: 'shape' must be an array of non-negative integers, got {_show(shape)}")
    return datatype, shape


def _parse_requested_outputs(req: pb.ModelInferRequest, outputs: Any, fast: bool) -> int:
    """The requested outputs into ``req``; returns how many parameters they have."""
    if not isinstance(outputs, list):
        raise InferError.invalid(f"request 'outputs' must be a JSON array, got {_json_type(outputs)}")
    if len(outputs) > infer_checks.MAX_TENSORS:
        raise infer_checks.too_many("the request", len(outputs), "requested outputs", infer_checks.MAX_TENSORS)
    seen: set[str] = set()
    parameters = 0
    for index, item in enumerate(outputs):
        # (a name twice: Triton's words since its core refuses it, 2026-04; 2.51 answered it once)
        name = _entry_name(item, "requested output", index, seen, "output '{}' already exists in request")
        where = f"output '{name}'"
        params = _parameters(item.get("parameters"), f"{where} 'parameters'", where)
        parameters = _counted(parameters + len(params), "parameters in its requested outputs")
        out = req.outputs.add(name=name)
        for key, value in params.items():
            if key == BINARY_DATA and not isinstance(value, bool):
                raise InferError.invalid(f"{where}: '{BINARY_DATA}' must be a boolean, got {_show(value)}")
            if key == CLASSIFICATION and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InferError.invalid(
                    f"{where}: '{CLASSIFICATION}' must be a non-negative integer, got {_show(value)}")
            set_parameter(out.parameters[key], value, f"{where} parameter '{key}'", fast)
    return parameters


# --- JSON data -> raw bytes -------------------------------------------------------------

def _flatten(data: list[Any]) -> list[Any]:
    """Row-major leaves of a nested JSON array (iterative: no recursion limit)."""
    leaves: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            leaves.append(item)
        else:
            stack.pop()
    return leaves


def _check_count(where: str, shape: list[int], count: int, got: int) -> None:
    if got != count:
        raise InferError.invalid(
            f"{where}: shape {_shape_str(shape)} needs {count} elements, got {got} in 'data'")


def _json_data_to_raw(where: str, datatype: str, shape: list[int], count: int, data: Any) -> bytes:
    if not isinstance(data, list):
        raise InferError.invalid(f"{where}: 'data' must be a JSON array, got {_json_type(data)}")
    if datatype == "BYTES":
        leaves = _flatten(data)
        _check_count(where, shape, count, len(leaves))
        return _strings_to_raw(where, leaves)
    if datatype == "BF16":
        raise InferError.invalid(f"{where}: BF16 tensors must be sent as binary data, not JSON 'data'")
    if data and datatype in _FLOAT_TARGETS and type(data[0]) is not bool:
        raw = _floats_to_raw(datatype, count, data)
        if raw is not None:
            return raw
    return _numbers_to_raw(where, datatype, shape, count, data)


# A flat list for a float type is packed by a struct (floats, ints and bools, as np.array reads
# them; anything else is a struct.error or a TypeError) without np.array's look at each element's
# type. Its bytes are np.array(data)'s when that would not have been all-bool (the first element
# is not a bool) and no integer lost digits as a double (every value below 2**53, so an
# all-integer list cast to the float type rounds once, as from int64); otherwise, or for any
# other count, the general path decides. From _FLOATS_MIN elements a struct of native doubles
# packs the list and numpy checks and casts it; below it (FP32 and FP64: FP16 takes the general
# path) the checks are min / max of the list and a struct of the type itself packs it (a C
# cast from the double, as numpy's astype). Instructions (callgrind, a list of 512 floats):
# np.array(data) 177,697, np.array(data, float64) 138,541 (and it takes strings), array("d") +
# frombuffer 117,940 (array("d") reads each element with PyArg_Parse); Struct.pack took 512 floats
# in 4.4 µs where array("d") took 11.4, and a list of 16 in 0.36 µs where np.array and its
# checks took 2.5 (docs/perf/http1-server.md).
_FLOATS_MIN = 128
_FLOAT_TARGETS = frozenset({"FP16", "FP32", "FP64"})
_EXACT_INT = float(2**53)
_PACKERS: dict[tuple[str, int], struct.Struct] = {}  # (format letter, count) -> its Struct (at most _PACKERS_MAX)
_PACKERS_MAX = 64
_SMALL_FORMATS = {"FP32": "f", "FP64": "d"}


def _packer(letter: str, count: int) -> struct.Struct:
    packer = _PACKERS.get((letter, count))
    if packer is None:
        if len(_PACKERS) >= _PACKERS_MAX:
            _PACKERS.clear()
        packer = _PACKERS[letter, count] = struct.Struct(f"{count}{letter}")  # (native: numpy's order)
    return packer


def _floats_to_raw(datatype: str, count: int, data: list[Any]) -> bytes | None:
    if len(data) != count:
        return None
    if count < _FLOATS_MIN:
        letter = _SMALL_FORMATS.get(datatype)
        if letter is None:
            return None
        try:
            # exact as doubles (an Infinity fails; a NaN is skipped by min and max, or fails as their
            # first element, and converts as numpy converts it: a C cast either way)
            if not (-_EXACT_INT < min(data) and max(data) < _EXACT_INT):
                return None
            return _packer(letter, count).pack(*data)
        except (struct.error, TypeError, OverflowError):  # not all numbers (or nested)
            return None
    try:
        arr = np.frombuffer(_packer("d", count).pack(*data), np.float64)
    except (struct.error, TypeError, OverflowError):  # not all numbers (or nested, or an int beyond a double)
        return None
    top = np.abs(arr).max()
    if not top < _EXACT_INT:  # (NaN / Infinity, from json's reading: the general path)
        return None
    if datatype == "FP64":
        return arr.tobytes()
    if datatype == "FP16" and top > _FLOAT_MAX["FP16"]:
        return None
    return arr.astype(datatypes.numpy_dtype(datatype)).tobytes()


def _numbers_to_raw(where: str, datatype: str, shape: list[int], count: int, data: list[Any]) -> bytes:
    """_json_data_to_raw of a number type (not BYTES, not BF16)."""
    # Fast path: let numpy infer a regular array and accept it when its kind fits the
    # datatype; anything unusual (ragged nesting, nulls, strings, floats for an integer
    # type, out-of-range values) goes through the element-wise path for a precise message.
    target = datatypes.numpy_dtype(datatype)
    try:
        arr: np.ndarray | None = np.array(data)
    except (ValueError, TypeError, OverflowError):
        arr = None
    if arr is None or arr.dtype.kind not in "biuf":
        leaves = _flatten(data)
        _check_count(where, shape, count, len(leaves))
        return _leaves_to_raw(where, datatype, target, leaves)
    _check_count(where, shape, count, arr.size)
    if count == 0:
        return b""
    kind = arr.dtype.kind
    if datatype == "BOOL":
        if kind == "b":
            return arr.astype(target, copy=False).tobytes()
    elif target.kind in "iu":
        if kind in "iu":
            info = np.iinfo(target)
            if arr.min() >= info.min and arr.max() <= info.max:
                return arr.astype(target).tobytes()
    elif kind in "iuf":
        if kind == "f" and (datatype == "FP64" or np.abs(arr).max() <= _FLOAT_MAX[datatype]):
            return arr.astype(target).tobytes()  # finite and in range: the cast cannot overflow
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(target)
        if datatype != "FP64":
            _check_float_range(where, datatype, arr, out)
        return out.tobytes()
    return _leaves_to_raw(where, datatype, target, _flatten(data))


_FLOAT_MAX = {"FP16": float(np.finfo(np.float16).max), "FP32": float(np.finfo(np.float32).max)}


def _leaves_to_raw(where: str, datatype: str, target: np.dtype, leaves: list[Any]) -> bytes:
    """Element-wise validation + conversion; raises naming the first offending element."""
    if datatype == "BOOL":
        for i, v in enumerate(leaves):
            if not isinstance(v, bool):
                raise InferError.invalid(
                    f"{where}: element {i} of 'data' is {_show(v)}; BOOL data must be true/false")
    elif target.kind in "iu":
        info = np.iinfo(target)
        lo, hi = int(info.min), int(info.max)
        for i, v in enumerate(leaves):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InferError.invalid(
                    f"{where}: element {i} of 'data' is {_show(v)}; {datatype} data must be integers")
            if not lo <= v <= hi:
                raise InferError.invalid(
                    f"{where}: element {i} of 'data' ({v}) is out of range for {datatype} [{lo}, {hi}]")
    else:
        for i, v in enumerate(leaves):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InferError.invalid(
                    f"{where}: element {i} of 'data' is {_show(v)}; {datatype} data must be numbers")
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            arr = np.array(leaves, dtype=np.float64 if target.kind == "f" else target)
            out = arr.astype(target)
    except OverflowError as e:  # a Python int beyond float64
        raise InferError.invalid(f"{where}: a value in 'data' is out of range for {datatype} ({e})") from None
    if target.kind == "f" and datatype != "FP64":
        _check_float_range(where, datatype, arr, out)
    return out.tobytes()


def _check_float_range(where: str, datatype: str, src: np.ndarray, out: np.ndarray) -> None:
    """Reject finite values that overflow to +-inf when narrowed (FP16/FP32)."""
    infinite = np.isinf(out)
    if not infinite.any():  # (the common case: one test)
        return
    overflow = infinite & ~np.isinf(src)
    if overflow.any():
        i = int(np.flatnonzero(overflow.ravel())[0])
        raise InferError.invalid(
            f"{where}: element {i} of 'data' ({src.ravel()[i].item()}) is out of range for {datatype}")


def _strings_to_raw(where: str, leaves: list[Any]) -> bytes:
    parts: list[bytes] = []
    pack = _LEN.pack
    for i, v in enumerate(leaves):
        if not isinstance(v, str):
            raise InferError.invalid(
                f"{where}: element {i} of 'data' is {_show(v)}; BYTES data must be JSON strings")
        try:
            b = v.encode("utf-8")
        except UnicodeEncodeError:
            raise InferError.invalid(
                f"{where}: element {i} of 'data' is not valid Unicode (lone surrogate escape)") from None
        parts.append(pack(len(b)))
        parts.append(b)
    return b"".join(parts)


# --- inference response -----------------------------------------------------------------

# datatype -> InferTensorContents field holding it (FP16/BF16 have none: raw only)
_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# the datatype Triton names a contents field by, when it does not match the input's
_CONTENTS_KIND = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
                  "uint_contents": "UINT32", "uint64_contents": "UINT64", "fp32_contents": "FP32",
                  "fp64_contents": "FP64", "bytes_contents": "BYTES"}


def typed_to_bytes(t: pb.ModelInferRequest.InferInputTensor, model: str) -> bytes:
    """An input's typed InferTensorContents (KServe SDK, hand-written stubs) as raw little-endian
    bytes (BYTES: length-prefixed), as raw_input_contents would carry them."""
    field_name = _CONTENTS_FIELD.get(t.datatype)
    if field_name is None:
        raise InferError.invalid(
            f"input '{t.name}' for model '{model}': datatype {t.datatype} cannot travel in typed "
            "contents; use raw_input_contents")
    for descriptor, _ in t.contents.ListFields():  # (the fields that hold values)
        if descriptor.name != field_name:  # Triton's check and words (grpc/infer_handler.cc)
            kind = _CONTENTS_KIND[descriptor.name]
            raise InferError.invalid(
                f"unexpected explicit tensor data for input tensor '{t.name}' for model '{model}' of type "
                f"'{kind}', expected datatype '{t.datatype}'")
    values = getattr(t.contents, field_name)
    if t.datatype == "BYTES":
        return datatypes.serialize_bytes(values)
    try:
        return np.asarray(values, dtype=datatypes.numpy_dtype(t.datatype)).tobytes()
    except (OverflowError, ValueError) as exc:
        raise InferError.invalid(f"input '{t.name}' for model '{model}': {exc}") from None


def _typed_size(t: pb.ModelInferRequest.InferInputTensor) -> int:
    """The bytes typed_to_bytes would make of ``t``'s contents (0 where it refuses them)."""
    field_name = _CONTENTS_FIELD.get(t.datatype)
    if field_name is None:
        return 0
    values = getattr(t.contents, field_name)
    size = datatypes.element_size(t.datatype)
    return len(values) * size if size else 4 * len(values) + sum(map(len, values))


def parse_grpc_infer_request(body: bytes | bytearray | list[bytes]) -> pb.ModelInferRequest:
    """A gRPC ModelInferRequest whose parse would hold the event loop (infer_checks.heavy), read
    in the body worker: parsed, its parts counted (infer_checks.check_counts), its unknown fields
    dropped, and typed contents moved to raw_input_contents (a request of typed contents only;
    with raw ones too it is Triton's error), so that the message the worker sends back parses at
    memcpy speed: repeated fields made one, map keys once, numbers packed, BYTES elements one
    buffer per input."""
    return _checked_grpc_request(_parsed_grpc_request(body))


class Refused(NamedTuple):
    """A ModelStreamInfer message that parsed but was refused (``parse_grpc_stream_request``):
    what its answer in band needs."""

    code: str
    message: str
    id: str
    model_name: str
    model_version: str


def parse_grpc_stream_request(body: bytes | bytearray | list[bytes]) -> pb.ModelInferRequest | Refused:
    """``parse_grpc_infer_request`` for a message of a ModelStreamInfer call: one that parses but
    is refused (its counts, its typed contents) comes back as a ``Refused``, to be answered in
    band as the stream's other refused messages are, and the stream goes on; a malformed one
    raises (the stream ends, as it does for a failed parse read in place)."""
    request = _parsed_grpc_request(body)
    try:
        return _checked_grpc_request(request)
    except InferError as exc:
        return Refused(exc.code.value, exc.message, request.id, request.model_name, request.model_version)


def _parsed_grpc_request(body: bytes | bytearray | list[bytes]) -> pb.ModelInferRequest:
    raw = b"".join(body) if isinstance(body, list) else body
    try:
        return pb.ModelInferRequest.FromString(raw)
    except Exception as exc:
        raise InferError.invalid(f"malformed ModelInferRequest: {exc}") from None


def _checked_grpc_request(request: pb.ModelInferRequest) -> pb.ModelInferRequest:
    infer_checks.check_counts(request)
    infer_checks.reject_mixed_contents(request)
    request.DiscardUnknownFields()
    inputs = request.inputs
    if not request.raw_input_contents and any(t.HasField("contents") for t in inputs):
        model = request.model_name
        # (a packed zero is 1 byte and an INT64 8 decoded: what the raw tensors would hold is
        # bounded as JSON data is, before any is made)
        if (total := sum(_typed_size(t) for t in inputs if t.HasField("contents"))) > DECODED_MAX:
            raise InferError.too_large(f"the request's typed contents hold {total} bytes as tensors, more than "
                                       f"{DECODED_MAX} (--max-request-bytes)")
        request.raw_input_contents.extend(
            typed_to_bytes(t, model) if t.HasField("contents") else b""
            for t in inputs if SHM_REGION not in t.parameters)
        for t in inputs:
            t.ClearField("contents")
    return request


def parse_grpc_message(body: bytes | bytearray | list[bytes], type_name: str) -> bytes:
    """A unary request of the inference service other than ModelInfer (``type_name``: its
    message type in grpc_service.proto) over infer_checks.COUNT_FROM bytes, read in the body
    worker: parsed, its maps and repeated fields (nested too) at most MAX_PARAMETERS entries,
    unknown fields dropped, sent back serialized (one entry per key: it parses at memcpy speed).
    A million parameters of a model load held a gateway's loop 1.5 s on the loop's own parse and
    walk of them."""
    kind = getattr(pb, type_name, None)
    if kind is None or not isinstance(kind, type) or not issubclass(kind, Message):
        raise InferError.invalid(f"no request type {type_name!r}")
    message = kind()
    try:
        message.ParseFromString(b"".join(body) if isinstance(body, list) else body)
    except Exception as exc:
        raise InferError.invalid(f"Exception deserializing request: {exc}") from None
    infer_checks.check_message_counts(message)
    message.DiscardUnknownFields()
    return message.SerializeToString()  # type: ignore[no-any-return]


# A response of binary outputs only, with no parameters and no id, is rendered from its
# request's RenderPlan and its outputs' names, datatypes and shapes: the same header again for
# every request of a template. Such headers are kept (at most RENDERED_MAX, all dropped when
# full); the next response with the same key is its header plus its outputs' bytes (after
# checking their sizes, as the full rendering does).
#
# A response of JSON outputs only (with no parameters and no id either) is kept the same way as
# the pieces of its body around each output's 'data' (_JsonRendered): the next one with the same
# key is those pieces around each output's numbers as the full rendering writes them
# (_raw_to_json, then _float_json for a float output).
RENDERED_MAX = 256
_Rendered = tuple[bytes, tuple[int, ...], str]
_rendered: dict[tuple[Any, ...], _Rendered | _JsonRendered] = {}
_JSON_HEADERS = {"Content-Type": JSON_CONTENT_TYPE}
_SLOT = "\x00"  # an output's data in the skeleton _JsonRendered splits (orjson writes "\u0000")


class _JsonRendered:
    __slots__ = ("pieces", "outputs")

    def __init__(self, pieces: list[bytes], outputs: list[tuple[str, str, list[int], bool, np.dtype | None, int]]
                 ) -> None:
        self.pieces = pieces  # len(outputs) + 1: the body around each output's data
        # per output: where, datatype, shape, a float type, and for a type whose bytes orjson
        # writes as they are (not BYTES, BF16, FP16) its numpy dtype and byte size
        self.outputs = outputs

    @classmethod
    def of(cls, response: pb.ModelInferResponse, request: pb.ModelInferRequest,
           body: bytes) -> _JsonRendered | None:
        """The pieces of ``body`` (_render's of ``response``: all outputs JSON, no id, no parameters),
        when the pieces and this response's numbers make that body again."""
        outputs = response.outputs
        doc = {"model_name": response.model_name or request.model_name,
               "model_version": response.model_version or request.model_version,
               "outputs": [{"name": o.name, "datatype": o.datatype, "shape": list(o.shape), "data": _SLOT}
                           for o in outputs]}
        pieces = orjson.dumps(doc).split(b'"\\u0000"')
        if len(pieces) != len(outputs) + 1:
            return None  # (a name with a NUL in it)
        described = []
        for o in outputs:
            plain = o.datatype not in ("BYTES", "BF16", "FP16") and datatypes.is_valid(o.datatype)
            dtype = datatypes.numpy_dtype(o.datatype) if plain else None
            size = datatypes.element_count(o.shape) * dtype.itemsize if dtype is not None else 0
            described.append((f"output '{o.name}'", o.datatype, list(o.shape), o.datatype in _FLOAT_TYPES, dtype, size))
        template = cls(pieces, described)
        return template if template.render(response.raw_output_contents) == body else None

    def render(self, raws: Any) -> bytes | None:
        """The body of these outputs' bytes, None where only the full rendering can tell."""
        pieces = self.pieces
        parts = [pieces[0]]
        for i, (where, datatype, shape, floating, dtype, size) in enumerate(self.outputs):
            raw = raws[i]
            if dtype is None:
                values = _raw_to_json(where, datatype, shape, raw)
            elif len(raw) == size:  # (_raw_to_json's check and array, without its look-ups)
                values = np.frombuffer(raw, dtype)
            else:
                return None  # the full rendering words it
            parts.append(_float_json(values) if floating else orjson.dumps(values, option=_NUMPY))
            parts.append(pieces[i + 1])
        return b"".join(parts)


def render_infer_response(
    response: pb.ModelInferResponse, request: pb.ModelInferRequest, plan: RenderPlan | None = None
) -> tuple[bytes, dict[str, str]]:
    """Render a `ModelInferResponse` as an HTTP body plus the headers it needs.

    Per output, binary vs JSON follows the requested output's `binary_data` parameter, else
    the request's `binary_data_output` (default false). Binary outputs carry only
    `parameters.binary_data_size` and follow the JSON in output order, with
    `Inference-Header-Content-Length`; JSON-only bodies carry no output `parameters`.
    Reads `raw_output_contents` or, when that is empty, typed `contents`. An output written
    to shared memory (its `shared_memory_region` parameter) has its name, datatype and shape only.
    """
    outputs = response.outputs
    key: tuple[Any, ...] | None = None
    if plan is not None and not response.parameters:
        # each output's name, datatype, shape and parameters as its serialized bytes: one C call
        # each (the tuple of name, datatype, tuple(shape) and len(parameters) it replaces cost
        # 13k more instructions per add_sub request: docs/perf/json-templates.md)
        key = (plan, response.model_name, response.model_version, response.id,
               *[o.SerializeToString() for o in outputs])
        hit = _rendered.get(key)
        if hit is not None:
            done = _from_kept(hit, response.raw_output_contents if isinstance(hit, _JsonRendered)
                              else list(response.raw_output_contents))
            if done is not None:
                return done
    body, headers = _render(response, request)
    if key is not None and not (response.id or request.id) and all(not o.parameters for o in outputs):
        _keep_rendered(key, response, request, body, headers)
    return body, headers


def _from_kept(hit: _Rendered | _JsonRendered, raws: Any) -> tuple[bytes, dict[str, str]] | None:
    """The body and headers of a kept rendering with these outputs' bytes (a sequence of bytes,
    or for a binary one of buffers); None where only the full rendering can tell."""
    if isinstance(hit, _JsonRendered):
        if len(raws) == len(hit.outputs):
            try:
                rendered = hit.render(raws)
            except (InferError, TypeError):  # the full rendering words it
                return None
            if rendered is not None:
                return rendered, _JSON_HEADERS.copy()
        return None
    header, sizes, header_length = hit
    if tuple(map(len, raws)) == sizes:
        return b"".join([header, *raws]), {HEADER_LENGTH: header_length, "Content-Type": BINARY_CONTENT_TYPE}
    return None


# --- a serialized answer rendered without its message ---------------------------------------
# A gateway holds most answers as the bytes its service sent (or as split cut them from a merged
# one): model_name (field 1), model_version (2) and the outputs (5), then one raw_output_contents
# (6) per output. For such bytes the key of a kept rendering is the plan and the bytes before the
# first raw_output_contents (they decide the model, its version and the outputs' names, types,
# shapes and parameters: what render_infer_response's key holds), and the outputs' bytes are
# slices of the answer: no message is made, and nothing serialized again to make the key.
# Bytes with any other field (an id, parameters, an unknown field) or in another order are
# rendered from their message, and so are bytes whose part before the data is over
# TEMPLATE_MAX_HEADER (the key kept). Measured: docs/perf/http1-server.md.
_HEAD_TAGS = frozenset((0x0A, 0x12, 0x2A))  # model_name, model_version, outputs (length-delimited)
_RAW_OUTPUT_TAG = 0x32  # raw_output_contents (length-delimited)
_raw_rendered: dict[tuple[RenderPlan, bytes], _Rendered | _JsonRendered] = {}


def _output_spans(raw: bytes) -> tuple[int, list[tuple[int, int]]] | None:
    """(where the first raw_output_contents starts, each one's data as (start, end)) of a
    serialized ModelInferResponse of the form above, else None."""
    n = len(raw)
    at = 0
    first = -1
    spans: list[tuple[int, int]] = []
    while at < n:
        tag = raw[at]
        if at + 1 >= n:
            return None
        size = raw[at + 1]
        start = at + 2
        if size >= 0x80:  # a longer length varint
            size, start = wire.varint_at(raw, at + 1, n)
            if size < 0:
                return None
        end = start + size
        if end > n:
            return None
        if tag == _RAW_OUTPUT_TAG:
            if first < 0:
                first = at
            spans.append((start, end))
        elif first >= 0 or tag not in _HEAD_TAGS:
            return None
        at = end
    return (first, spans) if first >= 0 else None


# The last answer's structure (render_infer_raw): its plan, size, the bytes before the first
# raw_output_contents, each raw_output_contents' tag and length bytes (where, what), the spans
# and the kept rendering. An answer of the same plan and size with those bytes at those places
# is walked by _output_spans to the same spans and key: neither is made again. One kept.
_raw_last: tuple[RenderPlan, int, bytes, tuple[tuple[int, bytes], ...], list[tuple[int, int]],
                 _Rendered | _JsonRendered] | None = None


def _raw_learn(plan: RenderPlan, raw: bytes, head: bytes, spans: list[tuple[int, int]],
               hit: _Rendered | _JsonRendered) -> None:
    global _raw_last
    prefixes = []
    at = len(head)
    for start, end in spans:  # (_output_spans: they follow one another to the end of raw)
        prefixes.append((at, raw[at:start]))
        at = end
    _raw_last = (plan, len(raw), head, tuple(prefixes), spans, hit)


def render_infer_raw(raw: bytes, request: pb.ModelInferRequest, plan: RenderPlan
                     ) -> tuple[bytes, dict[str, str]] | None:
    """render_infer_response of the serialized answer ``raw`` (see above), without its message
    when a rendering of its kind is kept; None for bytes not of that form (the caller renders
    the message: it may have parameters to read)."""
    hit: _Rendered | _JsonRendered | None
    last = _raw_last
    same = False
    if last is not None and last[0] is plan and len(raw) == last[1] and raw.startswith(last[2]):
        same = True
        for at, prefix in last[3]:  # (a loop, not all() of a generator: a frame per answer and output)
            if not raw.startswith(prefix, at):
                same = False
                break
    if same:
        spans, hit = last[4], last[5]  # type: ignore[index]  # (the same structure as the last: its spans and key)
    else:
        found = _output_spans(raw)
        if found is None or found[0] > TEMPLATE_MAX_HEADER:  # (a key of at most that many bytes is kept)
            return None
        first, spans = found
        key = (plan, raw[:first])
        hit = _raw_rendered.get(key)
        if hit is not None:
            _raw_learn(plan, raw, key[1], spans, hit)
    if hit is not None:
        if isinstance(hit, _JsonRendered):
            done = _from_kept(hit, [raw[a:b] for a, b in spans])
        else:
            view = memoryview(raw)
            done = _from_kept(hit, [view[a:b] for a, b in spans])
        if done is not None:
            return done
    response = pb.ModelInferResponse.FromString(raw)
    rendered = render_infer_response(response, request, plan)
    kept = _rendered.get((plan, response.model_name, response.model_version, response.id,
                          *[o.SerializeToString() for o in response.outputs]))  # (render_infer_response's key)
    if kept is not None and hit is None:
        if len(_raw_rendered) >= RENDERED_MAX:
            _raw_rendered.clear()
        _raw_rendered[key] = kept
    return rendered


def _keep_rendered(key: tuple[Any, ...], response: pb.ModelInferResponse, request: pb.ModelInferRequest,
                   body: bytes, headers: dict[str, str]) -> None:
    """Keep the rendering of ``body`` for ``key`` when all its outputs are binary or all JSON
    (none with parameters, no id: render_infer_response checked)."""
    raws = list(response.raw_output_contents)
    if not raws or len(raws) != len(response.outputs):
        return
    length = headers.get(HEADER_LENGTH)
    kept: _Rendered | _JsonRendered | None = None
    if length is not None:
        sizes = tuple(map(len, raws))
        if len(body) == int(length) + sum(sizes):  # every output binary: the header and all of them
            kept = (body[:int(length)], sizes, length)
    else:
        kept = _JsonRendered.of(response, request, body)
    if kept is not None:
        if len(_rendered) >= RENDERED_MAX:
            _rendered.clear()
        _rendered[key] = kept


def _render(response: pb.ModelInferResponse, request: pb.ModelInferRequest) -> tuple[bytes, dict[str, str]]:
    default_binary = _param_flag(request.parameters, BINARY_DATA_OUTPUT, False)
    requested = {o.name: o for o in request.outputs}
    raws = list(response.raw_output_contents)
    outputs = response.outputs
    if raws and len(raws) != len(outputs):
        raise InferError.internal(
            f"response of model '{response.model_name}' has {len(outputs)} outputs but "
            f"{len(raws)} raw_output_contents")

    rendered: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for i, out in enumerate(outputs):
        shape = list(out.shape)
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": shape}
        if out.parameters and SHM_REGION in out.parameters:
            # written to shared memory: metadata only, no parameters either, as Triton answers
            # (perf_analyzer's HTTP client reads `binary_data_size` of any output with parameters)
            rendered.append(entry)
            continue
        binary = default_binary
        req_out = requested.get(out.name)
        if req_out is not None:
            binary = _param_flag(req_out.parameters, BINARY_DATA, default_binary)
        where = f"output '{out.name}'"
        if binary:
            data = raws[i] if raws else _contents_to_raw(where, out)
            _check_raw_size(where, out.datatype, shape, data)
            entry["parameters"] = {BINARY_DATA_SIZE: len(data)}
            blobs.append(data)
        else:
            values = _raw_to_json(where, out.datatype, shape, raws[i]) if raws else _contents_to_json(where, out)
            entry["data"] = orjson.Fragment(_float_json(values, _JSON_FLOAT_DTYPE.get(out.datatype))) \
                if out.datatype in _FLOAT_TYPES else values
        rendered.append(entry)

    doc: dict[str, Any] = {
        "model_name": response.model_name or request.model_name,
        "model_version": response.model_version or request.model_version,
    }
    rid = response.id or request.id
    if rid:
        doc["id"] = rid
    params = {k: v for k, p in response.parameters.items() if (v := _param_value(p)) is not None}
    if params:
        doc["parameters"] = params
    doc["outputs"] = rendered

    header = _dumps(doc)
    if not blobs:
        return header, {"Content-Type": JSON_CONTENT_TYPE}
    return b"".join([header, *blobs]), {
        HEADER_LENGTH: str(len(header)),
        "Content-Type": BINARY_CONTENT_TYPE,
    }


def raw_binary_request(body: bytes, config: mc.ModelConfig, name: str, version: str) -> pb.ModelInferRequest:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``: the whole body is the
    one input of a one-input model, every output answered binary), its input's name, datatype and
    shape taken from the model's ``config`` as Triton's core takes them (infer_request.cc,
    Normalize): batch 1 for a batching model, the one variable-sized dimension (if any) from the
    body's size, a BYTES input only of shape [1] (its one element the whole body). Its refusals are
    Triton's words; NVIDIA's qa/L0_http asserts them."""
    if len(config.input) != 1:
        raise InferError.invalid(f"Raw request must only have 1 input (found 1) to be deduced but got "
                                 f"{len(config.input)} inputs in '{name}' model configuration")
    spec = config.input[0]
    shape = [1] if config.max_batch_size != 0 else []
    dynamic = -1
    count = 1
    for dim in spec.dims:
        if dim == -1:
            if dynamic != -1:
                raise InferError.invalid(f"The shape of the raw input '{spec.name}' can not be deduced because there "
                                         "are more than one variable-sized dimension")
            dynamic = len(shape)
        else:
            count *= dim
        shape.append(dim)
    datatype = datatypes.config_to_wire(spec.data_type)
    if datatype == "BYTES":
        if dynamic != -1 or count != 1:
            raise InferError.invalid(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        body = datatypes.serialize_bytes([body])  # (one element: its length first, Triton's convention)
    elif dynamic != -1:
        size = datatypes.element_size(datatype)
        shape[dynamic] = len(body) // count // size if count and size else 0
    request = pb.ModelInferRequest(model_name=name, model_version=version)
    request.inputs.add(name=spec.name, datatype=datatype, shape=shape)
    request.raw_input_contents.append(body)
    request.parameters[BINARY_DATA_OUTPUT].bool_param = True
    return request


def json_output_bytes(response: pb.ModelInferResponse, request: pb.ModelInferRequest) -> int:
    """The bytes of the answer's outputs that ``_render`` writes as JSON (their raw bytes, or
    their typed contents' size): what its rendering costs (~10 bytes of text and an element's
    formatting each), where the outputs that go out binary cost a copy."""
    default_binary = _param_flag(request.parameters, BINARY_DATA_OUTPUT, False)
    requested = {o.name: o for o in request.outputs}
    raws = response.raw_output_contents
    total = 0
    for i, out in enumerate(response.outputs):
        if out.parameters and SHM_REGION in out.parameters:
            continue
        req_out = requested.get(out.name)
        binary = _param_flag(req_out.parameters, BINARY_DATA, default_binary) if req_out is not None else default_binary
        if not binary:
            total += len(raws[i]) if i < len(raws) else out.contents.ByteSize()
    return total


def all_binary(request: pb.ModelInferRequest) -> bool:
    """Does the request ask every output it gets in binary (no JSON to write)?"""
    default = _param_flag(request.parameters, BINARY_DATA_OUTPUT, False)
    if not request.outputs:  # (every output of the model: the default's)
        return default
    return all(_param_flag(o.parameters, BINARY_DATA, default) for o in request.outputs)


def rendering_request(request: pb.ModelInferRequest) -> bytes:
    """What ``render_answer`` needs of the request (its names, id, parameters and requested
    outputs; not its inputs), serialized."""
    kept = pb.ModelInferRequest(model_name=request.model_name, model_version=request.model_version, id=request.id)
    for key, value in request.parameters.items():
        kept.parameters[key].CopyFrom(value)
    kept.outputs.extend(request.outputs)
    return kept.SerializeToString()


_RENDERED_HEAD = struct.Struct("<I")


def render_answer(raw: bytes | bytearray, request: bytes) -> bytes:
    """``render_infer_response`` of the serialized answer ``raw`` for the serialized request
    ``request`` (``rendering_request``'s), as one buffer: its headers' JSON (length first), then
    its body. Run by the body worker for an answer with much to write as JSON
    (meshserve/server/http_frontend.py); ``rendered_answer`` reads it back."""
    body, headers = render_infer_response(pb.ModelInferResponse.FromString(bytes(raw)),
                                          pb.ModelInferRequest.FromString(request))
    head = orjson.dumps(headers)
    return b"".join((_RENDERED_HEAD.pack(len(head)), head, body))


def rendered_answer(packed: bytes | bytearray) -> tuple[bytes, dict[str, str]]:
    """``render_answer``'s buffer as (body, headers)."""
    (n,) = _RENDERED_HEAD.unpack_from(packed)
    at = _RENDERED_HEAD.size
    return bytes(memoryview(packed)[at + n:]), orjson.loads(bytes(packed[at:at + n]))


def _check_raw_size(where: str, datatype: str, shape: list[int], data: bytes) -> None:
    if not datatypes.is_valid(datatype):
        raise InferError.internal(f"{where} has unknown datatype '{datatype}'")
    size = datatypes.element_size(datatype)
    if size:
        need = datatypes.element_count(shape) * size
        if len(data) != need:
            raise InferError.internal(
                f"{where} holds {len(data)} bytes but shape {_shape_str(shape)} of {datatype} needs {need}")


_FLOAT_TYPES = frozenset({"FP16", "BF16", "FP32", "FP64"})
# the numpy type of a float output's typed contents (fp32_contents or fp64_contents)
_JSON_FLOAT_DTYPE = {"FP16": np.float32, "BF16": np.float32, "FP32": np.float32, "FP64": np.float64}


def _raw_to_json(where: str, datatype: str, shape: list[int], data: bytes) -> list[Any] | np.ndarray:
    """An output's elements for JSON `data`: a flat numpy array (orjson writes it from its buffer,
    float32 in its shortest round-tripping form) or, for BYTES, a list of strings."""
    _check_raw_size(where, datatype, shape, data)
    if datatype == "BYTES":
        try:
            elements = datatypes.deserialize_bytes(data, datatypes.element_count(shape))
        except InferError as e:
            raise InferError.internal(f"{where}: {e.message}") from None
        return _decode_strings(where, elements)
    if datatype == "BF16":
        # bfloat16 is the top half of a float32: widen exactly.
        return (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4")
    arr = np.frombuffer(data, datatypes.numpy_dtype(datatype))
    if datatype == "FP16":  # orjson writes no float16; float32 holds each value exactly
        return arr.astype(np.float32)
    return arr


def _decode_strings(where: str, elements: Iterable[bytes]) -> list[str]:
    strings: list[str] = []
    for i, b in enumerate(elements):
        try:
            strings.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            # Triton writes such bytes into the JSON as-is and tritonclient then fails with
            # "use binary_data=True"; say that here, before sending an undecodable body.
            raise InferError.invalid(
                f"{where}: element {i} is not valid UTF-8 and cannot be returned as JSON; "
                "request this output with binary_data=true") from None
    return strings


def _contents_field(where: str, out: pb.ModelInferResponse.InferOutputTensor) -> Any:
    field = _CONTENTS_FIELD.get(out.datatype)
    if field is None:
        raise InferError.internal(
            f"{where}: {out.datatype} output has no raw_output_contents and no typed contents field")
    values = getattr(out.contents, field)
    count = datatypes.element_count(out.shape)
    if len(values) != count:
        raise InferError.internal(
            f"{where} holds {len(values)} elements in contents.{field} but shape "
            f"{_shape_str(out.shape)} needs {count}")
    return values


def _contents_to_json(where: str, out: pb.ModelInferResponse.InferOutputTensor) -> list[Any]:
    values = _contents_field(where, out)
    if out.datatype == "BYTES":
        return _decode_strings(where, values)
    return list(values)


def _contents_to_raw(where: str, out: pb.ModelInferResponse.InferOutputTensor) -> bytes:
    values = _contents_field(where, out)
    if out.datatype == "BYTES":
        return datatypes.serialize_bytes(values)
    target = datatypes.numpy_dtype(out.datatype)
    try:
        return np.array(values, dtype=target).tobytes()
    except OverflowError as e:
        raise InferError.internal(f"{where}: contents out of range for {out.datatype} ({e})") from None


# --- other endpoints --------------------------------------------------------------------

_INT64_TYPES = frozenset({
    FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64,
})


def _int64_to_numbers(descriptor: Descriptor, obj: dict[str, Any]) -> None:
    """Undo MessageToDict's int64-as-string rendering in place, guided by the descriptor."""
    for key, value in obj.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        msg_type = field.message_type
        if msg_type is not None and msg_type.GetOptions().map_entry:
            value_field = msg_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for item in value.values():
                    _int64_to_numbers(value_field.message_type, item)
            elif value_field.type in _INT64_TYPES:
                for k in value:
                    value[k] = int(value[k])
        elif msg_type is not None:
            for item in value if isinstance(value, list) else (value,):
                _int64_to_numbers(msg_type, item)
        elif field.type in _INT64_TYPES:
            obj[key] = [int(v) for v in value] if isinstance(value, list) else int(value)


def model_config_to_json(cfg: mc.ModelConfig) -> dict[str, Any]:
    """ModelConfig as Triton's `/config` JSON (PROTOCOL.md §5.3).

    snake_case names, enum names, scalar/repeated/map defaults included, unset messages
    omitted (so only the set `scheduling_choice` member appears), int64 as JSON numbers.
    """
    doc = json_format.MessageToDict(
        cfg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _int64_to_numbers(cfg.DESCRIPTOR, doc)
    return doc


def _tensor_metadata(t: pb.ModelMetadataResponse.TensorMetadata) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}


def model_metadata_to_json(md: pb.ModelMetadataResponse) -> dict[str, Any]:
    """Model metadata JSON: name, versions (strings), platform, inputs, outputs."""
    return {
        "name": md.name,
        "versions": list(md.versions),
        "platform": md.platform,
        "inputs": [_tensor_metadata(t) for t in md.inputs],
        "outputs": [_tensor_metadata(t) for t in md.outputs],
    }


def server_metadata_to_json(md: pb.ServerMetadataResponse) -> dict[str, Any]:
    """Server metadata JSON: `{"name", "version", "extensions": [...]}`."""
    return {"name": md.name, "version": md.version, "extensions": list(md.extensions)}


_INFER_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer",
                    "compute_output", "cache_hit", "cache_miss")
_BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")
_RESPONSE_DURATIONS = ("compute_infer", "compute_output", "success", "fail",
                       "empty_response", "cancel")


def _durations(msg: Any, names: tuple[str, ...]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for name in names:
        d = getattr(msg, name)
        out[name] = {"count": d.count, "ns": d.ns}
    return out


def parse_json_object(body: bytes | bytearray, what: str) -> dict[str, Any]:
    """A settings POST body: a JSON object of setting names and values (empty: no changes)."""
    return _object_body(body, what, lambda _: f"{what} body must be a JSON object of setting names and values")


def _object_body(body: bytes | bytearray, where: str, complaint: Callable[[Any], str]) -> dict[str, Any]:
    """A request body that is a JSON object (an empty body: ``{}``); anything else is the client
    error ``complaint(what was sent)``."""
    doc = _loads(body, where) if body.strip() else {}
    if not isinstance(doc, dict):
        raise InferError.invalid(complaint(doc))
    if len(doc) > infer_checks.MAX_PARAMETERS:  # (read in the body worker when large: never sent back)
        raise infer_checks.too_many(f"the {where} body", len(doc), "keys", infer_checks.MAX_PARAMETERS)
    return doc


def parse_index_request(body: bytes | bytearray) -> bool:
    """A `/v2/repository/index` POST body (empty allowed): its `ready` flag."""
    if not body.strip():
        return False
    doc = _loads(body, "repository index request")
    if not isinstance(doc, dict):
        raise InferError.invalid("repository index body must be a JSON object")
    return bool(doc.get("ready", False))


def parse_trace_settings(body: bytes | bytearray) -> dict[str, list[str] | None]:
    """A trace/setting POST body: ``{name: "value" | ["value", ...] | null}`` (numbers taken as
    their text; null clears a model's setting)."""
    obj = parse_json_object(body, "trace setting")
    out: dict[str, list[str] | None] = {}
    for key, value in obj.items():
        items = value if isinstance(value, list) else [value] if value is not None else None
        if items is not None and len(items) > infer_checks.MAX_PARAMETERS:
            raise infer_checks.too_many(f"trace setting '{key}'", len(items), "values", infer_checks.MAX_PARAMETERS)
        if items is not None and not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in items):
            raise InferError.invalid(f"trace setting '{key}': a value must be a string, an integer or a list of "
                                     f"them, got {json.dumps(value)}")
        out[key] = [str(v) for v in items] if items is not None else None
    return out


def trace_settings_to_json(settings: dict[str, list[str]]) -> dict[str, Any]:
    """Trace settings as Triton's HTTP API gives them: trace_level a list, the others a string."""
    return {key: values if key == "trace_level" else (values[0] if values else "") for key, values in settings.items()}


def statistics_to_json(stats: pb.ModelStatisticsResponse) -> dict[str, Any]:
    """Statistics JSON (PROTOCOL.md §3.6): every duration member present, integers throughout."""
    model_stats: list[dict[str, Any]] = []
    for s in stats.model_stats:
        model_stats.append({
            "name": s.name,
            "version": s.version,
            "last_inference": s.last_inference,
            "inference_count": s.inference_count,
            "execution_count": s.execution_count,
            "inference_stats": _durations(s.inference_stats, _INFER_DURATIONS),
            "response_stats": {
                key: _durations(r, _RESPONSE_DURATIONS) for key, r in sorted(s.response_stats.items())
            },
            "batch_stats": [
                {"batch_size": b.batch_size, **_durations(b, _BATCH_DURATIONS)} for b in s.batch_stats
            ],
            "memory_usage": [
                {"type": m.type, "id": m.id, "byte_size": m.byte_size} for m in s.memory_usage
            ],
        })
    return {"model_stats": model_stats}


def repository_index_to_json(idx: pb.RepositoryIndexResponse) -> list[dict[str, str]]:
    """Repository index JSON array; like Triton, `version`/`reason` appear only when non-empty."""
    entries: list[dict[str, str]] = []
    for m in idx.models:
        entry = {"name": m.name}
        if m.version:
            entry["version"] = m.version
        entry["state"] = m.state
        if m.reason:
            entry["reason"] = m.reason
        entries.append(entry)
    return entries


def error_body(message: str) -> bytes:
    """The JSON error body every non-200 response carries: `{"error": "<message>"}`."""
    return _dumps({"error": message})


def _repository_parameters(body: bytes | bytearray | memoryview, what: str) -> dict[str, Any]:
    if not bytes(body).strip():
        return {}
    doc = _loads(body, f"{what} request")
    if not isinstance(doc, dict):
        raise InferError.invalid(f"the {what} request JSON must be an object, got {_json_type(doc)}")
    return _parameters(doc.get("parameters"), f"{what} request 'parameters'", f"the {what} request")


def _set_repository_param(target: pb.ModelRepositoryParameter, value: Any, where: str) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int) and _INT64_MIN <= value <= _INT64_MAX:
        target.int64_param = value
    elif isinstance(value, str):
        target.string_param = value
    else:
        raise InferError.invalid(
            f"{where}: unsupported value {_show(value)}; expected a string, boolean or 64-bit integer")


def parse_load_request(body: bytes | bytearray | memoryview) -> dict[str, pb.ModelRepositoryParameter]:
    """Parse a `/v2/repository/models/{m}/load` body (empty allowed).

    `config` (a JSON string, validated later by the repository) -> string_param;
    `file:<version>/<path>` (base64) -> decoded bytes_param; other values by JSON type.
    """
    out: dict[str, pb.ModelRepositoryParameter] = {}
    for key, value in _repository_parameters(body, "load").items():
        where = f"load parameter '{key}'"
        param = pb.ModelRepositoryParameter()
        if key == "config":
            param.string_param = _string(value, where)
        elif key.startswith("file:"):
            try:
                param.bytes_param = base64.b64decode(_string(value, where), validate=True)
            except (binascii.Error, ValueError) as e:
                raise InferError.invalid(f"{where} is not valid base64 ({e})") from None
        else:
            _set_repository_param(param, value, where)
        out[key] = param
    return out


def parse_unload_request(body: bytes | bytearray | memoryview) -> dict[str, pb.ModelRepositoryParameter]:
    """Parse a `/v2/repository/models/{m}/unload` body (empty allowed); `unload_dependents` is a bool."""
    out: dict[str, pb.ModelRepositoryParameter] = {}
    for key, value in _repository_parameters(body, "unload").items():
        where = f"unload parameter '{key}'"
        param = pb.ModelRepositoryParameter()
        if key == "unload_dependents":
            if not isinstance(value, bool):
                raise InferError.invalid(f"{where} must be a boolean, got {_show(value)}")
            param.bool_param = value
        else:
            _set_repository_param(param, value, where)
        out[key] = param
    return out


def _count(doc: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in doc and default is not None:
        return default
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT64_MAX:
        raise InferError.invalid(f"{where}: '{key}' must be a non-negative integer, got {_show(value)}")
    return value


def _register_body(body: bytes | bytearray, where: str) -> dict[str, Any]:
    return _object_body(body, where, lambda doc: f"the {where} body must be a JSON object, got {_json_type(doc)}")


def parse_system_shm_register(body: bytes | bytearray) -> tuple[str, int, int]:
    """A `/v2/systemsharedmemory/region/{n}/register` body: (key, offset, byte_size)."""
    where = "system shared memory register request"
    doc = _register_body(body, where)
    if "key" not in doc:
        raise InferError.invalid(f"{where}: 'key' is missing")
    return _string(doc["key"], f"{where} 'key'"), _count(doc, "offset", where, 0), _count(doc, "byte_size", where)


def parse_cuda_shm_register(body: bytes | bytearray) -> tuple[bytes, int, int]:
    """A `/v2/cudasharedmemory/region/{n}/register` body: (raw handle, device_id, byte_size);
    the handle arrives as `{"raw_handle": {"b64": "<base64>"}}`."""
    where = "CUDA shared memory register request"
    doc = _register_body(body, where)
    handle = doc.get("raw_handle")
    if not isinstance(handle, dict) or not isinstance(handle.get("b64"), str):
        raise InferError.invalid(f"{where}: 'raw_handle' must be an object {{\"b64\": \"<base64>\"}}")
    try:
        raw = base64.b64decode(handle["b64"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise InferError.invalid(f"{where}: 'raw_handle.b64' is not valid base64 ({e})") from None
    return raw, _count(doc, "device_id", where, 0), _count(doc, "byte_size", where)


# --- compression ------------------------------------------------------------------------
# Request bodies are decompressed here and only here (the HTTP server's own decompression is
# off), incrementally as the body arrives, in slices of at most DECODE_SLICE output bytes, and
# bounded by the caller's limit at every stage: a gzip bomb is cut off once its output passes
# the limit, and one compressed chunk never inflates into more than a slice at a time.

_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_DEFLATE_WBITS = -zlib.MAX_WBITS
DECODE_SLICE = 1 << 20  # bytes of decompressed output per step (~1 ms of inflate)
ACCEPTED_CODINGS = ("gzip", "deflate", "identity")


class _Inflater:
    """One gzip (members back to back allowed) or deflate (zlib stream, or raw deflate when the
    zlib header is absent) stream, fed in pieces."""

    def __init__(self, coding: str, max_size: int):
        self.coding = coding
        self.gzip = coding == "gzip"
        self.max_size = max_size
        self.produced = 0
        self._d: Any = None  # the member being decoded
        self._members = 0
        self._head = b""  # deflate: bytes held until the 2-byte zlib header can be checked

    def _start(self, data: bytes) -> None:
        if self.gzip:
            wbits = _GZIP_WBITS
        else:  # HTTP "deflate" is a zlib stream (tritonclient); some clients send raw deflate
            zlib_header = data[0] & 0x0F == 8 and (data[0] * 256 + data[1]) % 31 == 0
            wbits = _ZLIB_WBITS if zlib_header else _RAW_DEFLATE_WBITS
        self._d = zlib.decompressobj(wbits)

    def feed(self, data: bytes) -> Iterator[bytes]:
        coding = self.coding
        if self._head:
            data, self._head = self._head + data, b""
        while data or (self._d is not None and not self._d.eof):
            if self._d is None:
                if self._members and not self.gzip:
                    raise InferError.invalid(f"{len(data)} stray bytes after the {coding} stream")
                if not self.gzip and len(data) < 2:
                    self._head = data
                    return
                self._start(data)
            d = self._d
            try:
                out = d.decompress(data, DECODE_SLICE)
            except zlib.error as e:
                raise InferError.invalid(f"malformed {coding} request body ({e})") from None
            if out:
                self.produced += len(out)
                if self.produced > self.max_size:
                    raise InferError.too_large(
                        f"the {coding}-decompressed request body exceeds {self.max_size} bytes "
                        "(the request size limit, --max-request-bytes)")
                yield out
            if d.eof:
                self._members += 1
                self._d = None
                data = d.unused_data
            elif d.unconsumed_tail:
                data = d.unconsumed_tail
            elif len(out) < DECODE_SLICE:
                return  # all input consumed, no output pending: wait for more
            else:
                data = b""  # the slice was full: zlib may hold more output

    def finish(self) -> None:
        if self._d is not None or self._head or not self._members:
            raise InferError.invalid(f"truncated {self.coding} request body")


class BodyDecoder:
    """Undo a request's `Content-Encoding` (gzip/x-gzip, deflate, identity, or a chain of them)
    incrementally, with every stage's output bounded by `max_size`.

    Raises `InferError`: UNSUPPORTED_MEDIA_TYPE (415) for another coding, TOO_LARGE (413) past
    `max_size`, INVALID_ARG (400) for a malformed or truncated stream."""

    def __init__(self, content_encoding: str | None, max_size: int):
        self.max_size = max_size
        self._stages: list[_Inflater] = []
        if not content_encoding:
            return
        codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
        for coding in reversed(codings):  # listed in the order they were applied
            if coding == "identity":
                continue
            if coding in ("gzip", "x-gzip"):
                self._stages.append(_Inflater("gzip", max_size))
            elif coding == "deflate":
                self._stages.append(_Inflater("deflate", max_size))
            else:
                raise InferError.unsupported_media(
                    f"unsupported Content-Encoding '{coding[:40]}'; meshserve accepts "
                    f"{', '.join(ACCEPTED_CODINGS)}")

    @property
    def identity(self) -> bool:
        """True when the body is not compressed (feed() would hand it back as it is)."""
        return not self._stages

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Decompressed pieces (each at most DECODE_SLICE bytes) of the next piece of body."""
        return self._run(0, data)

    def _run(self, stage: int, data: bytes) -> Iterator[bytes]:
        if stage == len(self._stages):
            if data:
                yield data
            return
        for piece in self._stages[stage].feed(data):
            yield from self._run(stage + 1, piece)

    def finish(self) -> None:
        """The body ended: every stream must be complete."""
        for stage in self._stages:
            stage.finish()


def decode_body(
    body: bytes | bytearray | memoryview, content_encoding: str | None, *, max_size: int | None = None
) -> bytes:
    """Undo `Content-Encoding` on a whole body (see BodyDecoder); `max_size` bounds the
    decompressed size (zip bombs)."""
    data = body if isinstance(body, bytes) else bytes(body)
    decoder = BodyDecoder(content_encoding, max_size if max_size is not None else _UINT64_MAX)
    if decoder.identity:
        return data
    pieces = list(decoder.feed(data))
    decoder.finish()
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _accepted_codings(accept_encoding: str) -> dict[str, float]:
    q: dict[str, float] = {}
    for item in accept_encoding.split(","):
        token, _, rest = item.partition(";")
        token = token.strip().lower()
        if not token:
            continue
        weight = 1.0
        for param in rest.split(";"):
            k, _, v = param.partition("=")
            if k.strip().lower() == "q":
                try:
                    weight = float(v)
                except ValueError:
                    weight = 0.0
        q[token] = weight
    return q


def encode_body(body: bytes, accept_encoding: str | None) -> tuple[bytes, str | None]:
    """Compress a response body for the client's `Accept-Encoding`.

    Returns (body, coding) with coding "gzip", "deflate" (zlib stream) or None (identity).
    Highest q-value wins; gzip on a tie; `*` counts as gzip.
    """
    if not accept_encoding:
        return body, None
    q = _accepted_codings(accept_encoding)
    star = q.get("*", 0.0)
    gzip_q = q.get("gzip", q.get("x-gzip", star))
    deflate_q = q.get("deflate", star)
    if gzip_q <= 0 and deflate_q <= 0:
        return body, None
    if gzip_q >= deflate_q:
        c = zlib.compressobj(6, zlib.DEFLATED, _GZIP_WBITS)  # gzip framing, mtime 0: deterministic
        return c.compress(body) + c.flush(), "gzip"
    return zlib.compress(body, 6), "deflate"
