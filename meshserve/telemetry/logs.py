"""Log formatting: the default text lines, or one JSON object per line (``--log-format json``).

Request lines carry ``request_id``, ``trace_id``, ``model``, ``version``, ``protocol``,
``status`` and ``duration_ms`` as ``extra`` fields; JSON output keeps them as keys.
"""
from __future__ import annotations

import json
import logging
import time

from meshserve.telemetry import tracing
from meshserve.telemetry.text_lines import LINE_MAX, MESSAGE_MAX, TextFormatter, clip, clip_args

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord attributes a request line may carry via `extra=`.
FIELDS = ("request_id", "trace_id", "model", "version", "protocol", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, request fields, exc (a stack, if any);
    lengths bounded as a text line's (text_lines.py: ``ARG_MAX`` for an argument or a request
    field, ``MESSAGE_MAX`` for msg, ``LINE_MAX`` for exc)."""

    def format(self, record: logging.LogRecord) -> str:
        clip_args(record)
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": clip(record.getMessage(), MESSAGE_MAX),
        }
        for key in FIELDS:
            value = record.__dict__.get(key)
            if value not in (None, ""):
                out[key] = clip(value) if isinstance(value, str) else value
        if "trace_id" not in out and tracing.enabled:
            tid = tracing.trace_id(tracing.current_span())
            if tid:
                out["trace_id"] = tid
        if record.exc_info:
            out["exc"] = clip(self.formatException(record.exc_info), LINE_MAX)
        return json.dumps(out, default=str)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format '{fmt}' (text, json)")
