"""No bench leaves a server behind, however it ends (load/bench/procs.py:clean_exit, spawn).

A bench's ``finally`` and ``running`` blocks stop what it started only if the bench unwinds:
Python's default action for SIGTERM and SIGHUP ends the process on the spot, and a gateway and
a service it had started ran on, orphaned, for hours. Every bench's ``__main__`` now calls
``clean_exit()`` (SIGTERM, SIGHUP -> SystemExit; at exit every child still running is
stopped), and ``spawn`` puts each server under PR_SET_PDEATHSIG, so even a SIGKILLed bench takes
its servers with it. Here a bench-like process starts a real ONNX service and a gateway with two
workers the way the benches do (``procs.service``, ``procs.gateway``) and a bare
``subprocess.Popen`` child (a load client), forgets to stop any of them, and is signalled.
"""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from onnx import TensorProto

from load.bench import procs
from tests.support import leftovers, models
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]

BENCH = """
import subprocess, sys, time
from pathlib import Path
from load.bench import procs
procs.clean_exit()
work = Path(sys.argv[1])
svc = procs.service(work / "repo", work / "svc.log")
gw = procs.gateway([svc.grpc], work / "gw.log", extra=["--workers", "2"])
client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
try:
    print(svc.pid, gw.pid, client.pid, flush=True)
    time.sleep(600)
finally:
    (work / "unwound").write_text("yes")  # (a bench's finally: it runs on SIGTERM and SIGHUP too)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_signalled_bench_leaves_no_server_behind(tmp_path: Path, sig: signal.Signals) -> None:
    models.write(tmp_path / "repo", "add_sub", models.pair_config("add_sub", "onnxruntime_onnx", 16),
                 {1: models.add_sub(TensorProto.FLOAT)})
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    started: dict[int, str] = {}
    try:
        assert bench.stdout is not None
        svc, gw, client = (int(p) for p in bench.stdout.readline().split())
        workers = eventually(lambda: len(leftovers.group_members(gw)) >= 3 and leftovers.group_members(gw), 60,
                             "the gateway and its two workers in the gateway's group")
        started = {p: procs.cmdline(p) for p in {svc, gw, client, *workers}}
        assert os.getpgid(svc) == svc and os.getpgid(gw) == gw  # each leads a group (not a session)
        assert os.getsid(svc) == os.getsid(gw) == os.getsid(bench.pid)
        bench.send_signal(sig)
        assert bench.wait(60) == (128 + sig if sig != signal.SIGKILL else -signal.SIGKILL)
        servers = {svc, gw, *workers}
        # SIGKILL runs no code in the bench: the kernel's PR_SET_PDEATHSIG stops the servers, and
        # a bare Popen child (the client) is left (load/bench/procs.py:spawn says so)
        gone = servers if sig == signal.SIGKILL else {*servers, client}
        eventually(lambda: not [p for p in gone if _alive(p)], 60, f"{started} gone after {sig.name}")
        assert (tmp_path / "unwound").exists() == (sig != signal.SIGKILL)  # its finally ran
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        leftovers.kill({p: c for p, c in started.items() if _alive(p)})


def test_every_bench_main_calls_clean_exit_and_every_server_is_spawned() -> None:
    """The rule for the next bench too: each ``if __name__ == "__main__":`` block in load/bench
    calls ``clean_exit()`` before anything else it calls, and no bench starts a process in a group
    or a session of its own by hand (only ``procs.spawn`` does: the pdeath guard, the exit stop)."""
    missing, by_hand = [], []
    for path in sorted((ROOT / "load" / "bench").glob("*.py")):
        source = path.read_text()
        if path.name != "procs.py" and ("start_new_session" in source or "process_group" in source):
            by_hand.append(path.name)
        for node in ast.parse(source).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and path.name != "procs.py":
                calls = [n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
                if not calls or "clean_exit" not in ast.unparse(calls[0].func):
                    missing.append(path.name)
    assert missing == [] and by_hand == []
