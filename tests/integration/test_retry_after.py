"""A service's retry hint reaches the client through the gateway: a service over its
--max-inflight bound refuses with 429 + Retry-After (HTTP) / RESOURCE_EXHAUSTED +
grpc-retry-pushback-ms (gRPC), and the gateway's answer keeps it, on both front ends.

tritonclient hides response headers and trailing metadata, so the hint is read with raw HTTP and
with tritonclient's own gRPC stub (its status and message with the real tritonclient as well).
The upstream is tests.integration.slow_service: every request sleeps --delay-ms, so a burst sent
inside one delay overlaps and the service refuses what passes its bound.
"""
from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from meshserve.protocol.wire import RETRY_PUSHBACK_METADATA
from tests.conftest import Proc, service_and_gateway

DELAY_MS = 400
BOUND = 2
BURST = 8


@pytest.fixture(scope="module")
def gateway() -> Iterator[Proc]:
    # the gateway's own admission bound stays far above the burst: every refusal is the service's
    with service_and_gateway("", ["--delay-ms", str(DELAY_MS), "--max-inflight", str(BOUND)], timeout=60,
                             module="tests.integration.slow_service") as (_, gw):
        yield gw


def _burst(one: Callable[[], tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    """BURST calls of ``one`` at once: [(status, retry hint or None)]."""
    got: list[tuple[str, str | None]] = []
    lock = threading.Lock()

    def run() -> None:
        outcome = one()
        with lock:
            got.append(outcome)

    threads = [threading.Thread(target=run) for _ in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == BURST, got
    return got


def _check(got: list[tuple[str, str | None]], ok: str, refused: str) -> None:
    statuses = sorted({s for s, _ in got})
    assert set(statuses) <= {ok, refused}, got  # nothing but served and refused
    assert ok in statuses and refused in statuses, got  # the service's bound was passed, and served the rest
    # every refusal says when to come back: Retry-After in whole seconds (at least 1), pushback in ms
    assert all(hint is not None and int(hint) >= 1 for s, hint in got if s == refused), got


def test_http_429_keeps_the_services_retry_after(gateway: Proc) -> None:
    host, port = gateway.http.split(":")
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})

    def one() -> tuple[str, str | None]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("POST", "/v2/models/sleep_a/infer", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read()
            if r.status == 429:
                assert "--max-inflight" in json.loads(text)["error"], text  # the service's own refusal
            return str(r.status), r.getheader("Retry-After")
        finally:
            conn.close()

    _check(_burst(one), "200", "429")


def _request() -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="sleep_a")
    req.inputs.add(name="IN", datatype="FP32", shape=[1, 4])
    req.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    return req


def test_grpc_resource_exhausted_keeps_the_services_pushback(gateway: Proc) -> None:
    def one() -> tuple[str, str | None]:
        with grpc.insecure_channel(gateway.grpc) as channel:
            try:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(_request(), timeout=10)
                return "OK", None
            except grpc.RpcError as exc:
                hint = dict(exc.trailing_metadata() or ()).get(RETRY_PUSHBACK_METADATA)  # type: ignore[attr-defined]
                return str(exc.code()), hint  # type: ignore[attr-defined]

    _check(_burst(one), "OK", "StatusCode.RESOURCE_EXHAUSTED")

