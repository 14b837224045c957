"""A throwaway redis-server on a loopback port (scripts/test.sh installs redis-server; a test
that needs one skips without it). Saving is off: nothing is written to disk."""
from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator

import pytest

from load.bench.procs import stop_process
from tests.support.net import free_port
from tests.support.waiting import eventually


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """(the server's process, its port); killed at the end (SIGKILL ends a stopped one too)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs it)")
    port = free_port()
    server = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        eventually(lambda: accepts(port), timeout=10, what="redis-server accepting")
        yield server, port
    finally:
        stop_process(server, signal.SIGKILL)
