"""Live progress: a rich line when stderr is a terminal and rich is installed, plain lines otherwise."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from load.runner import RunState
from load.transport import OK


class Progress:
    def __init__(self, total_s: float | None, quiet: bool = False):
        self.total_s = total_s
        self.quiet = quiet
        self.seen = 0
        self.last_t = 0.0
        self.errors = 0
        self.live: Any = None
        if not quiet and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.live import Live

                self.live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
                self.live.start()
            except ImportError:
                self.live = None

    def __call__(self, st: RunState, now: float) -> None:
        if self.quiet:
            return
        r = st.record
        n = len(r.status)
        new_lat = np.asarray(r.latency[self.seen:n])
        new_ok = np.asarray([s == OK for s in r.status[self.seen:n]], dtype=bool)
        self.errors += int((~new_ok).sum())
        dt = max(now - self.last_t, 1e-9)
        rate = (n - self.seen) / dt
        ok_lat = new_lat[new_ok] * 1e3
        p50, p99 = (np.percentile(ok_lat, [50, 99]) if ok_lat.size else (float("nan"), float("nan")))
        phase = "warm-up" if now < st.warmup_end else ("done" if st.done else "measure")
        total = f"/{self.total_s:g}s" if self.total_s else "s"
        line = (f"[{phase:7}] t={now:5.1f}{total} rate={rate:8.1f}/s p50={p50:7.2f}ms p99={p99:7.2f}ms "
                f"in-flight={st.inflight:4d} errors={self.errors}")
        self.seen, self.last_t = n, now
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(line, style="red" if self.errors else "green"))
            if st.done:
                self.live.stop()
        else:
            print(line, file=sys.stderr, flush=True)
