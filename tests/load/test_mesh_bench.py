"""`python -m load.bench --mesh --smoke`: the model mesh benchmark's own run, small (24 models of
1-2 MiB, 3 lazy onnx replicas whose budgets hold about 5 of them each, 4 clients for 6 s): every answer
right, warm and cold requests both seen, loads and evictions counted, each replica's RSS growth
under its budget + the base the service measured of itself + the stated slack."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from load.bench.mesh import RSS_SLACK
from tests.conftest import ROOT


def test_mesh_bench_smoke(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "load.bench", "--mesh", "--smoke", "--out-dir", str(tmp_path),
                          "--repository", str(tmp_path / "models")],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("mesh-*.json")).read_text())
    (case,) = doc["cases"]
    assert case["case"] == "mesh" and case["requests"] > 50, case
    assert case["failed"] == 0, case["failures"]
    assert case["warm"] > 0 and case["cold"] > 0, case
    assert case["loads_per_min"] > 0 and case["evictions_per_min"] > 0, case
    assert len(case["peak_rss_bytes"]) == 3
    assert len(case["base_bytes"]) == 3 and all(50 << 20 < b < 400 << 20 for b in case["base_bytes"]), case
    assert case["rss_bound_bytes"] == doc["budget_bytes"] + max(case["base_bytes"]) + RSS_SLACK
    for peak in case["peak_rss_bytes"]:
        assert 0 < peak <= case["rss_bound_bytes"], (peak, case["rss_bound_bytes"])
    assert case["rss_within_bound"] is True
    # the smoke's setup: each replica's budget holds a model of the largest size per client. At
    # 4 MiB (about two models each) loads evicted models whose requests had not reached them yet,
    # and 1 request in ~1,500 got UNAVAILABLE once the gateway's PLACE_ATTEMPTS ran out: the
    # answer an overcommitted mesh gets (tests/unit/gateway/test_placement_resend.py), not a fault
    largest = max(f.stat().st_size for f in (tmp_path / "models").rglob("*.onnx"))
    assert doc["budget_bytes"] >= doc["clients"] * largest, (doc["budget_bytes"], doc["clients"], largest)
    assert "| mesh |" in out.stdout
