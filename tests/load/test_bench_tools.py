"""Smoke tests of the measuring commands under load/bench/ (docs/perf/README.md): each runs
with a tiny N, checks that its numbers are there and plausible, and never a duration. The
callgrind runs are skipped where valgrind is not installed."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from load.bench import callgrind, http_path, per_request
from tests.load.test_side_by_side_table import write

ROOT = Path(__file__).resolve().parents[2]
needs_valgrind = pytest.mark.skipif(not callgrind.available(), reason="valgrind is not installed")

ANNOTATE = """\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
146,605,387 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                      file:function
--------------------------------------------------------------------------------
1,176,666,593 (802.6%)  /build/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/lib/libpython3.11.so]
   27,433,009 (18.71%)  /build/Modules/gcmodule.c:gc_collect_main [/lib/libpython3.11.so]
   27,000,000 (18.42%)  /build/Modules/gcmodule.c:gc_collect_main'2 [/lib/libpython3.11.so]
"""

STRACE = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 40.00    0.004000           1      3000           read
 35.00    0.003500           1      2000        12 writev
 25.00    0.002500           2      1000           epoll_wait
------ ----------- ----------- --------- --------- ----------------
100.00    0.010000                  6000        12 total
"""


def test_callgrind_totals_are_read_from_annotate_output() -> None:
    assert callgrind.parse_totals(ANNOTATE) == (146_605_387, 27_433_009)
    assert callgrind.parse_totals("no dump") == (0, 0)


def test_strace_counts_become_calls_per_request() -> None:
    assert per_request.per_request_strace(STRACE, 1000) == {"read": 3.0, "writev": 2.0, "epoll_wait": 1.0,
                                                            "total": 6.0}


def test_per_request_cpu_runs_a_gateway_and_a_service_and_counts_every_request(model_repo: Path,
                                                                                tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    run = subprocess.run([sys.executable, "-m", "load.bench.per_request", "cpu", "--repository", str(model_repo),
                          "-n", "40", "--warmup", "10", "-c", "2", "--protocol", "http-binary", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "µs of CPU per request" in run.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["target"] == "gateway" and result["cpu_us"] >= 0
    load = json.loads((out / "load.json").read_text())
    assert load["succeeded"] == 40 and load["failed"] == 0


@needs_valgrind
def test_per_request_callgrind_counts_a_gateway_requests_instructions(model_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "cg"
    per_request.main(["callgrind", "--repository", str(model_repo), "-n", "20", "--warmup", "10", "-c", "1",
                      "--out", str(out)])
    result = json.loads((out / "result.json").read_text())
    # a gRPC request through the gateway is some 300k instructions (docs/perf/h2-write-path.md);
    # an empty or foreign dump would be orders of magnitude off
    assert 50_000 < result["instructions"] < 20_000_000, result
    assert 0 <= result["gc"] <= result["instructions"]


@pytest.mark.parametrize("body", ["binary", "json", "json-pa"])
def test_the_front_door_path_answers_each_request(body: str) -> None:
    transport = http_path.CountingTransport()

    async def run() -> None:
        one = http_path.front_door("add_sub", body, transport)
        for _ in range(3):
            await one()

    asyncio.run(run())
    assert transport.writes >= 3
    last = transport.last if isinstance(transport.last, bytes) else b"".join(transport.last)
    assert last.startswith(b"HTTP/1.1 200"), last[:200]


@pytest.mark.parametrize("what", ["front-door", "codec"])
def test_http_path_prints_a_time_per_request(what: str, capsys: pytest.CaptureFixture[str]) -> None:
    http_path.main(["--what", what, "-m", "mlp", "--body", "json-pa", "-n", "20", "--rounds", "2"])
    assert re.fullmatch(rf"{what} mlp json-pa: [\d.]+ µs per request \(best of 2 x 20\)\n", capsys.readouterr().out)


@needs_valgrind
def test_http_path_counts_the_codec_s_instructions(capsys: pytest.CaptureFixture[str]) -> None:
    http_path.main(["--what", "codec", "--body", "binary", "-n", "1000", "--rounds", "1", "--instructions"])
    m = re.fullmatch(r"codec add_sub binary: (-?\d+) instructions per request \(1 x 1000, callgrind\)\n",
                     capsys.readouterr().out)
    assert m and 1_000 < int(m.group(1)) < 1_000_000, m  # (the template path: ~52k here, the same in every run)


def test_pyspy_summary_prints_self_and_inclusive_shares(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text("run (a/x.py:1);parse (a/codec.py:9) 75\nrun (a/x.py:1);serve (a/y.py:2) 25\n")
    run = subprocess.run([sys.executable, "-m", "load.bench.pyspy_summary", str(raw), "--top", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"== {raw}: 100 samples\n-- self (top 1)\n 75.0% parse codec.py\n-- inclusive" in run.stdout
    assert subprocess.run([sys.executable, "-m", "load.bench.pyspy_summary", str(tmp_path / "none.txt")],
                          cwd=ROOT, capture_output=True, timeout=60).returncode != 0


def test_side_by_side_sh_writes_the_table_from_the_sweeps_it_finds(tmp_path: Path) -> None:
    """The script's own wiring, every sweep skipped (no Triton, perf_analyzer or servers): the
    harness's models step and report, then the 18-cell table from the results directory."""
    bench, venv, res = tmp_path / "bench", tmp_path / "venv", tmp_path / "res"
    for d in (bench, venv / "bin", res):
        d.mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (bench / "gen_models.py").write_text("import sys; print('models', sys.argv[1])\n")
    (bench / "report.py").write_text("import sys; print('report of', len(sys.argv) - 1, 'files')\n")
    write(res, "triton", {"infer_per_s": 1000, "p99_us": 3000, "avg_batch": 8})
    write(res, "meshserve-gateway", {"infer_per_s": 1100, "p99_us": 2500, "avg_batch": 8})
    write(res, "meshserve-direct", {"infer_per_s": 1200, "p99_us": 2000, "avg_batch": 8})
    env = {**os.environ, "SKIP": "anchors gateway direct", "BENCH_DIR": str(bench), "PA_VENV": str(venv),
           "MODELS_DIR": str(tmp_path / "models"), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["bash", str(ROOT / "load/bench/side_by_side.sh"), str(res)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (res / "tables.md").read_text() == "report of 3 files\n"
    table = (res / "side_by_side.md").read_text()
    assert next(r for r in table.splitlines() if r.startswith("| add_sub | grpc | 8 |")).startswith(
        "| add_sub | grpc | 8 | 1000 | 1100 | 1200 | 1.10 |")
