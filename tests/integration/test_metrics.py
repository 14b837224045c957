"""Prometheus /metrics on the gateway and the service move as known traffic says, and agree
with the statistics extension."""
from __future__ import annotations

import queue
import signal

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from meshserve.server import access
from tests.support import eventually
from tests.support.metrics import Samples
from tests.support.metrics import sample as _get
from tests.support.metrics import scrape as _scrape

MODEL = {"model": "add_sub", "version": "1"}


def _stats(hostport: str) -> dict:
    with httpclient.InferenceServerClient(hostport) as c:
        return c.get_inference_statistics("add_sub", "1")["model_stats"][0]


def _inputs(cols: int = 16) -> list[grpcclient.InferInput]:
    out = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [1, cols], "FP32")
        inp.set_data_from_numpy(np.ones((1, cols), dtype=np.float32))
        out.append(inp)
    return out


def test_counters_and_histograms_follow_known_traffic(stack) -> None:
    svc0, gw0 = _scrape(stack.service.http), _scrape(stack.gateway.http)
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        for _ in range(10):
            c.infer("add_sub", _inputs())
        with pytest.raises(Exception, match="shape"):
            c.infer("add_sub", _inputs(cols=15))  # invalid: rejected by the service's validation
    svc1, gw1 = _scrape(stack.service.http), _scrape(stack.gateway.http)

    def delta(name: str, **labels: str) -> float:
        return _get(svc1, name, **MODEL, **labels) - _get(svc0, name, **MODEL, **labels)

    executions = delta("nv_inference_exec_count")
    assert delta("nv_inference_request_success") == 10
    assert delta("nv_inference_request_failure", reason="OTHER") == 1
    assert delta("nv_inference_count") == 10
    assert 1 <= executions <= 10
    assert delta("nv_inference_request_duration_us") > 0
    assert delta("nv_inference_compute_infer_duration_us") > 0
    # histograms: request (successes and failures), queue (successes), per execution compute and batch size
    assert delta("nv_inference_request_duration_histogram_us_count") == 11
    assert delta("nv_inference_request_duration_histogram_us_bucket", le="+Inf") == 11
    assert delta("nv_inference_queue_duration_histogram_us_count") == 10
    assert delta("nv_inference_compute_duration_histogram_us_count") == executions
    assert delta("nv_inference_batch_size_count") == executions
    assert delta("nv_inference_batch_size_sum") == 10
    assert delta("nv_inference_batch_size_bucket", le="1") <= executions
    # buckets are cumulative
    b = [_get(svc1, "nv_inference_request_duration_histogram_us_bucket", **MODEL, le=le)
         for le in ("100", "1000", "10000", "+Inf")]
    assert b == sorted(b)
    assert _get(svc1, "nv_inference_pending_request_count", **MODEL) == 0

    # gateway: outcomes by model, upstream latency by replica
    def gdelta(name: str, **labels: str) -> float:
        before = [v for (n, lab), v in gw0.items() if n == name and set(labels.items()) <= lab]
        return _get(gw1, name, **labels) - sum(before)

    assert gdelta("meshserve_gateway_requests_total", model="add_sub", outcome="OK") == 10
    assert gdelta("meshserve_gateway_requests_total", model="add_sub", outcome="INVALID_ARG") == 1
    replica = {"replica": stack.service.grpc}
    assert gdelta("meshserve_gateway_upstream_duration_us_count", **replica) >= 11
    assert _get(gw1, "meshserve_gateway_replica_healthy", **replica) == 1


def _settled_stats(hostport: str) -> dict:
    """The statistics once two successive reads are identical: no request of the model is still
    being counted (another test's traffic on the session ``stack`` may still be draining)."""
    last = [_stats(hostport)]

    def same_twice() -> dict:
        now, before = _stats(hostport), last[0]
        last[0] = now
        assert now == before, "the statistics still move"
        return now

    return eventually(same_twice, what="two identical successive statistics reads")


def _scrape_between_equal_stats(hostport: str) -> tuple[Samples, dict]:
    """A /metrics scrape taken between two identical statistics reads, and those statistics: the
    two reads are not atomic together, so they are compared only when nothing moved around the
    scrape (retried while something did)."""
    def bracketed() -> tuple[Samples, dict]:
        before = _settled_stats(hostport)
        samples = _scrape(hostport)
        assert _stats(hostport) == before, "the statistics moved during the scrape"
        return samples, before

    return eventually(bracketed, what="a scrape with the statistics unchanged around it")


