"""load/bench/tls_ratios.py: the TLS on/off table from drive.py's JSON lines (no servers)."""
from __future__ import annotations

import json
from pathlib import Path

from load.bench import tls_ratios


def write(res: Path, label: str, c: int, *records: dict) -> None:
    with (res / f"{label}.jsonl").open("a") as f:
        for r in records:
            f.write(json.dumps({"ok": True, "model": "add_sub", "mode": "grpc", "concurrency": c, **r}) + "\n")


def test_cost_per_cell_and_the_c32_goal(tmp_path: Path) -> None:
    write(tmp_path, "tls-off", 32, {"infer_per_s": 1000, "cpu_server_cores": 1.0, "p99_us": 4000,
                                    "cpu_foreign_cores": 0.05})
    # the noisier of two TLS runs does not count
    write(tmp_path, "tls-on", 32, {"infer_per_s": 500, "cpu_server_cores": 1.0, "p99_us": 9000, "cpu_foreign_cores": 0.9},
          {"infer_per_s": 900, "cpu_server_cores": 1.0, "p99_us": 4500, "cpu_foreign_cores": 0.02})
    write(tmp_path, "tls-off", 8, {"infer_per_s": 1000, "cpu_server_cores": 1.0, "p99_us": 2000})
    write(tmp_path, "tls-on", 8, {"infer_per_s": 700, "cpu_server_cores": 1.0, "p99_us": 2500})
    rows = {line.split(" | ")[2]: line for line in tls_ratios.table(tmp_path).splitlines()
            if line.startswith("| add_sub | grpc |")}
    # 1000 -> 900 infer/s: -10% throughput; CPU per inference 1000 -> 1111 µs: +11.1%; under 15%: met
    assert rows["32"] == "| add_sub | grpc | 32 | 1000 | 900 | +10.0% | 1000 | 1111 | +11.1% | 4.00/4.50 | 0.05 | met |"
    assert rows["8"].endswith("| +30.0% | 1000 | 1429 | +42.9% | 2.00/2.50 | – |  |")  # (no goal below c32)
    write(tmp_path, "tls-on", 32, {"infer_per_s": 800, "cpu_server_cores": 1.0, "p99_us": 4000, "cpu_foreign_cores": 0.01})
    assert "| MISSED |" in tls_ratios.table(tmp_path)  # the quietest run now costs 20%
