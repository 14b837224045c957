"""Triton's own load generator, unmodified, against the gateway (HTTP and gRPC)."""
from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[3] / "shared" / "tools" / "perf_analyzer"

pytestmark = pytest.mark.skipif(not TOOL.exists() and not os.environ.get("CI"),
                                reason=f"perf_analyzer wrapper not found at {TOOL}")


@pytest.mark.parametrize("protocol", ["grpc", "http", "http-json"])
def test_perf_analyzer_against_gateway(protocol: str, stack, tmp_path: Path) -> None:
    """http-json: all-JSON requests and answers (the JSON request template and kept answers of
    meshserve/protocol/http_codec.py; perf_analyzer reads every answer's JSON)."""
    url = stack.gateway.grpc if protocol == "grpc" else stack.gateway.http
    report = tmp_path / "pa.csv"
    cmd = [str(TOOL), "-m", "small_mlp", "-u", url, "-i", protocol.split("-")[0], "--concurrency-range", "1:16:5",
           "--measurement-interval", "200", "--stability-percentage", "999", "--max-trials", "8",
           "-f", str(report)]
    if protocol == "http-json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(report.open()))
    # one row per concurrency level; perf_analyzer sorts the rows by throughput, not concurrency
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 6, 11, 16]
    for r in rows:
        assert float(r["Inferences/Second"]) > 10
        # sane latencies: p99 under a second on a 64->256->64 MLP
        assert 0 < int(r["p99 latency"]) < 1_000_000


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_system_shared_memory(protocol: str, stack, tmp_path: Path) -> None:
    """`--shared-memory system`: perf_analyzer unregisters every region, registers its own for the
    inputs and outputs, and sends only region names; the gateway reads and writes them."""
    url = stack.gateway.grpc if protocol == "grpc" else stack.gateway.http
    report = tmp_path / "pa.csv"

    def registered() -> int:  # perf_analyzer's regions for add_sub's INPUT0 ('INPUT0_0_0') in the gateway's log
        return sum("registered system shared memory region 'INPUT0_" in line for line in stack.gateway.output)

    before = registered()
    cmd = [str(TOOL), "-m", "add_sub", "-u", url, "-i", protocol, "--shared-memory", "system",
           "--output-shared-memory-size", "1024", "--concurrency-range", "2", "--measurement-interval", "300",
           "--stability-percentage", "999", "--max-trials", "8", "-f", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = list(csv.DictReader(report.open()))
    assert float(row["Inferences/Second"]) > 10
    assert registered() > before  # it did use regions
