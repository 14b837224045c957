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


def test_json_log_lines_carry_request_fields() -> None:
    record = logging.LogRecord("meshserve.request", logging.WARNING, __file__, 1, "infer %s failed", ("m",), None)
    record.request_id, record.trace_id, record.status = "r1", "ab" * 16, "INVALID_ARG"
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "infer m failed" and line["level"] == "WARNING"
    assert line["request_id"] == "r1" and line["trace_id"] == "ab" * 16 and line["status"] == "INVALID_ARG"
    assert "exc" not in line
