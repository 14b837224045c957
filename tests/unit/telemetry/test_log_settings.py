"""log_settings.py: Triton's log settings applied to a real logging handler."""
from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from meshserve.telemetry.log_settings import LogSettings, SettingError


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, logging.Handler]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    try:
        yield out, handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _emit_each(log: logging.Logger) -> None:
    log.debug("d-line")
    log.info("i-line")
    log.warning("w-line")
    log.error("e-line")


@pytest.mark.parametrize(("level", "want"), [
    (logging.DEBUG, (True, True, True, 1)),
    (logging.INFO, (True, True, True, 0)),
    (logging.WARNING, (False, True, True, 0)),
    (logging.ERROR, (False, False, True, 0)),
])
def test_the_start_level_is_what_the_settings_say(captured: tuple[io.StringIO, logging.Handler], level: int,
                                                  want: tuple[bool, bool, bool, int]) -> None:
    s = LogSettings(captured[1], level, "text")
    now = s.current()
    assert (now["log_info"], now["log_warning"], now["log_error"], now["log_verbose_level"]) == want
    assert now["log_file"] == "" and now["log_format"] == "default"


def test_each_severity_switches_on_its_own(captured: tuple[io.StringIO, logging.Handler]) -> None:
    out, handler = captured
    s = LogSettings(handler, logging.INFO, "text")
    log = logging.getLogger("meshserve.test_log_settings")
    s.update({"log_verbose_level": 2, "log_warning": False})
    assert logging.getLogger().level == logging.DEBUG and log.isEnabledFor(logging.DEBUG)
    _emit_each(log)
    assert [line.split()[-1] for line in out.getvalue().splitlines()] == ["d-line", "i-line", "e-line"]
    out.truncate(0)
    out.seek(0)
    now = s.update({"log_verbose_level": 0, "log_info": False, "log_warning": True})
    assert not log.isEnabledFor(logging.INFO)  # request lines (DEBUG) cost nothing when off
    _emit_each(log)
    assert [line.split()[-1] for line in out.getvalue().splitlines()] == ["w-line", "e-line"]
    assert (now["log_info"], now["log_warning"], now["log_verbose_level"]) == (False, True, 0)


def test_formats_switch_the_handler(captured: tuple[io.StringIO, logging.Handler]) -> None:
    out, handler = captured
    s = LogSettings(handler, logging.INFO, "text")
    log = logging.getLogger("meshserve.test_log_settings")
    s.update({"log_format": "json"})
    log.warning("as json")
    assert json.loads(out.getvalue().splitlines()[-1])["msg"] == "as json"
    s.update({"log_format": "ISO8601"})
    log.warning("as iso")
    stamp = out.getvalue().splitlines()[-1].split()[0]
    assert len(stamp) == 20 and stamp[10] == "T" and stamp.endswith("Z")
    assert s.current()["log_format"] == "ISO8601"


@pytest.mark.parametrize(("changes", "message"), [
    ({"log_colour": True}, "unknown log setting 'log_colour'"),
    ({"log_info": "yes"}, "'log_info' must be a boolean"),
    ({"log_verbose_level": -1}, "'log_verbose_level' must be an integer of 0 or more"),
    ({"log_verbose_level": True}, "'log_verbose_level' must be an integer"),
    ({"log_format": "xml"}, "'log_format' must be one of default, ISO8601, json"),
    ({"log_file": "/tmp/meshserve.log"}, "'log_file' cannot be set"),
])
def test_bad_updates_are_refused_whole(captured: tuple[io.StringIO, logging.Handler], changes: dict,
                                       message: str) -> None:
    s = LogSettings(captured[1], logging.INFO, "text")
    before = s.current()
    with pytest.raises(SettingError, match=message):
        s.update({"log_info": False, **changes})  # the good key is not applied either
    assert s.current() == before
