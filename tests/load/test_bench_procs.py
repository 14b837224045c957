"""load/bench/procs.py:spawn and running, the one way the benches (sbs.py, mesh_triton.py,
profile_cells.py) start and stop a process: it leads a group of its own, and when the block ends,
normally, by an exception or by Ctrl-C's KeyboardInterrupt, it is stopped and what it started
(a gateway's workers, tritonserver's stubs, drive.sh's perf_analyzer) is waited out or killed."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from load.bench import procs
from tests.support import leftovers
from tests.unit.test_leftovers import ORPHAN_MAKER


@pytest.mark.parametrize("ending", [None, RuntimeError, KeyboardInterrupt])
def test_running_leaves_nothing_of_the_group_however_the_block_ends(ending: type[BaseException] | None) -> None:
    proc = procs.spawn([sys.executable, "-c", ORPHAN_MAKER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        assert os.getpgid(proc.pid) == proc.pid  # its own group: a terminal's Ctrl-C does not reach it
        with pytest.raises(ending) if ending is not None else contextlib.nullcontext():
            with procs.running(proc, timeout=10) as same:
                assert same is proc
                if ending is not None:
                    raise ending("the bench stopped half-way")
        assert proc.returncode is not None  # reaped
        assert leftovers.group_members(proc.pid) == []  # the child it left in its group is gone too
    finally:
        leftovers.kill({child: ""})

