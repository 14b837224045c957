"""The text log format escapes control characters in a message (what a client sent may be in it)
and keeps a stack trace's lines; both formats bound a line's length, argument by argument
(meshserve/telemetry/text_lines.py)."""
from __future__ import annotations

import json
import logging
import sys

import pytest

from meshserve.telemetry.logs import TEXT_FORMAT, formatter
from meshserve.telemetry.text_lines import ARG_MAX, LINE_MAX, MESSAGE_MAX, TextFormatter, clip


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


# ---- lengths: a client's strings are cut (ARG_MAX, MESSAGE_MAX, LINE_MAX) -------------------------

def test_clip_says_how_much_it_left_out() -> None:
    assert clip("abc", 3) == "abc"
    assert clip("abcdef", 3) == "abc...[3 more characters]"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_long_argument_is_cut_before_the_message_is_made(fmt: str) -> None:
    rec = record("infer %s/%s id=%s: %s", "m", "1", "i" * 1_000_000, "short")
    rec.request_id = "r" * 1_000_000  # (a request line's extra field)
    line = formatter(fmt).format(rec)
    assert len(line) < 3 * ARG_MAX, len(line)
    assert "i" * ARG_MAX + f"...[{1_000_000 - ARG_MAX} more characters]: short" in line
    if fmt == "json":
        out = json.loads(line)
        assert out["request_id"] == "r" * ARG_MAX + f"...[{1_000_000 - ARG_MAX} more characters]"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_long_message_is_cut(fmt: str) -> None:
    """A message made before it was logged (an f-string) is cut at MESSAGE_MAX; escapes come after
    the cut, so a message of control characters is at most four times that."""
    line = formatter(fmt).format(record("x" * 100_000))
    assert f"...[{100_000 - MESSAGE_MAX} more characters]" in line and len(line) < MESSAGE_MAX + 200
    line = formatter("text").format(record("\x00" * 100_000))
    assert len(line) < 4 * MESSAGE_MAX + 200 and "\n" not in line


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_stack_trace_is_cut_at_the_line_bound(fmt: str) -> None:
    try:
        raise ValueError("v" * 1_000_000)
    except ValueError:
        info = sys.exc_info()
    rec = logging.LogRecord("meshserve.request", logging.ERROR, __file__, 1, "internal error", (), info)
    line = formatter(fmt).format(rec)
    assert len(line) < LINE_MAX + 200 and "more characters]" in line


def test_a_mapping_argument_is_cut() -> None:
    rec = logging.LogRecord("x", logging.WARNING, __file__, 1, "id=%(id)s n=%(n)d", ({"id": "i" * 10_000, "n": 3},),
                            None)
    line = formatter("text").format(rec)
    assert line.endswith(f"id={'i' * ARG_MAX}...[{10_000 - ARG_MAX} more characters] n=3")
