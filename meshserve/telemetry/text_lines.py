"""The text log lines' formatter, with nothing but ``logging`` imported (the Python backend's
model processes use it too: services/python/worker.py keeps its imports light)."""
from __future__ import annotations

import logging

# Control characters in a text line's message, written as escapes: a message may carry what a
# client sent (a model name, a request id, an error's text), and a newline in it would start a
# line of the client's making in the log ("log injection"). A stack trace keeps its lines.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                 0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029"})  # (Unicode's line breaks)


# The length of what a line may carry. A request id, a model's input name or an error's text is
# the client's, up to --max-request-bytes each: a failed request with a 10 MB id wrote ~20 MB of
# log (the gateway's line and the service's), and the failed-request line budget bounds lines, not
# bytes. So each string argument of a line is cut at ARG_MAX characters before the message is
# made, the message at MESSAGE_MAX, and the whole line (a stack trace included) at LINE_MAX.
ARG_MAX = 2048
MESSAGE_MAX = 16384
LINE_MAX = 65536


def clip(text: str, limit: int = ARG_MAX) -> str:
    """``text`` cut at ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"


def clip_args(record: logging.LogRecord) -> None:
    """Cut the record's long string arguments (``clip``) before its message is made of them."""
    args = record.args
    if isinstance(args, tuple):
        if any(isinstance(a, str) and len(a) > ARG_MAX for a in args):
            record.args = tuple(clip(a) if isinstance(a, str) else a for a in args)
    elif isinstance(args, dict):  # (a record made with one mapping argument)
        record.args = {k: clip(v) if isinstance(v, str) else v for k, v in args.items()}


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT lines, with control characters in the message escaped (``_ESCAPES``) and
    lengths bounded (``ARG_MAX``, ``MESSAGE_MAX``, ``LINE_MAX``)."""

    def format(self, record: logging.LogRecord) -> str:
        clip_args(record)
        return clip(super().format(record), LINE_MAX)

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = clip(record.message, MESSAGE_MAX)
        if not message.isprintable():
            message = message.translate(_ESCAPES)
        record.message = message
        return super().formatMessage(record)
