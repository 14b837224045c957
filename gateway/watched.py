"""A YAML file the gateway re-reads when it changes (mtime + size polled at most once a second)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

log = logging.getLogger("meshserve.gateway.config")

T = TypeVar("T")
RELOAD_CHECK_S = 1.0


class WatchedFile(Generic[T]):
    """`parse(text, source)` result of a file, kept current; an invalid edit keeps the previous value."""

    def __init__(self, path: str | Path, parse: Callable[[str, str], T], clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self._parse = parse
        self._clock = clock
        self._stamp = self._stat()
        self.current: T = parse(self.path.read_text(), str(self.path))  # errors here stop startup
        self._checked = clock()

    def _stat(self) -> tuple[int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size

    def get(self) -> T:
        now = self._clock()
        if now - self._checked >= RELOAD_CHECK_S:
            self._checked = now
            self.reload_if_changed()
        return self.current

    def reload_if_changed(self) -> bool:
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            self.current = self._parse(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as exc:
            log.error("%s: keeping the previous version: %s", self.path, exc)
            return False
        log.info("reloaded %s", self.path)
        return True
