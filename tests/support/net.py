"""Loopback ports for the processes a test starts.

A port the test picks and a process binds a second later must not be taken in between. The
OS's own pick (``bind(("127.0.0.1", 0))``) comes from the ephemeral range, the same range every
outgoing connection on the machine takes its local port from: a fresh-clone CI run lost a
gateway's gRPC port that way ("address already in use" a second after the pick). So the ports
come from below the ephemeral range, where no connect() takes one, each xdist worker from its own
slice of it (two workers never pick the same port), starting at a random place in the slice (two
test runs side by side rarely meet), and each one is bound once to check nothing holds it now.
"""
from __future__ import annotations

import itertools
import os
import random
import socket
from collections.abc import Iterator

_LOWEST = 10000  # below this: the well-known and registered services a machine may run
_SLICES = 16  # xdist workers get one slice each (gw0..gw15; more share by modulo)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the OS's pick below is used if this is wrong


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = worker.removeprefix("gw")
    return int(digits) % _SLICES if digits.isdigit() else 0


def _candidates() -> Iterator[int] | None:
    top = _ephemeral_start()
    size = (top - _LOWEST) // _SLICES
    if size < 100:  # a machine whose ephemeral range starts low: no quiet range to pick from
        return None
    first = _LOWEST + _worker_index() * size
    start = random.randrange(size)
    return itertools.cycle([first + (start + i) % size for i in range(size)])


_ports = _candidates()


def _unbound(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken too
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now and no outgoing connection will take: from
    below the ephemeral range, in this xdist worker's own slice, never the same twice in a row."""
    if _ports is not None:
        for port in itertools.islice(_ports, 1000):
            if _unbound(port):
                return port
    with socket.socket() as s:  # the OS's pick (ephemeral range): only when no quiet port is free
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused_address() -> str:
    """``127.0.0.1:PORT`` where nothing listens: a quiet port from this worker's slice, which no
    other worker picks and no process binding port 0 is given, so it stays refused."""
    return f"127.0.0.1:{free_port()}"
