"""load/bench/ratios.py: the side-by-side table from drive.py's JSON lines (no servers)."""
from __future__ import annotations

import json
from pathlib import Path

from load.bench import ratios


def write(res: Path, label: str, *records: dict) -> None:
    with (res / f"{label}.jsonl").open("a") as f:
        for r in records:
            f.write(json.dumps({"ok": True, "model": "add_sub", "mode": "grpc", "concurrency": 8, **r}) + "\n")


def test_the_quietest_run_counts_and_noisy_cells_are_marked(tmp_path: Path) -> None:
    write(tmp_path, "triton", {"infer_per_s": 1000, "p99_us": 4000, "avg_batch": 6.6, "cpu_foreign_cores": 0.02})
    # the gateway's cell ran twice: the noisy first run does not count
    write(tmp_path, "meshserve-gateway",
          {"infer_per_s": 500, "p99_us": 9000, "avg_batch": 3.0, "cpu_foreign_cores": 0.9},
          {"infer_per_s": 1100, "p99_us": 3500, "avg_batch": 7.8, "cpu_foreign_cores": 0.05})
    write(tmp_path, "meshserve-direct", {"infer_per_s": 1200, "p99_us": 3000, "avg_batch": 7.9, "cpu_foreign_cores": 0.3})
    text = ratios.table(tmp_path)
    row = next(line for line in text.splitlines() if line.startswith("| add_sub | grpc | 8 |"))
    assert row == ("| add_sub | grpc | 8 | 1000 | 1100 | 1200 | 1.10 | 0.92 | 4.0 / 3.5 / 3.0 | 6.6 / 7.8 / 7.9 "
                   "| 0.30 ⚠ | 3/3 |")
    assert "cells meeting all three goals: 1 of 18" in text
    assert sum(line.startswith("| add_sub ") or line.startswith("| mlp ") for line in text.splitlines()) == 18
    # only the direct cell stays above the bound: side_by_side.sh measures it again
    assert ratios.noisy(tmp_path, "meshserve-direct") == [("add_sub", "grpc", 8)]
    assert ratios.noisy(tmp_path, "meshserve-gateway") == []


def test_missing_runs_show_as_dashes(tmp_path: Path) -> None:
    write(tmp_path, "meshserve-gateway", {"infer_per_s": 900, "p99_us": 3500, "avg_batch": 7.8, "cpu_foreign_cores": 0.0})
    row = next(line for line in ratios.table(tmp_path).splitlines() if line.startswith("| add_sub | grpc | 8 |"))
    assert row.startswith("| add_sub | grpc | 8 | – | 900 | – | – | – |")  # no Triton, no direct: no ratios
    assert row.endswith("| 0.00 | – |")  # and no verdict
