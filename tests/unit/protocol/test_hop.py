"""meshserve.protocol.hop, the hop protocol's one codec: what the gateway encodes on a hop request,
a streamed request, a stream error and a cancel decodes to the same facts on the service's side."""
from __future__ import annotations

import time

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.protocol.errors import Code, InferError

MARKED = {hop.HEADER: hop.VERIFIED}  # a call's metadata once hop.vet authenticated it


def _decode(raw: bytes) -> hop.Hop:
    return hop.decode(pb.ModelInferRequest.FromString(raw).parameters, MARKED)


def test_a_merged_requests_hop_round_trips_every_field() -> None:
    """Encode every request field (a merged request: count, traceparents per member, queued
    time, deadline, the client's id, streamed) and decode it: the same Hop, field by field."""
    lines = ["00-" + "a" * 32 + "-" + "b" * 16 + "-01", "", "00-" + "c" * 32 + "-" + "d" * 16 + "-01\tk=v"]
    merged = pb.ModelInferRequest(model_name="m", id="~gw7")
    merged.parameters["priority"].int64_param = 2  # a protocol parameter rides along untouched
    hop.set_merged(merged, 3)
    hop.set_queued(merged, 1_500)
    raw = merged.SerializeToString()
    raw = hop.with_traceparents(raw, lines)
    raw = hop.with_request_id(raw, "client-é-7")  # (a non-ASCII id: its length in bytes)
    raw = hop.with_stream(raw)
    before = time.monotonic_ns()
    raw = hop.with_deadline(raw, 2.5)
    decoded = _decode(raw)
    after = time.monotonic_ns()
    assert hop.merged_count(pb.ModelInferRequest.FromString(raw)) == 3
    assert decoded.deadline_ns is not None and before + 2_500_000_000 <= decoded.deadline_ns <= after + 2_500_000_000
    expected = hop.Hop(gateway=True, merged=3, queued_ns=1_500_000, deadline_ns=decoded.deadline_ns,
                       traceparents="\n".join(lines), stream=True, request_id="client-é-7")
    fields = ("gateway", "merged", "queued_ns", "deadline_ns", "traceparents", "stream", "request_id")
    assert [getattr(decoded, f) for f in fields] == [getattr(expected, f) for f in fields]
    parsed = pb.ModelInferRequest.FromString(raw)
    assert parsed.id == "~gw7" and parsed.parameters["priority"].int64_param == 2


def test_the_raw_and_the_parsed_encoders_agree() -> None:
    """with_queued on bytes and set_queued on a message write the same parameter; a later entry
    of the same key wins (the protobuf map rule the byte-level encoders rely on)."""
    request = pb.ModelInferRequest(model_name="m")
    by_bytes = hop.with_queued(request.SerializeToString(), 42)
    hop.set_queued(request, 42)
    assert pb.ModelInferRequest.FromString(by_bytes) == request
    assert _decode(hop.with_queued(by_bytes, 99)).queued_ns == 99_000
    assert _decode(hop.with_deadline(b"", 1e-9)).deadline_ns is not None  # (at least 1 µs on the wire)
    big = hop.with_deadline(b"", 1e6)  # a deadline whose µs need more than one varint byte per 7 bits
    assert pb.ModelInferRequest.FromString(big).parameters[hop.DEADLINE].int64_param == 1_000_000_000_000


def test_a_request_without_hop_fields_decodes_to_the_shared_records() -> None:
    assert _decode(b"") is hop.GATEWAY_HOP
    assert _decode(pb.ModelInferRequest(id="~gw1").SerializeToString()) is hop.GATEWAY_HOP
    assert hop.decode(pb.ModelInferRequest.FromString(hop.with_stream(b"")).parameters, {}) is hop.NO_HOP


