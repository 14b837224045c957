"""--model-load-thread-count: how many model loads a service runs at once (Triton's flag, default 4),
and the measuring that stays true while they overlap (docs/model-control.md, "Loading in parallel").

A version's size is the service process's resident growth during its build (services/base/memory.py).
With several builds at once, each one's before/after difference would also hold the others'
growth, and their sum would count it N times. `SharedGrowth` splits the growth instead: read at
every build's start and end, the growth since the last read is shared evenly among the builds
running in that interval, so the shares always add up to the process's real growth (one build at
a time: exactly its before/after difference, as before).
"""
from __future__ import annotations

import argparse
import itertools
import threading
from collections.abc import Callable

DEFAULT_LOAD_THREADS = 4  # Triton's --model-load-thread-count default
FLAG = "--model-load-thread-count"


def thread_count_argument(text: str) -> int:
    """The flag's value: a whole number of at least 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (models loaded at once), got {value}")
    return value


class SharedGrowth:
    """Splits a process's resident growth among the builds that overlap (thread-safe)."""

    def __init__(self, read: Callable[[], int]):
        self._read = read
        self._lock = threading.Lock()
        self._shares: dict[int, float] = {}
        self._ids = itertools.count()
        self._last = 0

    def begin(self) -> int:
        """A build starts: its token for ``end``."""
        with self._lock:
            self._advance()
            token = next(self._ids)
            self._shares[token] = 0.0
            return token

    def end(self, token: int) -> int:
        """A build ended: its share of the growth while it ran (bytes; negative when memory was freed)."""
        with self._lock:
            self._advance()
            return round(self._shares.pop(token))

    def _advance(self) -> None:
        now = self._read()
        if self._shares:
            share = (now - self._last) / len(self._shares)
            for token in self._shares:
                self._shares[token] += share
        self._last = now
