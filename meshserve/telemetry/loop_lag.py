"""How late the process's event loop runs: ``meshserve_event_loop_lag_seconds``.

A gateway or service does all its request work on one event loop, one core's worth at most
(docs/perf: the serial stages). When that loop is saturated or held (a long callback, a large
body decoded inline, the garbage collector, the process descheduled), every request waits
before the loop turns to it, and nothing else on `/metrics` says so: request durations include
the wait only for requests already read. A timer due every ``INTERVAL_S`` notes how late it
ran; its lateness is what any callback scheduled at that moment waited. Sampled at a fixed
period, the histogram is the lag a request arriving at a random moment meets, and its
``_count`` grows by ``1 / INTERVAL_S`` a second while the loop turns at all (a stalled loop shows
as a count that stops, then one large observation).

Cost: one timer callback every 0.1 s (a bisect and three adds; ~10 wake-ups a second of an
otherwise idle process). The histogram is a fixed array: the family is a constant number of
lines whatever the traffic.
"""
from __future__ import annotations

import asyncio

from meshserve.telemetry import metrics

INTERVAL_S = 0.1
# upper bounds in seconds: uvloop's timers are of millisecond resolution, so nothing finer
BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

FAMILIES = {
    "event_loop_lag": metrics.Family(
        "meshserve_event_loop_lag_seconds", "histogram",
        f"How late the process's event loop ran a timer due every {INTERVAL_S:g} s: what a request "
        "arriving then waited before the loop turned to it"),
}


class LoopLag:
    """The timer and its histogram; ``start`` on the serving loop, ``stop`` when it drains."""

    __slots__ = ("interval", "histogram", "_handle", "_due", "_loop")

    def __init__(self, interval: float = INTERVAL_S) -> None:
        self.interval = interval
        self.histogram = metrics.Histogram(BUCKETS_S)
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Watch ``loop`` (the running one by default); a second start moves the watch to it."""
        self.stop()
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._due = self._loop.time() + self.interval
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        self.histogram.observe(max(0.0, now - self._due))
        self._due = now + self.interval  # (from now: a stall is one late observation, not a burst of them)
        self._handle = loop.call_at(self._due, self._tick)


WATCH = LoopLag()  # the process's (meshserve/server/process.py:serve starts it)


def samples(watch: LoopLag | None = None) -> list[metrics.Sample]:
    """The watch's histogram as a /metrics sample (``FAMILIES``)."""
    return [("event_loop_lag", {}, (WATCH if watch is None else watch).histogram)]
