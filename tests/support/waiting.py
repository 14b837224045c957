"""Waiting for a condition instead of sleeping a fixed time.

``eventually(check)`` calls ``check`` until it returns a truthy value (which it returns) or
stops raising AssertionError, and fails with what it saw last when the deadline passes. The
check is whatever the test waits for: a statistics count, a /metrics sample, a replica's
health, a line in a process's output. A fixed sleep either waits too long on an idle machine
or too little on a busy one; a poll waits exactly as long as the condition takes.

In-process async code that has nothing to wait *for* (a check that something did not happen,
an order of arrivals) runs the event loop a number of passes instead (``loop_passes``): no clock
moves, so the outcome does not depend on the machine's speed.

Sleeps that are the point of a test (a slow client's pacing, "nothing may happen in this
window") stay as they are, with a comment saying so.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

INTERVAL_S = 0.02


def _failure(what: str, timeout: float, last: object, error: AssertionError | None) -> AssertionError:
    said = f": {error}" if error is not None and str(error) else ""
    return AssertionError(f"{what or 'the condition'} did not hold within {timeout}s (last: {last!r}){said}")


def eventually(check: Callable[[], T], timeout: float = 20.0, what: str = "", *, interval: float = INTERVAL_S) -> T:
    """``check()``'s first truthy result, polled every ``interval`` s for up to ``timeout`` s;
    an AssertionError raised by ``check`` counts as "not yet" until the deadline, then is re-raised."""
    deadline = time.monotonic() + timeout
    while True:
        error: AssertionError | None = None
        try:
            last = check()
            if last:
                return last
        except AssertionError as exc:
            last, error = None, exc  # type: ignore[assignment]
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, last, error) from error
        time.sleep(interval)  # the poll interval: this is the polling everything else uses


async def eventually_async(check: Callable[[], T | Awaitable[T]], timeout: float = 10.0, what: str = "", *,
                           interval: float = 0.001) -> T:
    """``eventually`` on an event loop: ``check`` may be a plain or an async callable; the loop
    keeps running between polls (the default interval is short: in-process conditions)."""
    deadline = time.monotonic() + timeout
    while True:
        error: AssertionError | None = None
        try:
            got = check()
            last = await got if isinstance(got, Awaitable) else got
            if last:
                return last  # type: ignore[return-value]
        except AssertionError as exc:
            last, error = None, exc
        if time.monotonic() >= deadline:
            raise _failure(what, timeout, last, error) from error
        await asyncio.sleep(interval)  # the poll interval (as above)


async def loop_passes(times: int = 20) -> None:
    """Let every ready task run for ``times`` event-loop passes, no clock involved: enough for
    in-process work that needs no I/O to reach its next wait (or to do what it must not)."""
    for _ in range(times):
        await asyncio.sleep(0)