def test_metrics_agree_with_the_statistics_extension(stack) -> None:
    with grpcclient.InferenceServerClient(stack.gateway.grpc) as c:
        c.infer("add_sub", _inputs())
    samples, stats = _scrape_between_equal_stats(stack.service.http)
    inf = stats["inference_stats"]
    assert inf["success"]["count"] >= 1  # the request above at least
    assert _get(samples, "nv_inference_request_success", **MODEL) == inf["success"]["count"]
    assert _get(samples, "nv_inference_request_failure", **MODEL) == inf["fail"]["count"]
    assert _get(samples, "nv_inference_count", **MODEL) == stats["inference_count"]
    assert _get(samples, "nv_inference_exec_count", **MODEL) == stats["execution_count"]
    assert _get(samples, "nv_inference_queue_duration_us", **MODEL) == int(inf["queue"]["ns"]) // 1000
    assert _get(samples, "nv_inference_compute_infer_duration_us", **MODEL) == \
        int(inf["compute_infer"]["ns"]) // 1000
    assert _get(samples, "nv_inference_request_duration_histogram_us_count", **MODEL) == \
        inf["success"]["count"] + inf["fail"]["count"]
    assert _get(samples, "nv_inference_batch_size_count", **MODEL) == stats["execution_count"]
    assert _get(samples, "nv_inference_batch_size_sum", **MODEL) == stats["inference_count"]
    per_size = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])}
    assert sum(per_size.values()) == stats["execution_count"]


