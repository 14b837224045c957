"""One event-loop timer for many deadlines (the h2 server's calls, the gateway's hop streams).

A timer per request, made and cancelled for every call, cost more than the rest of a call's
HTTP/2 path (docs/grpc.md); ``asyncio.wait_for`` per request also cost a loop pass and a getpid
system call. ``DeadlineTimer`` keeps one timer, armed for the earliest deadline: it is set again
only when a request brings an earlier one, and otherwise fires about once per timeout.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable


class DeadlineTimer:
    """``expire(now)`` is called when the earliest deadline (loop time) is up: it ends what is due
    at ``now`` and returns the earliest deadline left, or None."""

    __slots__ = ("_loop", "_expire", "_handle", "_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[float], float | None]) -> None:
        self._loop = loop
        self._expire = expire
        self._handle: asyncio.TimerHandle | None = None
        self._at = 0.0

    def add(self, due: float) -> None:
        """A deadline (loop time) to watch."""
        if self._handle is None or due < self._at:
            self._arm(due)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, due: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._at = due
        self._handle = self._loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self._handle = None
        later = self._expire(self._loop.time() + 0.001)  # (the loop's timers have millisecond resolution)
        if later is not None:
            self._arm(later)
