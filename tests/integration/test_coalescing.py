"""Coalescing through a real gateway and service: HTTP clients' requests (binary and JSON
outputs) merge with each other and with gRPC ones, every client gets its own rows rendered the
way it asked, and a malformed member of a burst gets its own error without failing the others."""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import _wait_http_ready, start
from tests.support.metrics import sample as _get
from tests.support.metrics import scrape as _scrape

BURST = 16


@pytest.fixture(scope="module")
def gateway(stack):
    """A gateway of its own (its counters start at zero) in front of the session's service."""
    gw = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc])
    try:
        _wait_http_ready(gw.http)
        yield gw
    finally:
        gw.stop()


def _data(i: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((1, 16), i, np.float32), np.arange(16, dtype=np.float32).reshape(1, 16)


Call = Callable[[], Callable[[], object]]  # connects, then returns the request to send at the start signal


def _http_call(url: str, i: int, binary: bool) -> Callable[[], object]:
    c = httpclient.InferenceServerClient(url)
    c.is_server_live()  # connected before the burst starts
    return lambda: _http_infer(c, i, binary)


def _http_infer(c: httpclient.InferenceServerClient, i: int, binary: bool) -> tuple[np.ndarray, np.ndarray]:
    a, b = _data(i)
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        inp = httpclient.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(value, binary_data=binary)
        inputs.append(inp)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    with c:
        res = c.infer("add_sub", inputs, outputs=outputs)
    body = res.get_response()
    for out in body["outputs"]:  # rendered as this client asked: binary, or JSON data
        assert ("data" in out) != binary and ("binary_data_size" in out.get("parameters", {})) == binary
    return res.as_numpy("OUTPUT0"), res.as_numpy("OUTPUT1")


def _grpc_call(url: str, i: int, short: bool = False) -> Callable[[], object]:
    """``short``: INPUT1 carries 10 floats for its [1, 16] shape."""
    c = grpcclient.InferenceServerClient(url)
    c.is_server_live()
    a, b = _data(i)
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        inp = grpcclient.InferInput(name, [1, 16], "FP32")
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    if short:
        inputs[1]._raw_content = inputs[1]._raw_content[:40]

    def call() -> tuple[np.ndarray, np.ndarray]:
        with c:
            res = c.infer("add_sub", inputs)
        return res.as_numpy("OUTPUT0"), res.as_numpy("OUTPUT1")
    return call


def _burst(calls: list[Call]) -> list[object]:
    """Connect each of ``calls`` (one thread and connection each), then send them all at once;
    their results or exceptions."""
    results: list[object] = [None] * len(calls)
    start_line = threading.Barrier(len(calls))

    def run(k: int) -> None:
        try:
            action = calls[k]()
        finally:
            start_line.wait()
        try:
            results[k] = action()
        except Exception as exc:  # the test inspects it
            results[k] = exc
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _merged(gw) -> float:
    return _get(_scrape(gw.http), "meshserve_gateway_merged_requests_total")


def _counters(gw) -> dict[str, float]:
    text = _scrape(gw.http)
    return {k: _get(text, f"meshserve_gateway_{k}_total")
            for k in ("merged_requests", "merged_sends", "coalesce_queued", "coalesce_held", "coalesce_wait_us")}


def _check(results: list[object]) -> None:
    for i, res in enumerate(results):
        assert not isinstance(res, BaseException), res
        a, b = _data(i)
        out0, out1 = res  # type: ignore[misc]
        np.testing.assert_array_equal(out0, a + b)
        np.testing.assert_array_equal(out1, a - b)


@pytest.mark.parametrize("mix", ["http-binary", "http-json", "http-and-grpc"])
def test_http_requests_merge_and_each_gets_its_own_rows(gateway, mix: str) -> None:
    before = _merged(gateway)
    counters = _counters(gateway)
    for _attempt in range(10):  # until a burst met a busy model in the gateway (timing on a shared machine)
        calls: list[Call] = []
        for i in range(BURST):
            if mix == "http-and-grpc" and i % 3 == 2:
                calls.append(lambda i=i: _grpc_call(gateway.grpc, i))
            else:
                binary = mix == "http-binary" or (mix == "http-and-grpc" and i % 3 == 0)
                calls.append(lambda i=i, binary=binary: _http_call(gateway.http, i, binary))
        _check(_burst(calls))
        if _merged(gateway) > before:
            break
    assert _merged(gateway) > before, "no HTTP request of 10 bursts of 16 was merged"
    d = {k: v - counters[k] for k, v in _counters(gateway).items()}
    # every merged request queued in its group first, and queueing takes time
    assert d["coalesce_queued"] >= d["merged_requests"] >= 2 * d["merged_sends"] > 0
    assert d["coalesce_wait_us"] > 0


def test_a_malformed_member_of_a_burst_fails_alone(gateway) -> None:
    """A gRPC request whose tensor bytes do not match its shape passes the gateway's merge check
    (which reads no bytes) and is found out by the merge: it is sent alone and gets the
    service's own error, and the requests it would have joined are answered."""
    bad = BURST // 2
    before = _merged(gateway)
    for _attempt in range(10):
        calls: list[Call] = [lambda i=i: _grpc_call(gateway.grpc, i, short=i == bad) for i in range(BURST)]
        results = _burst(calls)
        err = results[bad]
        assert isinstance(err, InferenceServerException), err
        assert err.status() == "StatusCode.INVALID_ARGUMENT"
        assert "INPUT1" in err.message(), err.message()
        results[bad] = (_data(bad)[0] + _data(bad)[1], _data(bad)[0] - _data(bad)[1])
        _check(results)
        if _merged(gateway) > before:
            break
    assert _merged(gateway) > before, "no request of 10 bursts of 16 was merged"
