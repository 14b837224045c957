"""load/bench/sbs.py: the alternating side by side (issue 36). The report from records (no servers),
and a smoke run through real processes: one cell, gateway and direct, Triton absent (its columns
are dashes, the run still reports)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from load.bench import sbs

ROOT = Path(__file__).resolve().parents[2]


def rec(label: str, rep: int, tput: float, **more: object) -> dict:
    return {"ok": True, "label": label, "repeat": rep, "model": "add_sub", "mode": "grpc", "concurrency": 8,
            "infer_per_s": tput, "p99_us": 4000, "avg_batch": 7.0, "cpu_foreign_cores": 0.1, "load_avg": 1.0,
            **more}


META = {"when": "now", "command": "x", "commit": "c", "repeats": 3, "interval": 2000, "ort_threads": "2",
        "gateway_workers": 1, "triton": "t", "load_start": 1.0}


def row(text: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith("| add_sub | grpc | 8 | ") and "gateway" not in x
                and "triton" not in x and "direct" not in x)
    return [c.strip() for c in line.strip("|").split("|")]


def test_ratios_are_taken_per_repeat_and_a_spread_across_one_is_marked() -> None:
    records = []
    # Triton steady, the gateway drifting: repeat 1 is behind, so the spread crosses 1.0
    for rep, (t, g, d) in enumerate([(1000, 1100, 1200), (1000, 900, 1000), (1100, 1320, 1400)]):
        records += [rec("triton", rep, t), rec("gateway", rep, g, cpu_us_per_req={"gateway": 50, "service": 60, "client": 40}),
                    rec("direct", rep, d, cpu_us_per_req={"service": 55, "client": 40})]
    cells = row(sbs.report(records, META))
    assert cells[3:6] == ["1000", "1100", "1200"]  # medians of each server's throughput
    assert cells[6] == "1.10 (0.90–1.20) ±"  # gw/Triton from the same repeat: 1.1, 0.9, 1.2
    assert cells[7] == "0.92 (0.90–0.94)"  # gw/direct: 0.917, 0.9, 0.943; never crosses 1.0: no mark
    assert cells[10] == "110 (gw 50) / –"  # CPU µs per request: gateway + service through the gateway
    assert cells[11] == "55"
    assert cells[12] == "0.63"  # by CPU per request: (55 + 40) / (50 + 60 + 40)
    text = sbs.report(records, META)
    assert "spread crosses 1.0 in 1" in text
    assert sum(" | gateway | " in x for x in text.splitlines()) == 3  # every repeat is listed


def test_a_cell_ahead_in_every_repeat_is_not_marked_and_failures_do_not_count() -> None:
    records = [rec("triton", 0, 1000), rec("gateway", 0, 1200), rec("triton", 1, 1000), rec("gateway", 1, 1100),
               {**rec("gateway", 2, 0), "ok": False}, rec("triton", 2, 1000)]
    text = sbs.report(records, META)
    assert row(text)[6] == "1.15 (1.10–1.20)"
    assert "gw/Triton min ≥ 1.0 in 1; spread crosses 1.0 in 0" in text
    assert "| 2 | gateway | FAILED |" in text


@pytest.mark.skipif(sbs.pa_venv() is None, reason="perf_analyzer is not installed (../shared/tools/perf_analyzer)")
def test_smoke_one_cell_without_triton(tmp_path: Path) -> None:
    res = tmp_path / "res"
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "load.bench", "--side-by-side", str(res), "--models", "add_sub",
                          "--modes", "grpc", "--concurrency", "8", "--repeats", "1", "--interval", "200",
                          "--max-trials", "4", "--stability", "999", "--warmup", "0", "--triton-venv", str(tmp_path / "no-triton"),
                          "--raw-ort", "add_sub@8", "--raw-ort-runs", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert time.monotonic() - t0 < 90  # (goal < 30 s on a quiet machine; 34-43 s at load average 20-26 on 2 cores)
    assert f"report {res / 'side_by_side.md'}" in run.stdout
    assert "Triton: unavailable" in run.stdout
    runs = [json.loads(x) for x in (res / "runs.jsonl").read_text().splitlines()]
    assert [r["label"] for r in runs] == ["gateway", "direct"]
    for r in runs:
        assert r["ok"], r.get("error")
        assert r["infer_per_s"] > 0 and r["server_inferences"] > 0
        assert r["avg_batch"] >= 1.0
    assert set(runs[0]["cpu_us_per_req"]) == {"gateway", "service", "client"}  # client: perf_analyzer
    assert not (res / "warmup.jsonl").exists()  # --warmup 0 (default: a run per server, model and protocol first)
    assert all(v > 0 for v in runs[0]["cpu_us_per_req"].values())
    cells = row((res / "side_by_side.md").read_text())
    assert cells[3] == "–" and cells[6] == "–"  # no Triton: no Triton column, no ratio to it
    assert cells[7] != "–"  # gw/direct measured
    # each run followed by the same graph alone in onnxruntime at its rows per execution: the ratio
    for r in runs:
        raw = r["raw_ort"]
        assert raw["runs"] == 20 and raw["rows"] >= 20 and abs(raw["batch"] - r["avg_batch"]) < 0.06
        assert raw["cpu_us_per_row"] > 0
        ours = sum(v for n, v in r["cpu_us_per_req"].items() if n != "client")
        assert r["cpu_per_row_vs_raw"] == pytest.approx(ours / raw["cpu_us_per_row"], rel=1e-2)
        assert r["cpu_per_row_vs_raw"] > 0
        split = r["service_threads_us_per_row"]  # the service's event loop and its other threads
        assert split["event loop"] > 0
        assert split["event loop"] + split["other"] == pytest.approx(r["cpu_us_per_req"]["service"], abs=0.2)
    table = (res / "side_by_side.md").read_text().split("## CPU per served row against raw onnxruntime")[1]
    line = next(x for x in table.splitlines() if x.startswith("| add_sub | grpc | 8 | "))
    assert f"{runs[0]['cpu_per_row_vs_raw']:.2f}" in line and f"{runs[1]['cpu_per_row_vs_raw']:.2f}" in line


def test_another_gateway_worker_count_is_reported_against_the_first_gateway() -> None:
    records = []
    for rep, (g, w2) in enumerate([(1000, 900), (1000, 1100)]):
        records += [rec("gateway", rep, g), rec("gateway-w2", rep, w2, avg_batch=5.0), rec("direct", rep, 1200)]
    text = sbs.report(records, META)
    assert "| model | proto | c | gateway-w2 /s | gateway-w2/gateway | rows/exec |" in text
    assert "| add_sub | grpc | 8 | 1000 | 1.00 (0.90–1.10) ± | 5.0 |" in text  # (± : either way)


def test_drift_says_which_server_moved_and_an_old_run_reports_again(tmp_path: Path) -> None:
    records = []
    for rep, (t, g) in enumerate([(1000, 1000), (1000, 800)]):  # Triton still, the gateway 20% down
        records += [rec("triton", rep, t, cpu_us_per_req={"triton": 100}),
                    rec("gateway", rep, g, avg_batch=7.0 - rep, cpu_us_per_req={"gateway": 50 + 10 * rep})]
    text = sbs.report(records, META)
    assert "| triton | 0% (max 0%) | 0% (max 0%) | triton 0% (max 0%) |" in text
    assert "| gateway | 22% (max 22%) | 15% (max 15%) | gateway 18% (max 18%) |" in text  # 200/900, 1/6.5, 10/55
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "meta.json").write_text(json.dumps(META))
    assert sbs.rewrite(tmp_path) == text


def test_cpu_per_row_against_raw_onnxruntime_is_reported_per_repeat() -> None:
    records = []
    for rep, (raw_g, raw_d) in enumerate([(100.0, 95.0), (120.0, 110.0), (90.0, 100.0)]):
        records += [rec("gateway", rep, 1000, avg_batch=16.0, cpu_us_per_req={"gateway": 60, "service": 180, "client": 50},
                        raw_ort={"batch": 16.0, "cpu_us_per_row": raw_g}, cpu_per_row_vs_raw=round(240 / raw_g, 3)),
                    rec("direct", rep, 1200, avg_batch=18.0, cpu_us_per_req={"service": 190, "client": 50},
                        raw_ort={"batch": 18.0, "cpu_us_per_row": raw_d}, cpu_per_row_vs_raw=round(190 / raw_d, 3))]
    text = sbs.report(records, META)
    line = next(x for x in text.split("against raw onnxruntime")[1].splitlines() if x.startswith("| add_sub |"))
    # gw path: 240/100, 240/120, 240/90 -> 2.40, 2.00, 2.67; direct: 190/95, 190/110, 190/100
    assert line == ("| add_sub | grpc | 8 | 16.0 / 18.0 | 100 (90–120) | 240 (240–240) | 2.40 (2.00–2.67) | "
                    "190 (190–190) | 1.90 (1.73–2.00) | – / – | – |")  # (no thread split recorded)
    for r in records:  # the service's threads other than its event loop, in the same runs
        r["service_threads_us_per_row"] = {"event loop": 40.0, "other": 150.0 if r["label"] == "gateway" else 140.0}
        if r["label"] == "gateway":
            r["cpu_per_row_vs_inproc"] = round(240 / 150, 3)
    line = next(x for x in sbs.report(records, META).split("against raw onnxruntime")[1].splitlines()
                if x.startswith("| add_sub |"))
    assert line.endswith("| 150 / 140 | 1.60 (1.60–1.60) |")
    assert "against raw onnxruntime" not in sbs.report([rec("gateway", 0, 1000)], META)  # none measured: no table


def test_raw_cells_parse() -> None:
    assert sbs.parse_raw_cells("mlp@32, add_sub@8") == {("mlp", 32), ("add_sub", 8)}
    assert sbs.parse_raw_cells("") == set()
    with pytest.raises(Exception, match="MODEL@CONCURRENCY"):
        sbs.parse_raw_cells("mlp")


def test_row_cpu_tells_the_service_threads_apart_by_role() -> None:
    """load/bench/row_cpu.py: the event loop is the process's own thread, onnxruntime's pools the
    threads there before any request, the worker a thread started since (the executor's)."""
    from load.bench import row_cpu

    before = {100: ("python3", 1.0), 101: ("python3", 2.0), 102: ("python3", 0.5), 200: ("python3", 0.1)}
    after = {100: ("python3", 1.5), 101: ("python3", 2.25), 102: ("python3", 0.5), 200: ("python3", 1.1),
             300: ("python3", 0.05)}  # 300: started during the interval
    got = row_cpu.roles(100, {100, 101, 102}, before, after)
    assert got == pytest.approx({"event loop": 0.5, "onnxruntime pool": 0.25, "worker": 1.05})
