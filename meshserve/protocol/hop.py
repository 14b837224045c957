"""The hop protocol: what a gateway adds to the requests it forwards to a service, and what a
service answers on the gateway's streams, beyond Triton's protocol. Its one codec.

The gateway -> service hop is a few long-lived ModelStreamInfer calls per replica
(gateway/upstream/stream.py), their metadata marked ``meshserve-hop: gateway`` (``METADATA``).
On that stream a request may carry private ``meshserve_*`` parameters:

- ``MERGED``: how many client requests a request the gateway's coalescer merged holds;
- ``QUEUED``: µs it already waited in the coalescer (the service's queue delay counts from then);
- ``DEADLINE``: µs left of the client's deadline (no gRPC deadline travels per message);
- ``TRACEPARENTS``: the traced members of a merged request, a line per member
  ("traceparent[\\ttracestate]", empty for an untraced one);
- ``STREAM``: the request is for a client's streaming call (a decoupled model): the service
  answers every response with Triton's ``triton_final_response`` and ends it with a final one,
  an empty one marked ``EMPTY_FINAL``;
- ``REQUEST_ID``: the client's request id (the request's own id is the hop's key), sent only
  when the client gave one;
- ``CANCEL``: a message {id, CANCEL} stops the request of that id (its client went away).

A service answers an error in band: the stream response's ``error_message``, its status code in
``ERROR_CODE`` and, on a gateway's hop, its retry hint in ``RETRY_AFTER`` (ms).

The gateway writes them (the ``with_*`` / ``set_*`` functions, ``cancel``, ``set_error``); a
service reads them once per request at its front door (``decode``) into the ``Hop`` record, which
is all that the code behind it sees. ``vet`` reads a call's marker once per call (per stream),
when the call's metadata is read, and makes it one of two objects no wire can carry (``decode``
and ``from_gateway`` compare by identity):

- ``VERIFIED``: the call is authenticated (docs/security.md, "The authenticated hop"): the
  service has a hop key (``--hop-key-file``) and the call's ``AUTH_HEADER`` is a valid, fresh,
  unused token of it (``token``: an HMAC-SHA256 over a time and a nonce, made by the gateway
  once per stream, ``stream_metadata``), or the service's gRPC port serves mutual TLS
  (``--grpc-use-ssl-mutual``: every peer that got through the handshake holds a certificate of
  ``--grpc-root-cert``, the mesh's CA). Its requests' hop parameters are believed: merged
  counts, coalescer waits, deadlines, traceparents, the client's request id.
- ``FRAMED``: any other call with the gateway's marker, e.g. every call to a service with
  neither key nor mutual TLS (``open_hop``). Its hop parameters are all ignored (``decode``
  gives ``NO_HOP``: its statistics, queue times, deadlines and spans are the caller's own); the
  marker only keeps the hop's framing of the stream's answers (meshserve/server/grpc_frontend.py:
  completion order, ``STREAM`` / ``EMPTY_FINAL``, ``CANCEL`` by id, retry hints in band), which
  touches nothing but the caller's own stream, so that a gateway without a key is still served
  correctly (on a client's framing a decoupled model's stream never ends at the gateway: no
  empty final answer unless its client asked for one).

A gateway, whose callers are clients, never believes the marker (``trusted``, ``trust_marker``).

Every function here runs per request on the gateway's or the service's path: module constants,
the parameters' map-entry key bytes built once, no object beyond what they return.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.infer_checks import int_value
from meshserve.protocol.wire import INFER_REQUEST_ID_TAG, bool_parameter_entry, length_delimited, varint

HEADER = "meshserve-hop"  # stream metadata that marks a gateway's hop
GATEWAY = "gateway"
METADATA = ((HEADER, GATEWAY),)  # the marker of the gateway's upstream streams (stream_metadata)
PRIVATE_PREFIX = "meshserve_"  # every private hop parameter starts so; clients may not send them to a gateway
MERGED = "meshserve_merged_requests"
QUEUED = "meshserve_queued_us"
DEADLINE = "meshserve_deadline_us"
TRACEPARENTS = "meshserve_traceparents"
STREAM = "meshserve_stream"
EMPTY_FINAL = "meshserve_empty_final"
CANCEL = "meshserve_cancel"
REQUEST_ID = "meshserve_request_id"
ERROR_CODE = "meshserve_error_code"
RETRY_AFTER = "meshserve_retry_after_ms"
MAX_QUEUED_US = 10_000_000  # a coalescer wait beyond 10 s counts as 10 s

AUTH_HEADER = "meshserve-hop-auth"  # a gateway's stream token: "<unix ms>.<nonce>.<HMAC-SHA256>" (token)
AUTH_WINDOW_S = 300.0  # a token is fresh this long either side of the service's clock
NONCES_KEPT = 65_536  # tokens remembered (each usable once) within the window; more are refused
MIN_KEY_BYTES = 32  # a hop key file's least length (e.g. 64 hex digits of 32 random bytes)
_MAX_TOKEN = 128  # a longer token is not one of ours
_MAC_CONTEXT = b"meshserve-hop/1"
# A verified call's marker and an unverified one's (vet): made at run time (never interned, so no
# string parsed from a wire is either object) with a NUL (which no HTTP/2 header value may hold);
# decode and from_gateway compare by identity.
VERIFIED = "".join((GATEWAY, "\x00verified"))
FRAMED = "".join((GATEWAY, "\x00framed"))
OPEN_SERVICE = ("the hop is not authenticated (no --hop-key-file, no --grpc-use-ssl-mutual): this service believes "
                "no gateway's hop parameters (merged counts, coalescer waits, deadlines, traceparents), a "
                "gateway's requests count as its own; give the gateway and this service the same --hop-key-file "
                "(`meshserve hop-key FILE` makes one)")
OPEN_GATEWAY = ("the hop to the services is not authenticated (no --hop-key-file, no --upstream-client-cert): "
                "requests are served, but the services believe none of the hop's extras: a merged request counts "
                "once in their statistics, the coalescer's wait counts as queue time again, the client's "
                "deadline does not stop a request there, merged members' traces end at the gateway, a python "
                "model's request_id() is the hop's id; give the gateway and its services the same "
                "--hop-key-file (`meshserve hop-key FILE` makes one)")

log = logging.getLogger("meshserve.hop")

# Whether this process believes the marker at all: a service does (on an authenticated call,
# vet); a gateway, whose callers are clients, never does.
trusted = True
_hop_key: bytes | None = None  # the hop key (--hop-key-file): a gateway signs its streams, a service checks
_mutual = False  # this service's gRPC port serves mutual TLS: its peers hold the mesh CA's certificates
_nonces: dict[str, int] = {}  # tokens seen within the window (nonce -> unix ms), oldest first
_warned = [0.0]  # when an unauthenticated marker was last logged


def trust_marker(trust: bool) -> None:
    """Set at start: False in a gateway (GatewayCore.start), so a client's marker is ignored."""
    global trusted
    trusted = trust


