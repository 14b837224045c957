"""--model-load-thread-count: how many model loads a service runs at once (Triton's flag, default 4),
and the measuring that stays true while they overlap (docs/model-control.md, "Loading in parallel").

A version's size is the service process's resident growth during its build (services/base/memory.py).
With several builds at once, each one's before/after difference would also hold the others'
growth, and their sum would count it N times. `SharedGrowth` splits the growth instead: read at
every build's start and end, the growth since the last read is shared among the builds running
in that interval, so the shares always add up to the process's real growth (one build at a time:
exactly its before/after difference, as before).
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
    """Splits a process's resident growth among the builds that overlap (thread-safe). Each build
    says what it expects to take (its files: a version's size is never counted below them); growth
    goes first to the builds still short of their expectation, in proportion to what each lacks;
    memory freed comes first off the builds above theirs; the rest either way is split evenly. A
    build that loaded its weights before another started keeps them; the other's go to the other."""

    def __init__(self, read: Callable[[], int]):
        self._read = read
        self._lock = threading.Lock()
        self._shares: dict[int, list[float]] = {}  # token -> [bytes so far, bytes expected]
        self._ids = itertools.count()
        self._last = 0

    def begin(self, expected: int = 0) -> int:
        """A build starts: its token for ``end``."""
        with self._lock:
            self._advance()
            token = next(self._ids)
            self._shares[token] = [0.0, float(expected)]
            return token

    def end(self, token: int) -> int:
        """A build ended: its share of the growth while it ran (bytes; negative when memory was freed)."""
        with self._lock:
            self._advance()
            return round(self._shares.pop(token)[0])

    def _advance(self) -> None:
        now = self._read()
        delta, self._last = now - self._last, now
        if not self._shares:
            return
        rest = float(delta)
        # growth fills what builds lack first; memory freed comes first off what builds hold beyond
        # their expectation (another's temporary buffer, counted to them while it was allocated)
        gaps = {t: (want - got if delta > 0 else got - want) for t, (got, want) in self._shares.items()}
        gaps = {t: g for t, g in gaps.items() if g > 0}
        total = sum(gaps.values())
        if total:
            part = min(1.0, abs(rest) / total)
            sign = 1.0 if delta > 0 else -1.0
            for t, gap in gaps.items():
                self._shares[t][0] += sign * gap * part
            rest -= sign * total * part
        share = rest / len(self._shares)
        for entry in self._shares.values():
            entry[0] += share