def test_gateway_federates_each_replica_with_its_label(stack, model_repo) -> None:
    """--federate-metrics: the gateway's /metrics carries every replica's nv_* samples, labelled
    replica=<its gRPC endpoint>, equal to what each replica reports itself; a replica that goes
    away drops out (federated_up 0) while the others stay."""
    from tests.conftest import _wait_http_ready, start

    other = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                   "--model-control-mode", "explicit", "--load-model", "add_sub"])
    gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc,
                     "--upstream", other.grpc, "--federate-metrics", "--coalesce-inflight", "0"])
    try:
        _wait_http_ready(gateway.http)
        replicas = {stack.service.grpc: stack.service.http, other.grpc: other.http}
        with grpcclient.InferenceServerClient(gateway.grpc) as c:
            for _ in range(10):  # until the gateway has sent requests to the new replica too
                for _ in range(8):
                    c.infer("add_sub", _inputs())
                if _get(_scrape(other.http), "nv_inference_request_success", **MODEL) > 0:
                    break
        own = {grpc: _get(_scrape(http), "nv_inference_request_success", **MODEL) for grpc, http in replicas.items()}
        assert own[other.grpc] >= 1

        def federated() -> dict:
            fed = _scrape(gateway.http)
            got = {grpc: _get(fed, "nv_inference_request_success", **MODEL, replica=grpc) for grpc in replicas}
            assert got == own
            return fed

        # one read of the services serves the gateway's scrapes for half a second
        fed = eventually(federated, what="the federated counts")
        assert _get(fed, "nv_inference_request_success", **MODEL) == sum(own.values())  # summed over replicas
        assert _get(fed, "nv_model_load_duration_secs", **MODEL, replica=other.grpc) > 0
        assert _get(fed, "nv_inference_first_response_histogram_ms_count", **MODEL, replica=other.grpc) == \
            own[other.grpc]
        assert _get(fed, "meshserve_gateway_federated_up", replica=other.grpc) == 1
        with grpc.insecure_channel(other.grpc) as channel:  # the RPC the gateway reads them with
            scrape = channel.unary_unary(f"/{access.METRICS_SERVICE}/Scrape")
            assert b"nv_inference_request_success{" in scrape(b"", timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                scrape(b"not empty", timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in (err.value.details() or "")

        other.stop(signal.SIGKILL)  # gone at once (a SIGTERM drain waits out the gateway's open streams)

        def without_other() -> dict:
            fed = _scrape(gateway.http)
            gone = not any(n == "nv_inference_request_success" and ("replica", other.grpc) in lab for n, lab in fed)
            assert gone
            return fed

        fed = eventually(without_other, what=f"{other.grpc}'s samples gone from the federated /metrics")
        assert _get(fed, "meshserve_gateway_federated_up", replica=other.grpc) == 0
        assert _get(fed, "nv_inference_request_success", **MODEL, replica=stack.service.grpc) == \
            own[stack.service.grpc]
    finally:
        gateway.stop()
        other.stop()


def _burst(url: str, n: int) -> None:
    """``n`` concurrent add_sub requests on one client; returns when all are answered."""
    answers: queue.Queue[object] = queue.Queue()
    with grpcclient.InferenceServerClient(url) as c:
        for _ in range(n):
            c.async_infer("add_sub", _inputs(), lambda result, error: answers.put(error))
        assert [answers.get(timeout=20) for _ in range(n)] == [None] * n


def test_gateway_counts_the_requests_it_merges(stack) -> None:
    """Coalescing is visible in /metrics: merged sends, and the client requests they carried,
    which the service still counts one by one."""
    from tests.conftest import _wait_http_ready, start

    gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", stack.service.grpc,
                     "--coalesce-inflight", "1"])  # one send at a time: the rest of a burst waits and merges
    try:
        _wait_http_ready(gateway.http)
        gw0, svc0 = _scrape(gateway.http), _scrape(stack.service.http)
        assert _get(gw0, "meshserve_gateway_merged_sends_total") == 0
        assert _get(gw0, "meshserve_gateway_merged_requests_total") == 0
        sent = 0
        for _attempt in range(10):  # until a burst reached the gateway while its first request was out
            _burst(gateway.grpc, 16)
            sent += 16
            gw1 = _scrape(gateway.http)
            if _get(gw1, "meshserve_gateway_merged_sends_total") > 0:
                break
        sends = _get(gw1, "meshserve_gateway_merged_sends_total")
        merged = _get(gw1, "meshserve_gateway_merged_requests_total")
        assert sends >= 1, "no burst of 16 was merged by a gateway with --coalesce-inflight 1"
        assert 2 * sends <= merged <= sent
        assert _get(gw1, "meshserve_gateway_requests_total", model="add_sub", outcome="OK") == sent
        svc1 = _scrape(stack.service.http)
        assert _get(svc1, "nv_inference_count", **MODEL) - _get(svc0, "nv_inference_count", **MODEL) == sent
        assert _get(svc1, "nv_inference_exec_count", **MODEL) - _get(svc0, "nv_inference_exec_count", **MODEL) \
            <= sent - merged + sends  # each merged send ran as (at most) one execution
    finally:
        gateway.stop()


def test_every_process_reports_how_late_its_event_loop_runs(tmp_path) -> None:
    """meshserve_event_loop_lag_seconds on a service's and a gateway's /metrics: its count grows
    while the loop turns, and a process held still (SIGSTOP for 0.4 s, as a long callback or the
    scheduler would hold its loop) shows an observation over 0.25 s, on that process only."""
    import os
    import time

    from tests.conftest import _wait_http_ready, start

    empty = tmp_path / "empty"
    empty.mkdir()
    service = start(["service", "onnx", "--repository", str(empty), "--grpc-port", "0", "--http-port", "0"])
    gateway = None
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc])
        _wait_http_ready(gateway.http)
        name = "meshserve_event_loop_lag_seconds"

        def late(hostport: str) -> tuple[float, float]:
            """(observations, those over 0.25 s)"""
            got = _scrape(hostport)
            count = _get(got, f"{name}_count")
            return count, count - _get(got, f"{name}_bucket", le="0.25")

        for proc, what in ((service, "the service"), (gateway, "the gateway")):
            first, _ = late(proc.http)
            eventually(lambda p=proc, n=first: late(p.http)[0] >= n + 3, what=f"{name} counting on {what}")
        before = {p.http: late(p.http)[1] for p in (service, gateway)}
        os.kill(service.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.4)
        finally:
            os.kill(service.proc.pid, signal.SIGCONT)
        eventually(lambda: late(service.http)[1] >= before[service.http] + 1, what="the service's stall observed")
        assert late(gateway.http)[1] == before[gateway.http]  # (the gateway was not held)
    finally:
        if gateway is not None:
            gateway.stop()
        service.stop()
