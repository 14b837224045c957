"""The processes a test run left behind, found by a token in their environment.

scripts/test.sh runs the parallel part of the suite with ``MESHSERVE_SUITE_RUN=<token>`` in its
environment. Every process the tests start inherits it (servers, their workers, `meshserve up`'s
children, a process that lost its parent or left its session), so after that pytest has exited,
any process still carrying the token is one the parallel part left behind. The serial part
(tight latency bounds) starts only once there are none:

    python3 -m tests.support.leftovers TOKEN [--timeout S]

waits (polling, at most S seconds) until no process carries the token, then exits 0. Processes
still there at the deadline are listed (pid, age, command line) and killed with SIGKILL, so
that the serial part starts clean either way; the listing names the leak to fix. Exit status 0 when none were left, 3 when some had to be killed.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

# the process-group waits live with the bench's stop_process (load/bench/procs.py), named here too
from load.bench.procs import cmdline, end_group, group_members  # noqa: F401

ENV = "MESHSERVE_SUITE_RUN"
INTERVAL_S = 0.1


def carrying(token: str, name: str = ENV) -> dict[int, str]:
    """pid -> command line of every process (but this one) whose environment has ``name``=token
    (ENV by default; tests/support/up.py marks each `meshserve up` with a variable of its own)."""
    needle = f"{name}={token}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        line = cmdline(int(entry.name))
        if line:  # a zombie has none: it holds no CPU, only its parent's wait
            found[int(entry.name)] = line
    return found


def _age_s(pid: int) -> float:
    try:
        start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def wait_gone(token: str, timeout: float, name: str = ENV) -> dict[int, str]:
    """Poll until no process carries the token or ``timeout`` s pass; what is still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = carrying(token, name)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(INTERVAL_S)


def kill(pids: dict[int, str]) -> None:
    """SIGKILL each process (only those carrying the token: a group or session may be the shell's)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("token")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    left = wait_gone(args.token, args.timeout)
    if not left:
        print(f"leftovers: none ({time.monotonic() - t0:.1f} s)")
        return 0
    print(f"leftovers: {len(left)} process(es) of the run still there after {args.timeout:g} s; killed:",
          file=sys.stderr)
    for pid, line in sorted(left.items()):
        print(f"  pid {pid} (up {_age_s(pid):.0f} s): {line[:300]}", file=sys.stderr)
    kill(left)
    still = wait_gone(args.token, 10)
    if still:
        print(f"leftovers: {len(still)} still there after SIGKILL: {sorted(still)}", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
