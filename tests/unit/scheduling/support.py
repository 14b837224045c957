"""Helpers of the scheduling unit tests: time in nanoseconds, and a clock the test moves."""
from __future__ import annotations

MS = 1_000_000  # nanoseconds


class FakeClock:
    """A ``clock`` for the batchers: returns ``now`` (ns), which only the test changes."""

    def __init__(self, now: int = 0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now
