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


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT lines, with control characters in the message escaped (``_ESCAPES``)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if not message.isprintable():
            record.message = message.translate(_ESCAPES)
        return super().formatMessage(record)
