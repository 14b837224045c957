"""Triton's logging extension (``GET/POST /v2/logging``, gRPC ``LogSettings``) over Python logging.

Triton's settings and what each means here:

- ``log_info``, ``log_warning``, ``log_error`` (bool): whether records of that severity are
  written (each on its own, as in Triton: warnings can be off while errors stay on);
- ``log_verbose_level`` (uint): above 0, DEBUG records too (one line per request, among others);
- ``log_format``: ``default`` (meshserve's text lines), ``ISO8601`` (the same with an ISO 8601
  UTC timestamp) or ``json`` (meshserve's one-object-per-line format, ``--log-format json``);
- ``log_file``: ``""``; meshserve writes to stderr, and a file cannot be set at run time (a log
  collector or a shell redirect does that job).

The starting values come from ``--log-level`` and ``--log-format``. Only a process that set up
its logging with ``meshserve.server.process.setup_logging`` has settings to change; a gateway's
workers share theirs (meshserve/server/workers.py), and an update goes on where the process's
models log (meshserve/server/observe.py:log_setting: a gateway's services, a python service's
workers).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from meshserve.telemetry.text_lines import TextFormatter

KEYS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
FORMATS = ("default", "ISO8601", "json")


class SettingError(ValueError):
    """An update names an unknown setting or a value of the wrong type or range."""


class _Severities(logging.Filter):
    """Drops the records whose severity is switched off (the logger level lets the rest through)."""

    def __init__(self) -> None:
        super().__init__()
        self.info = self.warning = self.error = True
        self.verbose = 0

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return self.error
        if level >= logging.WARNING:
            return self.warning
        if level >= logging.INFO:
            return self.info
        return self.verbose > 0


class LogSettings:
    """The settings of this process's stderr handler (made by setup_logging)."""

    def __init__(self, handler: logging.Handler, level: int, fmt: str):
        self.handler = handler
        # the settings /v2/logging set, as set (what a python service hands its workers, whose own
        # starting point differs: a model's INFO lines show whatever the service's level)
        self.explicit: dict[str, Any] = {}
        self.severities = _Severities()
        handler.addFilter(self.severities)
        self.format = "json" if fmt == "json" else "default"
        s = self.severities
        s.verbose = 1 if level < logging.INFO else 0
        s.info = level <= logging.INFO
        s.warning = level <= logging.WARNING
        s.error = level <= logging.ERROR

    def current(self) -> dict[str, Any]:
        s = self.severities
        return {"log_file": "", "log_info": s.info, "log_warning": s.warning, "log_error": s.error,
                "log_verbose_level": s.verbose, "log_format": self.format}

    def update(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Apply ``changes`` (all or nothing) and return the settings now in force."""
        for key, value in changes.items():
            _check(key, value)
        s = self.severities
        self.explicit.update(changes)
        for key, value in changes.items():
            if key == "log_verbose_level":
                s.verbose = value
            elif key == "log_format" and value != self.format:
                self.format = value
                self.handler.setFormatter(_formatter(value))
            elif key in ("log_info", "log_warning", "log_error"):
                setattr(s, key.removeprefix("log_"), value)
        # the root level lets through the lowest severity that is on, so that code asking
        # isEnabledFor(DEBUG) (the per-request lines) skips the work when nothing would be written
        lowest = logging.DEBUG if s.verbose else logging.INFO if s.info else logging.WARNING if s.warning \
            else logging.ERROR if s.error else logging.CRITICAL
        logging.getLogger().setLevel(lowest)
        return self.current()


def _formatter(fmt: str) -> logging.Formatter:
    # (logs imports tracing: not at import time, which a python-backend worker pays at its start)
    from meshserve.telemetry.logs import TEXT_FORMAT, formatter

    if fmt == "ISO8601":
        iso = TextFormatter(TEXT_FORMAT, "%Y-%m-%dT%H:%M:%SZ")
        iso.converter = time.gmtime
        return iso
    return formatter("json" if fmt == "json" else "text")


def _check(key: str, value: Any) -> None:
    if key not in KEYS:
        raise SettingError(f"unknown log setting '{key}' (known: {', '.join(KEYS)})")
    if key in ("log_info", "log_warning", "log_error"):
        if not isinstance(value, bool):
            raise SettingError(f"log setting '{key}' must be a boolean, got {value!r}")
    elif key == "log_verbose_level":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SettingError(f"log setting 'log_verbose_level' must be an integer of 0 or more, got {value!r}")
    elif key == "log_format":
        if value not in FORMATS:
            raise SettingError(f"log setting 'log_format' must be one of {', '.join(FORMATS)}, got {value!r}")
    elif value != "":  # log_file
        raise SettingError(f"log setting 'log_file' cannot be set to {value!r}: meshserve logs to stderr "
                           "(redirect it, or run meshserve under a log collector)")


# this process's settings, made by setup_logging (None where logging was set up some other way)
active: LogSettings | None = None


def install(handler: logging.Handler, level: int, fmt: str) -> None:
    global active
    active = LogSettings(handler, level, fmt)
