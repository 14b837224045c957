"""The Hop record: a gateway's private ``meshserve_*`` request parameters and the stream's hop
marker, read once at the front door (observe.read_hop: meshserve.protocol.hop.decode) into
``RequestContext.hop``."""
from __future__ import annotations

import time

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.protocol.hop import GATEWAY_HOP, NO_HOP
from meshserve.server import observe
from meshserve.server.core import InferResult, RequestContext

GATEWAY = {hop.HEADER: hop.VERIFIED}  # a call's metadata once hop.vet authenticated it


def _params(**values: object) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m")
    for key, value in values.items():
        p = req.parameters[key]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            p.int64_param = value
        elif isinstance(value, float):
            p.double_param = value
        else:
            p.string_param = str(value)
    return req


def test_a_request_without_hop_parameters_shares_one_record() -> None:
    assert observe.read_hop(pb.ModelInferRequest().parameters, {}) is NO_HOP
    assert observe.read_hop(pb.ModelInferRequest().parameters, GATEWAY) is GATEWAY_HOP
    assert observe.read_hop(_params(priority=1, timeout=5).parameters, {"user-agent": "x"}) is NO_HOP
    assert GATEWAY_HOP.gateway and not NO_HOP.gateway
    assert (NO_HOP.merged, NO_HOP.queued_ns, NO_HOP.deadline_ns, NO_HOP.traceparents) == (1, 0, None, None)


def test_the_hop_parameters_are_read_into_typed_fields() -> None:
    before = time.monotonic_ns()
    req = _params(**{hop.MERGED: 3, hop.QUEUED: 250, hop.DEADLINE: 2_000_000,
                     hop.TRACEPARENTS: "00-a-b-01\n"})
    record = observe.read_hop(req.parameters, GATEWAY)
    after = time.monotonic_ns()
    assert record.gateway and record.merged == 3 and record.queued_ns == 250_000
    assert record.traceparents == "00-a-b-01\n"
    assert record.deadline_ns is not None and before + 2_000_000_000 <= record.deadline_ns <= after + 2_000_000_000


def test_the_clients_request_id_is_believed_from_a_gateway_only() -> None:
    """meshserve_request_id (the client's id; the hop's own id is the stream's key) fills
    Hop.request_id on a gateway's hop; a direct client's is ignored, and without it a gateway's
    request keeps the shared record."""
    req = _params(**{hop.REQUEST_ID: "client-7"})
    assert observe.read_hop(req.parameters, GATEWAY).request_id == "client-7"
    assert observe.read_hop(req.parameters, {}) is NO_HOP
    assert GATEWAY_HOP.request_id is None and NO_HOP.request_id is None


@pytest.mark.parametrize(("value", "merged"), [
    ("4", 4), ("-2", -2), (4.0, 4), (4.5, None), ("x", None), ("--5", None), ("\u00b2", None), (True, None),
])
def test_merged_count_accepts_every_integer_form_and_marks_the_rest(value: object, merged: int | None) -> None:
    """A non-integer count is None (the model refuses the request, INVALID_ARGUMENT); strings that
    str.isdigit() takes but int() does not ("--5", a superscript) are not integers, not a crash."""
    assert observe.read_hop(_params(**{hop.MERGED: value}).parameters, GATEWAY).merged == merged


def test_queued_time_is_clamped_to_ten_seconds() -> None:
    def queued(v: object) -> int | None:
        return observe.read_hop(_params(**{hop.QUEUED: v}).parameters, GATEWAY).queued_ns
    assert queued(-5) == 0 and queued(20_000_000) == 10_000_000_000 and queued("12") == 12_000
    assert queued("soon") is None


async def test_the_front_door_puts_the_record_on_the_context() -> None:
    seen: list[RequestContext] = []

    class _Core:
        async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
            seen.append(ctx)
            return InferResult(raw=b"")

    ctx = RequestContext("grpc", dict(GATEWAY))
    await observe.infer(_Core(), _params(**{hop.MERGED: 2}), ctx)  # type: ignore[arg-type]
    assert seen[0] is ctx and ctx.hop.gateway and ctx.hop.merged == 2


def test_hop_parameters_without_the_gateway_marker_are_not_believed() -> None:
    """A direct client's meshserve_* parameters change nothing: only a gateway's stream is a hop."""
    req = _params(**{hop.MERGED: 3, hop.QUEUED: 250, hop.DEADLINE: 5,
                     hop.TRACEPARENTS: "00-a-b-01\n"})
    assert observe.read_hop(req.parameters, {}) is NO_HOP
    assert observe.read_hop(req.parameters, {"meshserve-hop": "client"}) is NO_HOP
    assert observe.read_hop(req.parameters, GATEWAY).merged == 3


def test_a_streamed_request_is_marked_only_on_a_gateways_hop() -> None:
    req = _params(**{hop.STREAM: True})
    assert observe.read_hop(req.parameters, GATEWAY).stream
    assert not observe.read_hop(req.parameters, {}).stream  # a direct client cannot claim the hop's marking
    assert not observe.read_hop(_params(**{hop.STREAM: False}).parameters, GATEWAY).stream
    assert not GATEWAY_HOP.stream and not NO_HOP.stream


def test_a_gateway_never_believes_the_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway's callers are clients: with the marker distrusted (GatewayCore.start), a
    client's ``meshserve-hop: gateway`` header is ignored like any other header."""
    monkeypatch.setattr(hop, "trusted", True)
    hop.trust_marker(False)
    req = _params(**{hop.MERGED: 3})
    assert observe.read_hop(req.parameters, GATEWAY) is NO_HOP
    assert not hop.from_gateway(GATEWAY)
    hop.trust_marker(True)
    assert hop.from_gateway(GATEWAY) and observe.read_hop(req.parameters, GATEWAY).merged == 3


async def test_a_forged_merged_count_weighs_at_most_its_rows() -> None:
    """Admission counts a merged request as its members, but never more than the rows it
    carries (each member brings one at least), whatever count a forged marker claims."""
    weights: list[int] = []

    class _Core:
        async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
            weights.append(observe._gate.requests)
            return InferResult(raw=b"")

    for merged, rows, weight in ((1_000_000, 4, 4), (3, 8, 3), (-7, 4, 1), (64, 0, 1)):
        req = _params(**{hop.MERGED: merged})
        req.inputs.add(name="x", datatype="FP32", shape=[rows, 2])
        before = observe._gate.requests
        await observe.infer(_Core(), req, RequestContext("grpc", dict(GATEWAY)))  # type: ignore[arg-type]
        assert weights[-1] - before == weight and observe._gate.requests == before
