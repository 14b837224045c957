"""load/bench/profile_cells.py: the pure parts (py-spy raw profiles, the bound, the process tree)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from load.bench import profile_cells, ratios
from tests.load.test_side_by_side_table import write


def test_a_raw_profile_gives_self_and_inclusive_shares(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text("run (a/x.py:1);serve (a/y.py:2);parse (a/codec.py:9) 30\n"
                   "run (a/x.py:1);serve (a/y.py:2) 10\n"
                   "run (a/x.py:1);parse (a/codec.py:9);parse (a/codec.py:12) 60\n")
    p = profile_cells.read_profile(raw)
    assert p.samples == 100
    assert p.own["parse codec.py"] == 90 and p.own["serve y.py"] == 10
    assert p.inclusive["parse codec.py"] == 90  # a recursive frame counts once per stack
    assert p.inclusive["run x.py"] == 100
    assert profile_cells.top(p.inclusive, p.samples, 1, ("run ",)) == "parse codec.py 90%"
    assert profile_cells.read_profile(tmp_path / "missing.txt").samples == 0


def test_a_threads_profile_gives_each_threads_share_and_no_pseudo_frames(tmp_path: Path) -> None:
    raw = tmp_path / "t.txt"  # py-spy record --threads: the process and thread come first
    raw.write_text("process 7:\"python\";thread (0x1);run (a/x.py:1);parse (a/codec.py:9) 75\n"
                   "process 7:\"python\";thread (0x2);wait (a/pool.py:3) 25\n")
    p = profile_cells.read_profile(raw)
    assert p.threads == {"thread (0x1)": 75, "thread (0x2)": 25}
    assert p.own == {"parse codec.py": 75, "wait pool.py": 25}
    assert not [k for k in p.inclusive if k.startswith(("process", "thread"))]
    text = profile_cells.summary(raw, 1, 2)
    assert " 75.0% thread (0x1)" in text and "-- self (top 1)\n 75.0% parse codec.py\n-- inclusive" in text


def test_the_bound_names_a_full_process_then_the_machine_then_the_latency_chain() -> None:
    assert profile_cells.bound({"gateway": 0.95, "service-onnx": 0.4}, 0.7).startswith(
        "one process at a full core: gateway (0.95 core)")
    assert profile_cells.bound({"gateway": 0.6, "service-onnx": 0.5}, 0.95).startswith("the machine: 95%")
    assert "latency chain" in profile_cells.bound({"gateway": 0.3, "service-onnx": 0.2}, 0.4)
    # a process whose samples are mostly onnxruntime's run is bound by the model, not by Python
    assert "the model's execution: onnxruntime, 60%" in profile_cells.bound(
        {"gateway": 0.2, "service-onnx": 0.97}, 0.6, {"service-onnx": 0.6})


def test_missed_cells_name_their_goals(tmp_path: Path) -> None:
    write(tmp_path, "triton", {"infer_per_s": 1000, "p99_us": 3000, "avg_batch": 8})
    write(tmp_path, "meshserve-gateway", {"infer_per_s": 900, "p99_us": 3500, "avg_batch": 8})
    write(tmp_path, "meshserve-direct", {"infer_per_s": 1200, "p99_us": 2000, "avg_batch": 8})
    cell = next(c for c in ratios.cells(tmp_path) if c.key == ("add_sub", "grpc", 8))
    assert cell.known and cell.missed == ["gw/Triton", "p99", "gw/direct"]
    assert not next(c for c in ratios.cells(tmp_path) if c.key == ("mlp", "grpc", 8)).known


def test_meshserve_processes_are_found_by_role_in_the_tree() -> None:
    # a parent that runs two children whose command lines look like a gateway and a service
    # (each waits for the test's kill: signal.pause, not a timed sleep)
    code = ("import signal, subprocess, sys\n"
            "cmd = [sys.executable, '-c', 'import signal; signal.pause()', 'meshserve']\n"
            "a = subprocess.Popen(cmd + ['gateway']); b = subprocess.Popen(cmd + ['service', 'onnx'])\n"
            "print('up', flush=True); signal.pause()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        found = profile_cells.meshserve_processes(parent.pid)
        assert set(found) == {"gateway", "service-onnx"}
        assert all(profile_cells.cpu_seconds(pid) >= 0 for pid in found.values())
    finally:
        for child in profile_cells.meshserve_processes(parent.pid).values():
            os.kill(child, 9)
        parent.kill()
        parent.wait()