def authenticate(key: bytes | None, mutual: bool) -> None:
    """Set at start (meshserve/server/tls.py:configure_hop): the hop key, and whether the gRPC
    port serves mutual TLS. Neither: the hop is open (``open``)."""
    global _hop_key, _mutual
    _hop_key, _mutual = key, mutual
    _nonces.clear()


def open_hop() -> bool:
    """No hop key and no mutual TLS: no call is authenticated (a service believes no hop
    parameter; a gateway's services believe none of its)."""
    return _hop_key is None and not _mutual


def token(key: bytes, now_ms: int | None = None, nonce: str | None = None) -> str:
    """A stream's token: the time, a random nonce and their HMAC-SHA256 under ``key``."""
    ts = str(int(time.time() * 1000) if now_ms is None else now_ms)
    nonce = secrets.token_hex(16) if nonce is None else nonce
    mac = hmac.new(key, b"|".join((_MAC_CONTEXT, GATEWAY.encode(), ts.encode(), nonce.encode())), hashlib.sha256)
    return f"{ts}.{nonce}.{mac.hexdigest()}"


def check_token(key: bytes, value: str, now_ms: int, seen: dict[str, int]) -> str | None:
    """Why ``value`` is not a valid token of ``key`` at ``now_ms`` (None: it is, and its nonce is
    now used up in ``seen``)."""
    parts = value.split(".") if len(value) <= _MAX_TOKEN else ()
    if len(parts) != 3 or not parts[0].isdigit():
        return "not a token"
    ts, nonce, mac = parts
    if abs(now_ms - int(ts)) > AUTH_WINDOW_S * 1000:
        return "expired (or the clocks differ by more than the window)"
    expected = token(key, int(ts), nonce).rsplit(".", 1)[1]
    if not hmac.compare_digest(expected, mac):
        return "a wrong MAC (another key)"
    horizon = now_ms - int(AUTH_WINDOW_S * 1000)
    while seen:  # insertion order is about time order: the expired ones leave from the front
        first = next(iter(seen))
        if seen[first] >= horizon:
            break
        del seen[first]
    if nonce in seen:
        return "replayed"
    if len(seen) >= NONCES_KEPT:
        return "too many streams within the window"
    seen[nonce] = int(ts)
    return None


