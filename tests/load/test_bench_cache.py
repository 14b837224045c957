"""`python -m load.bench --cache` (load/bench/cache.py), small: both meshserve gateways (cache off
and on) on the test add_sub, the 90% and 0% repeat mixes, one round. The numbers are not judged
here (the machine is shared); that the run completes, counts hits where it should and nowhere
else, and reports them is."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.bench import __main__ as bench


def test_the_cache_benchmark_runs_small(model_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cache.json"
    bench.main(["--cache", "-n", "120", "--warmup", "10", "--rounds", "1", "-c", "4", "--hot", "10",
                "--no-triton", "--repository", str(model_repo), "--json", str(out)])
    cells = json.loads(out.read_text())["cells"]
    assert set(cells) == {"meshserve 90% off", "meshserve 90% on", "meshserve 0% off", "meshserve 0% on"}
    for name, (row,) in cells.items():
        assert row["errors"] == 0 and row["requests"] == 120 and row["rows_s"] > 0, (name, row)
    hits = cells["meshserve 90% on"][0]
    assert hits["repeats"] > 50 and hits["server_hits"] >= hits["repeats"]  # every repeat after its answer: a hit
    assert cells["meshserve 0% on"][0]["server_hits"] == 0 and cells["meshserve 0% on"][0]["server_misses"] == 120
    # what reached the service: every request of a cell without the cache, only the misses with it
    assert cells["meshserve 0% off"][0]["service_rows"] == 120
    assert hits["service_rows"] == hits["server_misses"] and hits["service_executions"] > 0
    assert 0 <= hits["hop_merged_requests"] <= hits["service_rows"]
    table = capsys.readouterr().out
    assert "| meshserve 90% on |" in table and "rows/s" in table and "requests per hop send" in table
