"""`meshserve up` in a test: started, waited for, read, and stopped with everything it started.

Every test that runs `meshserve up` goes through ``meshserve_up`` (a context manager) or
``start_up`` with ``Up.stop`` in a ``finally``:

- its environment carries the suite run's token (``MESHSERVE_SUITE_RUN``, tests/support/leftovers.py)
  and a marker of its own (``MARKER``), which every process it starts inherits: the gateway and
  its workers, the services, their python workers (in sessions of their own). The stop finds
  them all by the marker, whatever group they are in and whoever adopted them;
- its output (stdout and stderr together) is read to its end on a thread (the pipe never fills),
  and the banner (up to "Press Ctrl-C to stop.", printed once every child said it was ready) is
  waited for with a deadline; the gateway's ports come from it;
- ``Up.stop`` does what Ctrl-C does (SIGINT; `up` takes SIGTERM the same way), waits for `up` to
  exit (SIGKILL after ``timeout``), then polls, at most ``grace`` s, until no process carries its
  marker, and kills (and names, in a warning) any that are left;
- a test failing inside ``meshserve_up`` gets the tail of `up`'s output printed to stderr (pytest
  shows it with the failure).

`up` gets no ``MESHSERVE_HOP_KEY_FILE`` from the test's environment unless ``env`` names one:
by itself it writes a throwaway hop key to its run directory, which is what its tests check.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from load.bench.procs import HOP_KEY_ENV, ROOT, Endpoints
from tests.support import leftovers

MARKER = "MESHSERVE_TEST_UP"  # each `up`'s own token in its environment (and its children's)
BANNER_END = "Press Ctrl-C to stop."
TAIL_LINES = 2000  # the output kept (the banner is kept whole besides)


@dataclass
class Up(Endpoints):
    """A running `meshserve up`: its process, its banner, the gateway's ports read from it."""

    argv: list[str]
    proc: subprocess.Popen[str]
    marker: str
    banner: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    scheme: str = "http"
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    killed: dict[int, str] = field(default_factory=dict)  # what ``stop`` had to kill (a leak)
    copy: TextIO | None = None  # a file every line of output goes to as well (``tee``; closed at its end)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{self.ports['metrics']}"

    def tee(self, path: Path) -> None:
        """From now on each line of `up`'s output goes to ``path`` as well (what it wrote so far
        first): a test that reads a server's log file (NVIDIA's QA) reads it there."""
        out = path.open("a", encoding="utf-8")
        out.write("".join(self.lines))
        out.flush()
        self.copy = out

    def log(self, lines: int = 80) -> str:
        """The last ``lines`` lines of `up`'s output (its children's included)."""
        return "".join(list(self.lines)[-lines:])

    def family(self) -> dict[int, str]:
        """pid -> command line of every live process `up` started (and `up` itself): those
        carrying its marker."""
        return leftovers.carrying(self.marker, MARKER)

    def interrupt(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        """Ctrl-C (``sig``) to `up` alone, and its exit code once it exited (TimeoutExpired after
        ``timeout`` s): what a test checks right after `up` stopped (its children gone with it)
        is still as `up` left it; ``stop`` then ends whatever `up` did not."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0, grace: float = 10.0) -> int:
        """Stop `up` as Ctrl-C does (``sig``; SIGKILL after ``timeout`` s), then wait, at most
        ``grace`` s, until every process it started has exited, and kill those left (a warning
        names them). Returns `up`'s exit code. Calling it again does nothing more."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = leftovers.wait_gone(self.marker, grace, MARKER)
        if left:
            self.killed.update(left)
            leftovers.kill(left)
            leftovers.wait_gone(self.marker, 10, MARKER)
            warnings.warn(f"{len(left)} process(es) of `meshserve up` outlived its stop by {grace:g} s, killed: "
                          f"{left}", stacklevel=2)
        return self.proc.returncode


def start_up(*args: str, timeout: float = 180.0, env: dict[str, str] | None = None, command: str = "up") -> Up:
    """`python -m meshserve up ARGS` from the tree's root, its banner waited for (at most
    ``timeout`` s; RuntimeError with its output when it ends or hangs before it). ``env``: on
    top of this process's environment. ``command``: another subcommand that runs `up`
    (`tritonserver`: Triton's command line)."""
    marker = uuid.uuid4().hex
    environ = {k: v for k, v in os.environ.items() if k != HOP_KEY_ENV}
    environ.update({MARKER: marker, "PYTHONUNBUFFERED": "1", **(env or {})})
    if os.environ.get(leftovers.ENV):  # the suite run's token (scripts/test.sh): leftovers finds strays by it
        environ[leftovers.ENV] = os.environ[leftovers.ENV]
    argv = [sys.executable, "-m", "meshserve", command, *args]
    proc = subprocess.Popen(argv, cwd=ROOT, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    up = Up(argv, proc, marker)
    banner: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            up.lines.append(line)
            if (copy := up.copy) is not None:
                copy.write(line)
                copy.flush()
            if not ready.is_set():
                banner.append(line)
                if BANNER_END in line:
                    ready.set()
        if up.copy is not None:  # (the output ended: the pump, its only writer, closes it)
            up.copy.close()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or not banner or BANNER_END not in banner[-1]:
        up.stop(signal.SIGKILL, grace=5)
        raise RuntimeError(f"meshserve {command} {' '.join(args)}: no banner within {timeout:g} s "
                           f"(exit code {proc.returncode}); its output:\n{up.log()}")
    up.banner = "".join(banner)
    http = re.search(r"HTTP/REST\s+(https?)://\S+?:(\d+)/v2", up.banner)
    grpc = re.search(r"^  gRPC\s+\S+?:(\d+)\s", up.banner, re.M)  # (the banner's line: a service's INFO log line
    # "serving: gRPC 127.0.0.1:PORT" may come before it)
    metrics = re.search(r"Metrics\s+https?://\S+?:(\d+)/metrics", up.banner)
    if grpc is None:  # (no HTTP line: a gateway with --allow-http=false)
        up.stop()
        raise RuntimeError(f"meshserve up: no ports in its banner:\n{up.banner}")
    up.ports = {"grpc": int(grpc.group(1))}
    if http is not None:
        up.scheme = http.group(1)
        up.ports["http"] = int(http.group(2))
    if metrics is not None:
        up.ports["metrics"] = int(metrics.group(1))
    return up


@contextmanager
def meshserve_up(*args: str, timeout: float = 180.0, env: dict[str, str] | None = None,
                 command: str = "up") -> Iterator[Up]:
    """``start_up``, stopped at the end (``Up.stop``); on a failure inside, the tail of its
    output goes to stderr."""
    up = start_up(*args, timeout=timeout, env=env, command=command)
    try:
        yield up
    except BaseException:
        print(f"--- meshserve up {' '.join(args)}: the last of its output ---\n{up.log()}", file=sys.stderr)
        raise
    finally:
        up.stop()
