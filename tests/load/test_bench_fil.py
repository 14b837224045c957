"""Smoke test of `python -m load.bench.fil` (docs/perf/fil.md): both commands with a tiny forest
and a one-second cell; their tables are there and their numbers plausible."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tl2cgen", reason="the fil bench needs the [fil] extra")

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--trees", "4", "--depth", "3", "--features", "4"]


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "load.bench.fil", *args, *SMALL], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_engines_prints_every_engine_per_row(tmp_path: Path) -> None:
    out = _run("engines", "--repeat", "1")
    rows = re.findall(r"^\| ([^|]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["tl2cgen (XGBoost model)", "tl2cgen (LightGBM model)", "XGBoost inplace_predict",
                                    "LightGBM predict", "Treelite GTIL (XGBoost model)",
                                    "Treelite GTIL (LightGBM model)"], out
    for _, one, many in rows:
        assert 0 < float(many) <= float(one) * 2, out  # a batch costs no more per row than a single row, roughly


def test_serve_compares_the_gateway_with_the_forest_in_process() -> None:
    out = _run("serve", "--seconds", "1", "--concurrency", "1", "2", "--batch", "1")
    assert "engine: " in out and "in process, rows/s: batch 1:" in out, out
    rows = re.findall(r"^\| 1 \| (\d) \| ([\d,]+) \| .* \| (\d+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"], out
    assert all(int(r[1].replace(",", "")) > 0 and r[2] == "0" for r in rows), out