def stream_metadata() -> tuple[tuple[str, str], ...]:
    """The metadata of a gateway's new hop stream: the marker and, with a hop key, a fresh token
    (made once per stream: a stream carries many requests)."""
    if _hop_key is None:
        return METADATA
    return (*METADATA, (AUTH_HEADER, token(_hop_key)))


def vet(headers: dict[str, str]) -> dict[str, str]:
    """A call's metadata, read once per call (per stream) at the gRPC front door: the marker of
    an authenticated call becomes ``VERIFIED`` (its hop parameters believed), the gateway's
    marker on any other call ``FRAMED`` (its hop parameters ignored: the caller's requests are
    its own; only the answers keep the hop's framing); a gateway deletes every marker. A call
    without the marker (a client's) costs one lookup."""
    marker = headers.get(HEADER)
    if marker is None:
        return headers
    auth = headers.pop(AUTH_HEADER, None)
    if not trusted or marker != GATEWAY:  # (a gateway ignores its clients' markers silently)
        del headers[HEADER]
        return headers
    why = None if _mutual else "this service has no --hop-key-file and no --grpc-use-ssl-mutual" \
        if _hop_key is None else "no token" if auth is None \
        else check_token(_hop_key, auth, int(time.time() * 1000), _nonces)
    if why is None:
        headers[HEADER] = VERIFIED
        return headers
    headers[HEADER] = FRAMED
    now = time.monotonic()
    if now - _warned[0] >= 60.0:
        _warned[0] = now
        log.warning("a call carried the hop marker without a valid hop token (%s): its hop parameters are "
                    "ignored, its requests are the caller's own (a gateway without this service's "
                    "--hop-key-file?)", why)
    return headers


def from_gateway(headers: Mapping[str, str]) -> bool:
    """Are a call's answers framed as on a gateway's hop: its marker vetted (``vet``: verified or
    not) in a process that believes it? Only the framing: its hop parameters are believed on a
    ``VERIFIED`` call alone (``decode``)."""
    if not trusted:
        return False
    marker = headers.get(HEADER)
    return marker is VERIFIED or marker is FRAMED


