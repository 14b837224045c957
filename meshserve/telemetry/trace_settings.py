"""Triton's trace extension (``/v2[/models/{m}]/trace/setting``, gRPC ``TraceSetting``) over
meshserve's OpenTelemetry tracing.

Triton's settings, and what each means here (meshserve traces only in OpenTelemetry mode; spans
go to the ``OTEL_*``-configured exporter):

- ``trace_level``: ``OFF`` stops tracing for the model (or everywhere): no new root traces and no
  spans under a client's sampled context either; ``TIMESTAMPS`` traces. ``TENSORS`` (tensor
  contents in the trace) is not supported and refused.
- ``trace_rate``: N traces one root request in N, as a ratio of 1/N applied to the trace id
  (OpenTelemetry's TraceIdRatioBased rule), so on average, not exactly every N-th request as
  Triton counts. ``0`` (only ever reported) means roots are never sampled: the process was
  started with a sampler that samples no roots.
- ``trace_count``: how many more root traces to take (``-1``: no limit); it counts down as roots
  are sampled, and at 0 root sampling stops until it is set again.
- ``log_frequency``: kept and reported; export batching is ``OTEL_BSP_*``'s.
- ``trace_file``, ``trace_mode``: reported (``""``, ``opentelemetry``); cannot be updated.

A model's settings override the global ones key by key; updating a model's key with ``null``
(HTTP) or an empty value list (gRPC) clears the override. Until the first update the process
samples exactly as ``OTEL_TRACES_SAMPLER`` says, and a request pays one attribute read
(``active`` is None); after it, a few dict lookups (``off``, ``root_bound``, ``take_root``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

KEYS = ("trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")
FULL = 1 << 64  # a root is sampled when the low 64 bits of its trace id are below its bound
TRIGGER_KEYS = frozenset({"trace_level", "trace_rate", "trace_count"})  # those that change sampling


class SettingError(ValueError):
    """An update names an unknown setting, a bad value, or one meshserve cannot apply."""


# the one set of settings in force once a trace/setting update has been made (None before)
active: TraceSettings | None = None


class TraceSettings:
    """Global settings and per-model overrides; each value a list of strings (gRPC's form)."""

    def __init__(self, tracing_on: bool, root_ratio: float | None):
        """``root_ratio``: the OTel sampler's ratio for roots (None: always on)."""
        self.tracing_on = tracing_on
        if not tracing_on:
            rate = "1000"  # Triton's default, in force once tracing is turned on
        elif root_ratio is None:
            rate = "1"
        else:
            rate = str(max(1, round(1 / root_ratio))) if root_ratio > 0 else "0"
        self.globals: dict[str, list[str]] = {
            "trace_file": [""], "trace_level": ["TIMESTAMPS" if tracing_on else "OFF"], "trace_rate": [rate],
            "trace_count": ["-1"], "log_frequency": ["0"], "trace_mode": ["opentelemetry"]}
        self.models: dict[str, dict[str, list[str]]] = {}
        self._bounds: dict[str, int] = {}  # per model with its own level/rate/count
        self._off: set[str] = set()  # models (and "" for global) at level OFF
        self.global_bound = 0
        self.counting = False  # some trace_count is >= 0: roots taken must be counted
        self._refresh()

    # ---- reads ----------------------------------------------------------------------------
    def effective(self, model: str = "") -> dict[str, list[str]]:
        own = self.models.get(model, {}) if model else {}
        return {key: list(own.get(key, self.globals[key])) for key in KEYS}

    def root_bound(self, model: str) -> int:
        return self._bounds.get(model, self.global_bound) if self._bounds else self.global_bound

    def off(self, model: str) -> bool:
        """Level OFF for this model: not even a client's sampled context gets spans here."""
        if not self._off:
            return False
        own = self.models.get(model)
        return (model if own is not None and "trace_level" in own else "") in self._off

    def take_root(self, model: str) -> bool:
        """A root of ``model`` passed the ratio: count it against trace_count; False when none is left."""
        if not self.counting:
            return True
        own = self.models.get(model)
        values = own if own is not None and "trace_count" in own else self.globals
        left = int(values["trace_count"][0])
        if left < 0:
            return True
        if left == 0:
            return False
        values["trace_count"] = [str(left - 1)]
        if left == 1:
            self._refresh()  # that was the last one
        return True

    # ---- updates --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The global values and the models' overrides, as JSON."""
        return {"globals": self.globals, "models": self.models}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take the values ``state`` wrote (another gateway worker's settings)."""
        self.globals = {key: list(state["globals"][key]) for key in KEYS}
        self.models = {m: {k: list(v) for k, v in own.items()} for m, own in state["models"].items()}
        self._refresh()

    def update(self, model: str, changes: Mapping[str, Sequence[str] | None]) -> None:
        """Apply ``changes`` (all or nothing); None (or an empty list) clears a model's key."""
        checked: dict[str, list[str] | None] = {}
        for key, value in changes.items():
            if key not in KEYS:
                raise SettingError(f"unknown trace setting '{key}' (known: {', '.join(KEYS)})")
            if value is None or len(value) == 0:
                if not model:
                    raise SettingError(f"trace setting '{key}': only a model's setting can be cleared "
                                       "(the global settings have no default to go back to)")
                checked[key] = None
                continue
            checked[key] = _checked(key, [str(v) for v in value])
        level = checked.get("trace_level")
        if level is not None and level != ["OFF"] and not self.tracing_on:
            raise SettingError("trace_level TIMESTAMPS: tracing is off in this process, since no span exporter is "
                               "configured; start it with OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_TRACES_EXPORTER) set")
        target = self.models.setdefault(model, {}) if model else self.globals
        for key, value in checked.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
        if model and not target:
            del self.models[model]
        self._refresh()

    def _refresh(self) -> None:
        self.global_bound = _bound(self.globals)
        self._bounds = {m: _bound({**self.globals, **own}) for m, own in self.models.items()
                        if TRIGGER_KEYS & own.keys()}
        self._off = {m for m, own in self.models.items() if own.get("trace_level") == ["OFF"]}
        if self.globals["trace_level"] == ["OFF"]:
            self._off.add("")
        self.counting = int(self.globals["trace_count"][0]) >= 0 or any(
            int(own["trace_count"][0]) >= 0 for own in self.models.values() if "trace_count" in own)


def _bound(values: Mapping[str, list[str]]) -> int:
    if values["trace_level"] == ["OFF"] or values["trace_count"] == ["0"]:
        return 0
    rate = int(values["trace_rate"][0])
    return FULL // rate if rate > 0 else 0


def _checked(key: str, value: list[str]) -> list[str]:
    if key == "trace_level":
        levels = [v.strip().upper() for v in value]
        unknown = [v for v in levels if v not in ("OFF", "TIMESTAMPS", "TENSORS")]
        if unknown:
            raise SettingError(f"trace_level '{unknown[0]}' is not a level (OFF, TIMESTAMPS, TENSORS)")
        if "TENSORS" in levels:
            raise SettingError("trace_level TENSORS is not supported: meshserve traces timestamps only "
                               "(OpenTelemetry spans), not tensor contents")
        if "OFF" in levels and len(set(levels)) > 1:
            raise SettingError("trace_level OFF cannot be combined with another level")
        return ["OFF"] if "OFF" in levels else ["TIMESTAMPS"]
    if key in ("trace_file", "trace_mode"):
        raise SettingError(f"trace setting '{key}' cannot be updated: meshserve sends spans to the OpenTelemetry "
                           "exporter the OTEL_* environment configures")
    if len(value) != 1:
        raise SettingError(f"trace setting '{key}' takes one value, got {len(value)}")
    try:
        number = int(value[0])
    except ValueError:
        raise SettingError(f"trace setting '{key}' must be an integer, got '{value[0]}'") from None
    if key == "trace_rate" and number < 1:
        raise SettingError(f"trace_rate must be at least 1 (one request in N is traced), got {number}")
    if key == "trace_count" and number < -1:
        raise SettingError(f"trace_count must be -1 (no limit) or a count of traces, got {number}")
    if key == "log_frequency" and number < 0:
        raise SettingError(f"log_frequency must be 0 or more, got {number}")
    return [str(number)]