def test_a_stream_error_round_trips_its_code_message_and_retry_hint() -> None:
    for code, message, retry_after_ms in ((Code.RESOURCE_EXHAUSTED, "queue full", 1_250),
                                          (Code.INVALID_ARG, "bad shape", None),
                                          (Code.UNAVAILABLE, "", None)):
        msg = pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(id="~gw3"))
        hop.set_error(msg.infer_response, code, retry_after_ms)
        error = hop.stream_error(pb.ModelStreamInferResponse.FromString(msg.SerializeToString()), "service x")
        assert isinstance(error, InferError) and error.code is code
        assert error.message == (message or f"{code.value} from service x (no details)")
        assert error.retry_after_ms == retry_after_ms
    assert hop.stream_error(pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id="a")), "x") is None
    unknown = pb.ModelStreamInferResponse(error_message="odd")
    unknown.infer_response.parameters[hop.ERROR_CODE].string_param = "NOT_A_CODE"
    # (no walrus inside the assert: pytest 9.0.3's rewriting of one raises UnboundLocalError here,
    # pytest-dev/pytest#14445)
    error = hop.stream_error(unknown, "x")
    assert error is not None and error.code is Code.UNKNOWN


def test_a_cancel_names_the_request_it_stops() -> None:
    cancel = pb.ModelInferRequest.FromString(hop.cancel("~gw12"))
    assert cancel.id == "~gw12" and cancel.parameters[hop.CANCEL].bool_param
    assert set(cancel.parameters) == {hop.CANCEL}


def test_an_empty_final_is_marked() -> None:
    response = pb.ModelInferResponse(id="~gw4")
    hop.set_empty_final(response)
    assert pb.ModelInferResponse.FromString(response.SerializeToString()).parameters[hop.EMPTY_FINAL].bool_param


def test_every_private_name_has_the_prefix_a_gateway_refuses() -> None:
    names = [hop.MERGED, hop.QUEUED, hop.DEADLINE, hop.TRACEPARENTS, hop.STREAM, hop.EMPTY_FINAL, hop.CANCEL,
             hop.REQUEST_ID, hop.ERROR_CODE, hop.RETRY_AFTER]
    assert all(n.startswith(hop.PRIVATE_PREFIX) for n in names) and len(set(names)) == len(names)


def test_the_marker_is_believed_only_where_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hop, "trusted", True)
    raw = hop.with_queued(b"", 5)
    assert hop.from_gateway(MARKED) and _decode(raw).queued_ns == 5_000
    assert not hop.from_gateway({hop.HEADER: "client"}) and not hop.from_gateway({})
    hop.trust_marker(False)
    assert not hop.from_gateway(MARKED) and _decode(raw) is hop.NO_HOP


# ---- the authenticated hop (hop.vet: once per call, at the gRPC front door) ----------------------

KEY = b"k" * 32


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service's hop state, restored afterwards."""
    for name, value in (("trusted", True), ("_hop_key", None), ("_mutual", False), ("_nonces", {})):
        monkeypatch.setattr(hop, name, value)


def _vetted(headers: dict[str, str]) -> hop.Hop:
    return hop.decode(pb.ModelInferRequest.FromString(hop.with_queued(b"", 7)).parameters, hop.vet(dict(headers)))


def test_a_token_is_good_once_within_its_window_and_under_its_key() -> None:
    seen: dict[str, int] = {}
    now = 1_700_000_000_000
    good = hop.token(KEY, now)
    assert hop.check_token(KEY, good, now + 1000, seen) is None
    assert hop.check_token(KEY, good, now + 2000, seen) == "replayed"
    assert hop.check_token(b"x" * 32, hop.token(KEY, now), now, seen) == "a wrong MAC (another key)"
    late = int(hop.AUTH_WINDOW_S * 1000) + 1
    assert hop.check_token(KEY, hop.token(KEY, now), now + late, seen).startswith("expired")
    assert hop.check_token(KEY, hop.token(KEY, now + late), now, seen).startswith("expired")  # (from the future)
    for bad in ("", "gateway", "1.2", "a.b.c", "1.2.3.4", "9" * 200, good.replace(".", "..", 1)):
        assert hop.check_token(KEY, bad, now, seen) is not None, bad
    # the nonces of tokens past the window are forgotten (the store stays bounded), theirs refused anyway
    assert hop.check_token(KEY, hop.token(KEY, now + late), now + late, seen) is None and len(seen) == 1


