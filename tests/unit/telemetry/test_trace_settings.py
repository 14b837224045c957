"""trace_settings.py: Triton's trace settings as meshserve applies them (pure logic)."""
from __future__ import annotations

import pytest

from meshserve.telemetry.trace_settings import FULL, SettingError, TraceSettings


@pytest.mark.parametrize(("on", "ratio", "level", "rate"), [
    (True, 0.1, "TIMESTAMPS", "10"),
    (True, None, "TIMESTAMPS", "1"),  # always_on
    (True, 0.0, "TIMESTAMPS", "0"),  # always_off (or ratio 0): no roots
    (True, 0.3, "TIMESTAMPS", "3"),
    (False, None, "OFF", "1000"),  # no exporter: Triton's defaults
])
def test_initial_settings_say_what_the_sampler_does(on: bool, ratio: float | None, level: str, rate: str) -> None:
    s = TraceSettings(on, ratio)
    assert s.effective() == {"trace_file": [""], "trace_level": [level], "trace_rate": [rate], "trace_count": ["-1"],
                             "log_frequency": ["0"], "trace_mode": ["opentelemetry"]}
    assert s.global_bound == (0 if level == "OFF" or rate == "0" else FULL // int(rate))


def test_rate_is_a_ratio_and_a_model_overrides_it_until_cleared() -> None:
    s = TraceSettings(True, 0.1)
    s.update("", {"trace_rate": ["4"]})
    s.update("m", {"trace_rate": ["100"], "log_frequency": ["5"]})
    assert s.root_bound("other") == FULL // 4 and s.root_bound("m") == FULL // 100
    assert s.effective("m")["trace_rate"] == ["100"] and s.effective()["trace_rate"] == ["4"]
    assert s.effective("m")["log_frequency"] == ["5"] and s.effective()["log_frequency"] == ["0"]
    s.update("m", {"trace_rate": None, "log_frequency": []})  # cleared: the global values again
    assert s.root_bound("m") == FULL // 4 and s.effective("m") == s.effective() and "m" not in s.models


def test_level_off_stops_a_model_or_everything_and_a_model_may_stay_on() -> None:
    s = TraceSettings(True, None)
    assert not s.off("m")
    s.update("m", {"trace_level": ["OFF"]})
    assert s.off("m") and s.root_bound("m") == 0 and not s.off("n") and s.root_bound("n") == FULL
    s.update("", {"trace_level": ["OFF"]})
    s.update("n", {"trace_level": ["timestamps"]})
    assert s.off("m") and s.off("x") and not s.off("n") and s.root_bound("n") == FULL and s.global_bound == 0


def test_count_counts_down_sampled_roots_per_scope() -> None:
    s = TraceSettings(True, None)
    assert s.take_root("m") and not s.counting  # no count set: nothing is counted
    s.update("", {"trace_count": ["2"]})
    s.update("m", {"trace_count": ["1"]})
    assert s.take_root("m") and not s.take_root("m")  # m's own count: one
    assert s.effective("m")["trace_count"] == ["0"] and s.root_bound("m") == 0
    assert s.take_root("a") and s.take_root("b") and not s.take_root("c")  # the global count: two
    assert s.effective()["trace_count"] == ["0"] and s.global_bound == 0
    s.update("", {"trace_count": ["-1"]})
    assert s.global_bound == FULL and s.take_root("c") and s.effective()["trace_count"] == ["-1"]


@pytest.mark.parametrize(("model", "changes", "message"), [
    ("", {"trace_colour": ["red"]}, "unknown trace setting 'trace_colour'"),
    ("", {"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
    ("", {"trace_level": ["LOUD"]}, "'LOUD' is not a level"),
    ("", {"trace_level": ["OFF", "TIMESTAMPS"]}, "OFF cannot be combined"),
    ("", {"trace_rate": ["0"]}, "trace_rate must be at least 1"),
    ("", {"trace_rate": ["ten"]}, "'trace_rate' must be an integer, got 'ten'"),
    ("", {"trace_rate": ["1", "2"]}, "takes one value"),
    ("", {"trace_count": ["-2"]}, "trace_count must be -1"),
    ("", {"log_frequency": ["-1"]}, "log_frequency must be 0 or more"),
    ("", {"trace_file": ["/tmp/t.json"]}, "'trace_file' cannot be updated"),
    ("m", {"trace_mode": ["triton"]}, "'trace_mode' cannot be updated"),
    ("", {"trace_rate": None}, "only a model's setting can be cleared"),
])
def test_bad_updates_are_refused_whole(model: str, changes: dict, message: str) -> None:
    s = TraceSettings(True, 0.5)
    before = (s.effective(), s.effective("m"))
    with pytest.raises(SettingError, match=message.replace("(", r"\(")):
        s.update(model, {"trace_count": ["3"], **changes})  # the good key is not applied either
    assert (s.effective(), s.effective("m")) == before


def test_tracing_cannot_be_turned_on_without_an_exporter() -> None:
    s = TraceSettings(False, None)
    with pytest.raises(SettingError, match="no span exporter is configured"):
        s.update("", {"trace_level": ["TIMESTAMPS"]})
    s.update("", {"trace_rate": ["50"], "trace_level": ["OFF"]})  # settings that turn nothing on are kept
    assert s.effective()["trace_rate"] == ["50"] and s.global_bound == 0
