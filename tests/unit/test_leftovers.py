"""tests/support/leftovers.py: the processes a run left behind are found by their token, waited
for, and killed at the deadline; a stopped process's group is emptied."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from load.bench import procs
from tests.support import leftovers
from tests.support.waiting import eventually

# a parent that starts a child in its own group and prints the child's pid; both sleep until killed
ORPHAN_MAKER = ("import subprocess, sys, signal\n"
                "c = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
                "print(c.pid, flush=True); signal.pause()\n")


def test_a_process_left_with_the_token_is_listed_then_killed() -> None:
    token = uuid.uuid4().hex
    env = {**os.environ, leftovers.ENV: token}
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_MAKER], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        parent.kill()  # the child is orphaned, still carrying the token
        parent.wait()
        # (polled: under load a /proc read of a process can miss it for a moment; seen once in ~10 runs)
        eventually(lambda: set(leftovers.carrying(token)) == {child}, 10, "the orphan found by its token")
        assert leftovers.main([token, "--timeout", "0.3"]) == 3  # listed, killed
        assert leftovers.wait_gone(token, 10) == {}
        assert leftovers.main([token, "--timeout", "0.3"]) == 0
    finally:
        leftovers.kill({child: ""})


def test_end_group_kills_what_outlived_the_leader() -> None:
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_MAKER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert leftovers.group_members(parent.pid) == [child]  # the group outlives its leader
        assert list(leftovers.end_group(parent.pid)) == [child]
        assert leftovers.group_members(parent.pid) == []
        assert leftovers.end_group(parent.pid) == {}  # nothing left: nothing sent
    finally:
        leftovers.kill({child: ""})


def test_stop_process_waits_out_the_group_of_a_leader() -> None:
    """load/bench/procs.py:stop_group: the leader stopped, the child it left in its group killed
    after the grace, and the leader reaped only after that (its pid still names the group)."""
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_MAKER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        code, left = procs.stop_group(parent, signal.SIGTERM, 10, grace=0.5)
        assert code == -signal.SIGTERM and list(left) == [child]  # the child did not follow: killed
        assert leftovers.group_members(parent.pid) == []
        assert procs.stop_process(parent) == -signal.SIGTERM  # stopped already: nothing more is sent
    finally:
        leftovers.kill({child: ""})
