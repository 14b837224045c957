"""The mesh benchmark's Triton case (load/bench/mesh_triton.py): its memory cap holds (a cgroup of
our own, or the RSS watchdog where none can be made), its verdict names what happened, and, where the
real tritonserver is installed (../shared/bench/README.md), a small run: served when the cap has
room for every model, out of memory (processes OOM-killed at the cap, their models' requests
failing) when it has room for a few."""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

import pytest

from load.bench import mesh, mesh_triton
from load.bench.sbs import triton_binary

VENV = Path("/tmp/bench-venvs/triton")
GROW = "import time\nheld = []\nfor _ in range(400):\n    held.append(bytearray(b'x') * (1 << 20))\n    time.sleep(0.005)\ntime.sleep(60)\n"


def test_the_watchdog_kills_a_tree_at_its_cap() -> None:
    child = subprocess.Popen([sys.executable, "-c", GROW])
    meter = mesh_triton.Meter(child.pid, 120 << 20, None)
    watcher = mesh_triton.threading.Thread(target=meter.run, daemon=True)
    watcher.start()
    try:
        assert child.wait(30) == -9
        assert meter.killed_by_watchdog and 120 << 20 <= meter.peak_tree_rss < 300 << 20  # (it would reach 400)
    finally:
        meter.stop.set()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_cgroup_cap_oom_kills_inside_it_and_goes_away() -> None:
    group = mesh_triton.Cgroup.make(96 << 20, f"meshbench-test-{random.randrange(1 << 30)}")
    if group is None:
        pytest.skip("no writable memory cgroup here (the watchdog covers that case)")
    try:
        child = subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs),
                                  sys.executable, "-c", GROW])
        assert child.wait(60) == -9
        assert group.oom_kills() >= 1 and group.peak() <= 96 << 20
    finally:
        group.close()
    assert not group.path.exists()


def test_the_verdict_says_refused_out_of_memory_or_served() -> None:
    served = {"load_attempts": 3, "loads_ok": 3, "ready_after_loads": 3, "stub_processes_after_loads": 3,
              "server_alive_after_loads": True, "oom_kills_after_mix": 0, "failed": 0}
    assert mesh_triton.verdict(served).startswith("served: all 3 models")
    oom = {**served, "oom_kills_after_mix": 2, "stub_processes_after_loads": 1, "failed": 9}
    assert mesh_triton.verdict(oom).startswith("out of memory: 3 of 3 loads accepted, 2 processes OOM-killed")
    assert mesh_triton.verdict({**served, "server_alive_after_loads": False}).startswith("out of memory at 3")
    assert mesh_triton.verdict({**served, "killed_by_watchdog": True}).startswith("out of memory at 3")
    assert mesh_triton.verdict({**served, "loads_ok": 1}).startswith("refused: 1 of 3")


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    if triton_binary(VENV) is None:
        pytest.skip(f"no tritonserver in {VENV}")
    repo = tmp_path_factory.mktemp("mesh_triton")
    sizes = mesh.build_repository(repo, 4, 1.0, 1.0)
    return repo, sorted(sizes)


def _run(repo: Path, names: list[str], cap: int, tmp: Path) -> dict[str, object]:
    args = argparse.Namespace(triton_venv=VENV, triton_load_limit=120.0, triton_duration=4.0, clients=2)
    return mesh_triton.run(repo, names, [1.0] * len(names), args, cap, tmp)


def test_triton_serves_the_set_when_the_cap_has_room(small_repo: tuple[Path, list[str]], tmp_path: Path) -> None:
    repo, names = small_repo
    r = _run(repo, names, 1 << 30, tmp_path)
    assert r["loads_ok"] == 4 and r["ready_after_loads"] == 4 and r["stub_processes_after_loads"] == 4, r
    assert r["requests"] > 0 and r["failed"] == 0, r["failures"]
    assert str(r["outcome"]).startswith("served"), r["outcome"]


def test_triton_runs_out_of_memory_when_the_cap_holds_a_few(small_repo: tuple[Path, list[str]],
                                                            tmp_path: Path) -> None:
    repo, names = small_repo
    before = mesh_triton._stub_regions()
    # tritonserver (~35 MiB) and about two python stubs (~33 MiB each charged) fit
    r = _run(repo, names, 110 << 20, tmp_path)
    assert mesh_triton._stub_regions() == before  # (the killed stubs' /dev/shm regions went with them)
    assert str(r["outcome"]).startswith("out of memory"), r["outcome"]
    if r["server_alive_after_loads"]:  # a stub was killed, not the server: its model's requests fail
        assert r["failed"] > 0 and any("Stub process" in why for why in r["failures"]), r["failures"]  # type: ignore[attr-defined]
    if r["peak_cgroup_bytes"] is not None:  # the cgroup's own peak: the cap held
        assert r["peak_cgroup_bytes"] <= 110 << 20, r["peak_cgroup_bytes"]  # type: ignore[operator]
    else:
        assert r["killed_by_watchdog"], r
