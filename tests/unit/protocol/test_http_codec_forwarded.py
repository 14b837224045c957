"""http_codec.ForwardedRequest: a templated request whose message is made only when read
(parse_infer with ``forwarded``, a gateway's HTTP front door where its pipeline forwards the
bytes): it reads as the full parse's message, field by field, for bodies made by the real
tritonclient encoder; the template's name, version and id are read without a parse; a write
reaches the message; a request naming shared memory, or the first of its template, is a plain
message. And which front doors get one (http_frontend.HttpFrontend.forwarded)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.cache import CacheConfig
from gateway.core import GatewayCore
from gateway.ensemble.catalog import EnsembleCatalog
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import http_codec
from meshserve.protocol.http_codec import ForwardedRequest, parse_infer, parse_infer_request
from meshserve.server.http_frontend import HttpFrontend
from meshserve.telemetry import tracing
from tests.unit.protocol.test_http_codec_template import body, f32


@pytest.fixture(autouse=True)
def _empty_caches() -> None:
    http_codec._templates.clear()
    http_codec._json_templates.clear()


FIELDS = ("model_name", "model_version", "id", "parameters", "inputs", "outputs", "raw_input_contents")


def _same(request: Any, message: pb.ModelInferRequest) -> None:
    for name in FIELDS:
        assert getattr(request, name) == getattr(message, name), name
    assert request.SerializeToString() == message.SerializeToString()


@pytest.mark.parametrize("binary_in", [True, False])
def test_a_forwarded_request_reads_as_its_message(binary_in: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    first, hl = body({"A": f32(0), "B": f32(1)}, binary_in=binary_in, request_id="req-7", outputs=("X", "Y"))
    request, plan, raw = parse_infer(first, hl, "m", "2", True)
    assert request.__class__ is pb.ModelInferRequest and raw is None  # (its template made now: a message)
    parsed: list[bytes] = []
    real = pb.ModelInferRequest.FromString
    monkeypatch.setattr(pb.ModelInferRequest, "FromString", lambda data: parsed.append(data) or real(data))
    for seed in range(2, 5):
        again, hl2 = body({"A": f32(seed), "B": f32(seed + 10)}, binary_in=binary_in, request_id="req-7",
                          outputs=("X", "Y"))
        forwarded, plan2, raw2 = parse_infer(again, hl2, "m", "2", True)
        assert forwarded.__class__ is ForwardedRequest and plan2 is plan and raw2 is not None
        assert forwarded.raw is raw2
        # the template's name, version and id, without a parse
        assert (forwarded.model_name, forwarded.model_version, forwarded.id) == ("m", "2", "req-7")
        assert parsed == []
        full = parse_infer_request(again, hl2, "m", "2")
        _same(forwarded, full)  # any other field: the message, parsed from the bytes once
        assert parsed == [raw2] and forwarded.message() is forwarded.message()  # (parsed once)
        assert forwarded.raw_input_contents[0] == f32(seed).tobytes()
        parsed.clear()


def test_a_write_reaches_the_message() -> None:
    first, hl = body({"A": f32(0)}, request_id="a")
    parse_infer(first, hl, "m", "", True)
    forwarded, _, raw = parse_infer(first, hl, "m", "", True)
    assert forwarded.__class__ is ForwardedRequest
    forwarded.model_name = "renamed"  # (as an A/B route's choice does)
    forwarded.model_version = "3"
    forwarded.id = "b"
    forwarded.parameters["p"].int64_param = 5
    message = forwarded.message()
    assert (message.model_name, message.model_version, message.id, message.parameters["p"].int64_param) == \
        ("renamed", "3", "b", 5)
    assert (forwarded.model_name, forwarded.model_version, forwarded.id) == ("renamed", "3", "b")
    forwarded.Clear()  # a method of the message: the fields read are the message's from then on
    assert (forwarded.model_name, forwarded.id, len(forwarded.inputs)) == ("", "", 0)
    assert raw is not None and pb.ModelInferRequest.FromString(raw).model_name == "m"  # (the bytes as they came)
    with pytest.raises(AttributeError):
        forwarded.no_such_field  # noqa: B018


def test_shared_memory_or_no_template_is_a_message() -> None:
    for _ in range(2):
        shm, hl = body({"A": f32(0)}, shm_output=True)
        request, plan, _ = parse_infer(shm, hl, "m", "", True)
        assert request.__class__ is pb.ModelInferRequest and plan is not None and plan.shared_memory
    for _ in range(2):  # forwarded=False (the direct service): always the message
        plain, hl = body({"A": f32(1)})
        request, _, raw = parse_infer(plain, hl, "m", "")
        assert request.__class__ is pb.ModelInferRequest
    assert raw is not None


def test_only_a_gateway_that_forwards_bytes_gets_forwarded_requests(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    plain = HttpFrontend(GatewayCore(["127.0.0.1:1"]))  # type: ignore[arg-type]
    assert plain.forwards and plain.forwarded("add_sub")
    monkeypatch.setattr(tracing, "enabled", True)  # spans read the message: not while tracing
    assert not plain.forwarded("add_sub")
    monkeypatch.setattr(tracing, "enabled", False)
    cached = HttpFrontend(GatewayCore(["127.0.0.1:1"], cache=CacheConfig.parse(["local,size=1048576"])))  # type: ignore[arg-type]
    assert not cached.forwards and not cached.forwarded("add_sub")
    routed = HttpFrontend(GatewayCore(["127.0.0.1:1"], routes=_NoRoutes()))  # type: ignore[arg-type]
    assert not routed.forwards
    (tmp_path / "ens").mkdir()  # (an ensemble whose config does not compile is still the catalog's name)
    (tmp_path / "ens" / "config.pbtxt").write_text('name: "ens" platform: "ensemble"')
    catalog = EnsembleCatalog(tmp_path)
    with_ensembles = HttpFrontend(GatewayCore(["127.0.0.1:1"], ensembles=catalog))  # type: ignore[arg-type]
    assert with_ensembles.forwarded("add_sub") and not with_ensembles.forwarded("ens")

    class _Service:  # a core without the attribute (the direct service's V2Core)
        pass

    assert not HttpFrontend(_Service()).forwards  # type: ignore[arg-type]


class _NoRoutes:
    def bind(self, *args: Any) -> None:
        pass

    def lookup(self, name: str) -> None:
        return None


def test_the_last_template_is_taken_only_for_its_name_version_and_header() -> None:
    """parse_infer keeps the last template found (``_templates.last``): a body of the same model
    name and version that starts with its header takes it; any other (a header of the same length
    that differs in one byte, another name or version, a body that is not bytes) is looked up by
    its own key, and every request is the full parse's."""
    a, hl = body({"A": f32(0)}, request_id="a")
    b, hl_b = body({"A": f32(1)}, request_id="b")  # the same header length, one byte apart
    assert hl_b == hl and a[:hl] != b[:hl]
    sequence = [(a, "m", ""), (a, "m", ""), (b, "m", ""), (a, "m", ""), (b, "m", ""), (a, "m2", ""),
                (a, "m", "2"), (a, "m", ""), (bytearray(b), "m", ""), (memoryview(a), "m", "")]
    for data, name, version in sequence:
        request, plan, _ = parse_infer(data, hl, name, version)
        assert plan is not None and request == parse_infer_request(data, hl, name, version)
        last = http_codec._templates.last
        assert last is not None and (last[0], last[1], last[2]) == (name, version, bytes(data[:hl]))
        assert http_codec._templates[(name, version, bytes(data[:hl]))] is last[3]
    assert len(http_codec._templates) == 4
    http_codec._templates.clear()
    assert http_codec._templates.last is None
    assert parse_infer(a, hl, "m", "")[2] is None  # (a template made again)
