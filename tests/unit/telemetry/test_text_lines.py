"""The text log format escapes control characters in a message (what a client sent may be in it)
and keeps a stack trace's lines (meshserve/telemetry/text_lines.py)."""
from __future__ import annotations

import logging
import sys

import pytest

from meshserve.telemetry.logs import TEXT_FORMAT, formatter
from meshserve.telemetry.text_lines import TextFormatter


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    return logging.LogRecord("meshserve.request", logging.WARNING, __file__, 1, msg, args, info)


@pytest.mark.parametrize(("sent", "written"), [
    ("nope\n2026-11-30 ERROR x: forged", "nope\\n2026-11-30 ERROR x: forged"),
    ("a\r\nb", "a\\r\\nb"),
    ("tab\there", "tab\\there"),
    ("\x1b[31mred", "\\x1b[31mred"),
    ("nul\x00", "nul\\x00"),
    ("line\u2028sep\u2029par\x85nel", "line\\u2028sep\\u2029par\\x85nel"),
    ("ünïcödé and 'quotes' stay", "ünïcödé and 'quotes' stay"),
])
def test_a_message_is_one_line_whatever_a_client_put_in_it(sent: str, written: str) -> None:
    line = formatter("text").format(record("infer %s failed", sent))
    assert line.endswith(f"infer {written} failed") and "\n" not in line


def test_a_stack_trace_keeps_its_lines() -> None:
    line = TextFormatter(TEXT_FORMAT).format(record("internal error for %s", "m\nx", exc=True))
    first, *rest = line.split("\n")
    assert first.endswith("internal error for m\\nx")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"