@dataclass(slots=True, eq=False)  # not frozen: a frozen dataclass's __init__ costs ~0.2 µs more per request
class Hop:
    """What a gateway adds to a request it forwards to a service, beyond the protocol: the
    private request parameters above and the stream's hop marker. Read once per request, at the
    front door (``decode``), so that nothing behind it (admission, tracing, ``ServiceCore``,
    ``ModelVersion``) looks at parameters for them. A direct client's request has none: ``NO_HOP``.

    The hop's other private parameters travel the other way: ``ERROR_CODE`` and ``RETRY_AFTER``
    (a service's in-band stream error, ``set_error`` / ``stream_error``) and ``EMPTY_FINAL``.
    Treat it as read-only: ``NO_HOP`` and ``GATEWAY_HOP`` are shared by every request that has no
    hop parameters."""

    gateway: bool = False  # the request came on a gateway's stream (metadata meshserve-hop: gateway)
    # client requests this one holds (MERGED; the model checks it against the rows); None: the
    # parameter is there but is not an integer, and the model refuses the request
    merged: int | None = 1
    # time it already waited in the gateway's coalescer (QUEUED, clamped to 0..10 s); None: not
    # an integer (refused by a dynamically batched model)
    queued_ns: int | None = 0
    # absolute time.monotonic_ns() deadline from DEADLINE, where no gRPC deadline travels (the
    # gateway's streams); None = none
    deadline_ns: int | None = None
    # the traced members of a merged request (TRACEPARENTS): a line per member
    traceparents: str | None = None
    # the gateway forwards this request for a client's streaming call (STREAM): the service
    # answers it with core.infer_stream, every response marked final or not
    stream: bool = False
    # the client's request id (REQUEST_ID; the request's own id is the hop's key), None when the
    # client gave none
    request_id: str | None = None


NO_HOP = Hop()
GATEWAY_HOP = Hop(gateway=True)


# ---- decode (a service's front door) ---------------------------------------------------------

def decode(params: Mapping[str, pb.InferParameter], headers: Mapping[str, str]) -> Hop:
    """The request's Hop record: its private parameters and the hop marker, read here once. A
    request without parameters (most) costs one header lookup.

    Only a gateway's hop (the stream's marker, verified by ``vet``) is believed: a client's own
    ``meshserve_*`` parameters never change its weight, queue delay, deadline or spans (a direct
    client's are ignored here, the marker too unless ``vet`` authenticated its call; the gateway
    refuses them at its front door, gateway/pipeline.py:Names.check). The gateway itself never
    believes the marker (``trusted``, cleared by GatewayCore.start): a client's ``meshserve-hop``
    header there is ignored, and it pays one flag check per request."""
    if not trusted or headers.get(HEADER) is not VERIFIED:
        return NO_HOP
    if not params:
        return GATEWAY_HOP
    merged: int | None = 1
    queued_ns: int | None = 0
    deadline_ns: int | None = None
    traceparents: str | None = None
    if MERGED in params:
        merged = int_value(params[MERGED])
    if QUEUED in params:
        queued = int_value(params[QUEUED])
        queued_ns = None if queued is None else max(0, min(queued, MAX_QUEUED_US)) * 1000
    if DEADLINE in params:  # relative on the wire: absolute from the moment it arrived
        deadline_ns = time.monotonic_ns() + params[DEADLINE].int64_param * 1000
    if TRACEPARENTS in params:
        traceparents = params[TRACEPARENTS].string_param
    stream = STREAM in params and params[STREAM].bool_param
    request_id = params[REQUEST_ID].string_param if REQUEST_ID in params else None
    if merged == 1 and queued_ns == 0 and deadline_ns is None and traceparents is None and not stream \
            and request_id is None:
        return GATEWAY_HOP  # only the protocol's own parameters
    return Hop(True, merged, queued_ns, deadline_ns, traceparents, stream, request_id)


# ---- encode (the gateway's side of a request) ------------------------------------------------
# A request's parameters are a protobuf map (ModelInferRequest.parameters = 4): appending an entry
# to the serialized request sets it (for maps the last entry of a key wins), without a parse.

_PARAMETERS_TAG = b"\x22"  # ModelInferRequest / ModelInferResponse .parameters = 4
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _key(name: str) -> bytes:
    """A parameters map entry's key field (MapEntry.key = 1), built once per name."""
    return length_delimited(b"\x0a", name.encode())


_DEADLINE_KEY = _key(DEADLINE)
_QUEUED_KEY = _key(QUEUED)
_REQUEST_ID_KEY = _key(REQUEST_ID)
_TRACEPARENTS_KEY = _key(TRACEPARENTS)
_STREAM_ENTRY = bool_parameter_entry(STREAM, True)
_CANCEL_ENTRY = bool_parameter_entry(CANCEL, True)


