"""Sub-millisecond one-shot timers for an event loop, without spinning.

asyncio and uvloop timers are millisecond-grained (epoll rounds up, libuv rounds down), so
a 100 µs queue delay either becomes ~1 ms or, polled per loop pass, burns a core while
idle. Linux timerfd delivers a CLOCK_MONOTONIC deadline (the clock of time.monotonic_ns)
as a readable fd, which the loop watches like a socket: µs precision, no spin.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                         ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


class PreciseTimer:
    """One re-armable timer per owner; `callback` runs on the loop when the deadline passes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]):
        if _LIBC is None:
            raise OSError("timerfd is not available on this platform")
        fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._fd = fd
        self._loop = loop
        self._callback = callback
        self._armed = False
        loop.add_reader(fd, self._fire)

    def arm(self, deadline_ns: int) -> None:
        """Fire at the absolute time.monotonic_ns() deadline (re-arming replaces it)."""
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(max(deadline_ns, 1), 1_000_000_000)
        if _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:  # type: ignore[union-attr]
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed = True

    def disarm(self) -> None:
        if self._armed:
            self._armed = False
            _LIBC.timerfd_settime(self._fd, 0, ctypes.byref(_Itimerspec()), None)  # type: ignore[union-attr]

    def _fire(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        if self._armed:
            self._armed = False
            self._callback()

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        os.close(self._fd)


def available() -> bool:
    return _LIBC is not None
