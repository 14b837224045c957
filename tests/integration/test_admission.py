"""Bounded admission (--max-inflight / --max-inflight-bytes) with real processes and the real
tritonclient: beyond the bound a request is refused at once with 429 + Retry-After /
RESOURCE_EXHAUSTED naming the limit, the admitted ones are served, and 0 turns it off.

The upstream is tests.integration.slow_service (every request sleeps --delay-ms), so which
requests are in flight together is certain: a burst sent inside one delay all overlaps.
"""
from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Proc, _wait_http_ready, start

DELAY_S = 0.4
BURST = 12
REJECT_FAST_S = 0.2  # a refusal is answered well inside one delay (it never waits for a slot)

pytestmark = pytest.mark.serial  # bursts sent inside one 0.4 s delay: run alone (scripts/test.sh)


def slow(*flags: str) -> Proc:
    return warmed(start(["--grpc-port", "0", "--http-port", "0", "--delay-ms", str(DELAY_S * 1000), *flags],
                        module="tests.integration.slow_service", timeout=60))


def warmed(p: Proc) -> Proc:
    """``p`` after one request alone on each protocol, as a real client's first request would be:
    what a process does once (a gateway's first connection to its upstream, each path's first
    pass) is then not inside the burst that measures how fast a refusal is."""
    try:
        for fn, url, ok in ((http_one, p.http, "200"), (grpc_one, p.grpc, "OK")):
            status, _ = fn(url)
            assert status == ok, status
    except BaseException:
        p.stop()
        raise
    return p


@pytest.fixture(scope="module")
def slow_bounded() -> Iterator[Proc]:
    p = slow("--max-inflight", "4")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def slow_unbounded() -> Iterator[Proc]:
    p = slow("--max-inflight", "0")
    yield p
    p.stop()


def _inputs(m: object) -> list:
    inp = m.InferInput("IN", [1, 4], "FP32")  # type: ignore[attr-defined]
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    return [inp]


def _one(m: object, ok: str, url: str) -> tuple[str, float]:
    """One sleep_a request with tritonclient module m: (ok or "status message", seconds)."""
    t0 = time.monotonic()
    try:
        with m.InferenceServerClient(url) as c:  # type: ignore[attr-defined]
            c.infer("sleep_a", _inputs(m))
        return ok, time.monotonic() - t0
    except InferenceServerException as exc:
        return f"{exc.status()} {exc.message()}", time.monotonic() - t0


def http_one(url: str) -> tuple[str, float]:
    return _one(httpclient, "200", url)


def grpc_one(url: str) -> tuple[str, float]:
    return _one(grpcclient, "OK", url)


def burst(fn: Callable[[str], tuple[str, float]], url: str, n: int = BURST) -> list[tuple[str, float]]:
    """n requests at once (each on its own connection), all sent inside one delay."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, [url] * n))


def check_split(results: list[tuple[str, float]], ok: str, refused: str, admitted: int, limit: str) -> None:
    oks = [t for s, t in results if s == ok]
    refusals = [(s, t) for s, t in results if s != ok]
    assert all(s.startswith(refused) for s, _ in refusals), results  # nothing but OK and the refusal
    # every request overlapped the others (sent inside one delay): exactly `admitted` got in
    assert len(oks) == admitted, results
    assert all(t >= DELAY_S * 0.9 for t in oks), results
    for s, t in refusals:
        assert limit in s and "sleep_a" in s, s  # the message names the limit and the model
        assert t < REJECT_FAST_S, (s, t)


def test_service_http_over_the_bound_gets_429_at_once(slow_bounded: Proc) -> None:
    check_split(burst(http_one, slow_bounded.http), "200", "429", 4, "--max-inflight 4")


def test_service_grpc_over_the_bound_gets_resource_exhausted(slow_bounded: Proc) -> None:
    check_split(burst(grpc_one, slow_bounded.grpc), "OK", "StatusCode.RESOURCE_EXHAUSTED", 4,
                "--max-inflight 4")


def test_429_carries_retry_after(slow_bounded: Proc) -> None:
    host, port = slow_bounded.http.split(":")
    body = json.dumps({"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    answers: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def one() -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("POST", "/v2/models/sleep_a/infer", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            answers.put((r.status, r.getheader("Retry-After")))
        finally:
            conn.close()

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    got = [answers.get_nowait() for _ in range(answers.qsize())]
    assert len(got) == 8 and sorted(s for s, _ in got) == [200] * 4 + [429] * 4, got
    assert all(ra is not None and int(ra) >= 1 for s, ra in got if s == 429), got


def test_each_request_of_a_stream_is_admitted_on_its_own(slow_bounded: Proc) -> None:
    results: queue.Queue[str] = queue.Queue()

    def callback(result: object, error: InferenceServerException | None) -> None:
        results.put("OK" if error is None else f"{error.status()} {error.message()}")

    with grpcclient.InferenceServerClient(slow_bounded.grpc) as c:
        c.start_stream(callback)
        try:
            for i in range(8):
                c.async_stream_infer("sleep_a", _inputs(grpcclient), request_id=str(i))
            got = [results.get(timeout=10) for _ in range(8)]
        finally:
            c.stop_stream()
    assert got.count("OK") == 4, got
    refused = [g for g in got if g != "OK"]
    assert all("RESOURCE_EXHAUSTED" in g or "--max-inflight 4" in g for g in refused), got


def test_bytes_bound_admits_one_request_when_idle_and_refuses_while_busy() -> None:
    p = slow("--max-inflight", "0", "--max-inflight-bytes", "1")
    try:
        check_split(burst(grpc_one, p.grpc, 6), "OK", "StatusCode.RESOURCE_EXHAUSTED", 1,
                    "--max-inflight-bytes 1")
    finally:
        p.stop()


def test_zero_disables_the_bound(slow_unbounded: Proc) -> None:
    results = burst(http_one, slow_unbounded.http, 24)
    assert [s for s, _ in results] == ["200"] * 24, results


def test_gateway_bound_protects_the_service(slow_unbounded: Proc) -> None:
    """A gateway with its own bound in front of an unbounded service: the gateway refuses the
    excess (HTTP and gRPC), counting client requests before it merges them."""
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", slow_unbounded.grpc,
               "--max-inflight", "3"])
    try:
        _wait_http_ready(g.http)
        warmed(g)
        check_split(burst(http_one, g.http), "200", "429", 3, "--max-inflight 3")
        check_split(burst(grpc_one, g.grpc), "OK", "StatusCode.RESOURCE_EXHAUSTED", 3, "--max-inflight 3")
    finally:
        g.stop()


def test_gateway_unbounded_with_zero(slow_unbounded: Proc) -> None:
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", slow_unbounded.grpc,
               "--max-inflight", "0"])
    try:
        _wait_http_ready(g.http)
        results = burst(grpc_one, g.grpc, 24)
        assert [s for s, _ in results] == ["OK"] * 24, results
    finally:
        g.stop()