def test_the_nonce_store_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hop, "NONCES_KEPT", 3)
    seen: dict[str, int] = {}
    now = 1_700_000_000_000
    assert [hop.check_token(KEY, hop.token(KEY, now), now, seen) for _ in range(4)] == \
        [None, None, None, "too many streams within the window"]


@pytest.mark.usefixtures("service")
def test_only_an_authenticated_call_is_believed_any_marked_one_keeps_the_framing() -> None:
    marker = dict(hop.METADATA)
    assert hop.open_hop()
    vetted = hop.vet(dict(marker))  # no key, no mutual TLS: nothing is believed
    assert vetted == {hop.HEADER: hop.FRAMED} and hop.from_gateway(vetted)  # (the answers' framing only)
    assert _vetted(marker) is hop.NO_HOP
    assert hop.decode(pb.ModelInferRequest().parameters, vetted) is hop.NO_HOP
    assert _vetted({**marker, hop.AUTH_HEADER: hop.token(KEY)}) is hop.NO_HOP  # a token, but no key to check it
    hop.authenticate(KEY, mutual=False)
    assert not hop.open_hop()
    assert _vetted(marker) is hop.NO_HOP  # the marker alone
    assert _vetted({**marker, hop.AUTH_HEADER: hop.token(b"y" * 32)}) is hop.NO_HOP  # another key
    signed = dict(hop.stream_metadata())  # what a gateway with the key sends on a new stream
    assert set(signed) == {hop.HEADER, hop.AUTH_HEADER}
    vetted = hop.vet(dict(signed))
    assert vetted == {hop.HEADER: hop.VERIFIED} and hop.from_gateway(vetted)  # (the token is not kept)
    assert hop.decode(pb.ModelInferRequest().parameters, vetted) is hop.GATEWAY_HOP
    assert _vetted(signed) is hop.NO_HOP  # the same token on another call: replayed
    assert hop.vet(dict(signed)) == {hop.HEADER: hop.FRAMED}
    assert _vetted({hop.HEADER: "client", hop.AUTH_HEADER: hop.token(KEY)}) is hop.NO_HOP
    assert hop.vet({hop.HEADER: "client"}) == {}  # not the gateway's marker: no framing either
    hop.authenticate(None, mutual=True)  # mutual TLS on the gRPC port: every peer holds the mesh CA's certificate
    assert _vetted(marker).queued_ns == 7_000


@pytest.mark.usefixtures("service")
def test_only_vet_makes_a_marker_believed() -> None:
    """decode believes the verified marker by identity: the same characters from a wire (or a
    marker that skipped vet, e.g. an HTTP header) are not it."""
    params = pb.ModelInferRequest.FromString(hop.with_queued(b"", 7)).parameters
    assert hop.decode(params, {hop.HEADER: hop.GATEWAY}) is hop.NO_HOP
    copy = "".join(("gateway", "\x00verified"))
    assert copy == hop.VERIFIED and hop.decode(params, {hop.HEADER: copy}) is hop.NO_HOP
    assert _vetted({hop.HEADER: copy}) is hop.NO_HOP
    assert not hop.from_gateway({hop.HEADER: hop.GATEWAY}) and not hop.from_gateway({hop.HEADER: copy})
    assert hop.vet({"x": "y"}) == {"x": "y"}


@pytest.mark.usefixtures("service")
def test_a_gateway_deletes_every_marker() -> None:
    hop.authenticate(KEY, mutual=False)
    hop.trust_marker(False)
    assert hop.vet(dict(hop.stream_metadata())) == {}