def _int_entry(key: bytes, value: int) -> bytes:
    """The map entry {key: InferParameter{int64_param = value}} as appended bytes."""
    param = b"\x10" + varint(value & _MASK64)  # int64_param = 2: at most 11 bytes
    entry = key + bytes((0x12, len(param))) + param  # MapEntry.value = 2
    return _PARAMETERS_TAG + varint(len(entry)) + entry


def _string_entry(key: bytes, value: str) -> bytes:
    """The map entry {key: InferParameter{string_param = value}} as appended bytes."""
    entry = key + length_delimited(b"\x12", length_delimited(b"\x1a", value.encode()))  # string_param = 3
    return _PARAMETERS_TAG + varint(len(entry)) + entry


def with_deadline(raw_request: bytes, timeout_s: float) -> bytes:
    """``raw_request`` with DEADLINE: what is left of its deadline, in µs (at least 1)."""
    return raw_request + _int_entry(_DEADLINE_KEY, max(1, int(timeout_s * 1e6)))


def with_queued(raw_request: bytes, waited_us: int) -> bytes:
    """``raw_request`` with QUEUED: how long it waited in the gateway's coalescer."""
    return raw_request + _int_entry(_QUEUED_KEY, waited_us)


def set_queued(request: pb.ModelInferRequest, waited_us: int) -> None:
    """The same on a parsed request."""
    request.parameters[QUEUED].int64_param = waited_us


def set_merged(request: pb.ModelInferRequest, count: int) -> None:
    """Mark a request the coalescer merged: it holds ``count`` client requests."""
    request.parameters[MERGED].int64_param = count


def merged_count(request: pb.ModelInferRequest) -> int:
    """How many client requests a merged request (``set_merged``) holds."""
    return request.parameters[MERGED].int64_param


def with_traceparents(raw_request: bytes, lines: list[str]) -> bytes:
    """``raw_request`` with TRACEPARENTS: a line per member of a merged request, in member order
    ("traceparent[\\ttracestate]", empty for an untraced member)."""
    return raw_request + _string_entry(_TRACEPARENTS_KEY, "\n".join(lines))


def with_request_id(raw_request: bytes, client_id: str) -> bytes:
    """``raw_request`` with REQUEST_ID: the client's id (the request's own becomes the hop's key)."""
    return raw_request + _string_entry(_REQUEST_ID_KEY, client_id)


def with_stream(raw_request: bytes) -> bytes:
    """``raw_request`` marked STREAM: a request for a client's streaming call."""
    return raw_request + _STREAM_ENTRY


def cancel(request_id: str) -> bytes:
    """The serialized message that tells a service to stop the request ``request_id``."""
    return length_delimited(INFER_REQUEST_ID_TAG, request_id.encode()) + _CANCEL_ENTRY


# ---- a service's answers on the hop ------------------------------------------------------------

def set_empty_final(response: pb.ModelInferResponse) -> None:
    """Mark a streamed request's empty final response (it carries no data of the model's)."""
    response.parameters[EMPTY_FINAL].bool_param = True


def set_error(response: pb.ModelInferResponse, code: Code, retry_after_ms: int | None) -> None:
    """An in-band stream error's status code (and, on a gateway's hop, its retry hint) on the
    stream response's ``infer_response``; the message goes in its ``error_message``."""
    params = response.parameters
    params[ERROR_CODE].string_param = code.value
    if retry_after_ms is not None:
        params[RETRY_AFTER].int64_param = retry_after_ms


_CODES = {c.value: c for c in Code}


def stream_error(msg: pb.ModelStreamInferResponse, where: str) -> InferError | None:
    """The in-band error a service answered (``set_error``), if it is one, with its retry hint;
    ``where`` names the service in a message-less error."""
    resp = msg.infer_response
    if not msg.error_message and ERROR_CODE not in resp.parameters:
        return None
    params = resp.parameters
    code = _CODES.get(params[ERROR_CODE].string_param, Code.UNKNOWN) if ERROR_CODE in params else Code.UNKNOWN
    retry_after = params[RETRY_AFTER].int64_param / 1000 if RETRY_AFTER in params else None
    return InferError(code, msg.error_message or f"{code.value} from {where} (no details)", retry_after_s=retry_after)
