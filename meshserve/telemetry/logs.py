"""Log formatting: the default text lines, or one JSON object per line (``--log-format json``).

Request lines carry ``request_id``, ``trace_id``, ``model``, ``version``, ``protocol``,
``status`` and ``duration_ms`` as ``extra`` fields; JSON output keeps them as keys.
"""
from __future__ import annotations

import json
import logging
import time

from meshserve.telemetry import tracing
from meshserve.telemetry.text_lines import TextFormatter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord attributes a request line may carry via `extra=`.
FIELDS = ("request_id", "trace_id", "model", "version", "protocol", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, request fields, exc (a stack, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in FIELDS:
            value = record.__dict__.get(key)
            if value not in (None, ""):
                out[key] = value
        if "trace_id" not in out and tracing.enabled:
            tid = tracing.trace_id(tracing.current_span())
            if tid:
                out["trace_id"] = tid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format '{fmt}' (text, json)")
