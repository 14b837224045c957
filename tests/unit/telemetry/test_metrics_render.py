"""Histogram bookkeeping and text rendering, parsed back with prometheus_client."""
from __future__ import annotations

import json
import logging

from prometheus_client.parser import text_string_to_metric_families

from meshserve.telemetry import metrics
from meshserve.telemetry.logs import JsonFormatter


def test_histogram_renders_cumulative_buckets() -> None:
    h = metrics.Histogram((1, 10, 100))
    for v in (0.5, 1, 5, 50, 500):
        h.observe(v)
    h.observe(7, n=3)  # a merged request counts as 3
    fams = {"lat": metrics.Family("x_duration_us", "histogram", "help")}
    text = metrics.render([("lat", {"model": "m"}, h), ], fams).decode()
    (family,) = list(text_string_to_metric_families(text))
    assert family.type == "histogram"
    got = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert got[("x_duration_us_bucket", "1")] == 2
    assert got[("x_duration_us_bucket", "10")] == 6
    assert got[("x_duration_us_bucket", "100")] == 7
    assert got[("x_duration_us_bucket", "+Inf")] == 8
    assert got[("x_duration_us_count", None)] == 8
    assert got[("x_duration_us_sum", None)] == 0.5 + 1 + 5 + 50 + 500 + 21


def test_first_response_histogram_is_the_request_histogram_in_triton_buckets() -> None:
    h = metrics.Histogram()  # microseconds
    for us in (40, 99_000, 100_000, 100_001, 1_999_999, 2_000_000, 4_000_000, 9_000_000):
        h.observe(us)
    ms = h.rescaled(metrics.FIRST_RESPONSE_BUCKETS_MS, 1000)
    assert ms.bounds == (100, 500, 2000, 5000)
    assert ms.counts == [3, 1, 2, 1, 1] and ms.count == 8 and ms.sum == h.sum / 1000


def test_federated_families_merge_with_local_ones_under_one_name() -> None:
    fams = {k: metrics.MODEL_FAMILIES[k] for k in ("request_success", "request_duration_hist")}
    h = metrics.Histogram((10, 100))
    h.observe(5)
    service = metrics.render([("request_success", {"model": "a", "version": "1"}, 4),
                              ("request_duration_hist", {"model": "a", "version": "1"}, h)], fams).decode()
    remote = metrics.federate(service, {"replica": "10.0.0.1:8001"})
    bare = metrics.federate("# HELP up x\n# TYPE up gauge\nup 1\nup{} 2\n", {"replica": 'a"b'})
    gateway_fams = {"gw": metrics.Family("meshserve_gateway_requests_total", "counter", "help"), **fams}
    text = metrics.render([("request_success", {"model": "ens", "version": "1"}, 1)], gateway_fams,
                          [remote, remote, bare]).decode()
    assert text.count("# TYPE nv_inference_request_success counter") == 1
    assert text.count("# TYPE up gauge") == 1
    assert 'nv_inference_request_success{model="ens",version="1"} 1\n' in text
    assert 'nv_inference_request_success{replica="10.0.0.1:8001",model="a",version="1"} 4\n' in text
    assert 'nv_inference_request_duration_histogram_us_bucket{replica="10.0.0.1:8001",model="a",version="1",' \
           'le="10"} 1\n' in text
    assert 'up{replica="a\\"b"} 1\nup{replica="a\\"b"} 2\n' in text
    assert len(remote["nv_inference_request_success"][1]) == 1  # render copies: the input is reused
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(parsed["nv_inference_request_success"].samples) == 3
    assert parsed["nv_inference_request_duration_histogram_us"].type == "histogram"
    assert {s.labels.get("replica") for s in parsed["up"].samples} == {'a"b'}


def test_bare_families_keep_their_own_labels() -> None:
    service = ('# HELP custom_latency_ns a model-defined family\n# TYPE custom_latency_ns counter\n'
               'custom_latency_ns{model="m",version="1"} 7\n'
               '# HELP nv_inference_count x\n# TYPE nv_inference_count counter\nnv_inference_count{model="m"} 1\n')
    fed = metrics.federate(service, {"replica": "r:1"}, frozenset({"custom_latency_ns"}))
    assert fed["custom_latency_ns"][1] == ['custom_latency_ns{model="m",version="1"} 7']
    assert fed["nv_inference_count"][1] == ['nv_inference_count{replica="r:1",model="m"} 1']
    assert metrics.family_names(service) == ["custom_latency_ns", "nv_inference_count"]
    assert metrics.is_model_defined("custom_latency_ns") and not metrics.is_model_defined("nv_inference_count")
    assert not metrics.is_model_defined("meshserve_gateway_requests_total")


def test_json_log_lines_carry_request_fields() -> None:
    record = logging.LogRecord("meshserve.request", logging.WARNING, __file__, 1, "infer %s failed", ("m",), None)
    record.request_id, record.trace_id, record.status = "r1", "ab" * 16, "INVALID_ARG"
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "infer m failed" and line["level"] == "WARNING"
    assert line["request_id"] == "r1" and line["trace_id"] == "ab" * 16 and line["status"] == "INVALID_ARG"
    assert "exc" not in line


def test_record_successes_counts_as_record_success_per_member() -> None:
    """A batch's answers recorded in one call (services/base/model.py) count what one
    record_success per request counted: durations, counts and both histograms."""
    from meshserve.telemetry.model_stats import ModelStats

    members = [(1_000, 1), (250_000, 3), (2_000_000, 1)]  # (arrival ns, client requests)
    start_ns, end_ns = 3_000_000, 9_500_000
    one, batch = ModelStats("m", 1), ModelStats("m", 1)
    for arrival, n in members:
        one.record_success(end_ns - arrival, start_ns - arrival, n)
    batch.record_successes(end_ns, start_ns, members)
    for a, b in ((one.success, batch.success), (one.queue, batch.queue)):
        assert (a.count, a.ns) == (b.count, b.ns) == (5, a.ns) and a.ns > 0
    for a, b in ((one.request_hist, batch.request_hist), (one.queue_hist, batch.queue_hist)):
        assert (a.counts, a.sum, a.count) == (b.counts, b.sum, b.count)
        assert a.count == 5


def test_failure_lines_name_their_labels_in_tritons_order() -> None:
    """Triton (prometheus-cpp) writes a sample's labels in name order; NVIDIA's QA matches the line
    whole: nv_inference_request_failure{model="m",reason="BACKEND",version="1"} (lifecycle_test.py)."""
    from meshserve.telemetry.model_stats import ModelStats

    stats = ModelStats("m", "1")
    stats.record_failure(1000, "BACKEND")
    text = metrics.render(stats.samples({"model": "m", "version": "1"}), metrics.MODEL_FAMILIES).decode()
    assert 'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 1\n' in text
    assert 'nv_inference_request_success{model="m",version="1"} 0\n' in text
