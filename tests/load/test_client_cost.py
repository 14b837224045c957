"""load/bench/client_cost.py's pure parts: perf stat's CSV, the medians and the report table."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from load.bench import client_cost


def test_read_perf_takes_counts_and_skips_headers(tmp_path: Path) -> None:
    f = tmp_path / "client.perf"
    f.write_text("# started on Sun Nov 29 15:23:36 2026\n\n"
                 "72971,,context-switches,1605907129,100.00,48.557,K/sec\n"
                 "17152,,syscalls:sys_enter_recvmsg,1605907129,100.00,11.413,K/sec\n"
                 "<not counted>,,syscalls:sys_enter_ppoll,0,0.00,,\n")
    assert client_cost.read_perf(f) == {"context-switches": 72971, "recvmsg": 17152}
    assert client_cost.read_perf(tmp_path / "absent.perf") == {}


def test_median_with_spread() -> None:
    assert client_cost._med([]) == "–"
    assert client_cost._med([None, 4.04]) == "4.04"
    assert client_cost._med([9524.4, 8203.0, 10197.0]) == "9524 (8203–10197)"
    assert client_cost._med([2.8, 3.02, 2.78]) == "2.8 (2.78–3.02)"


def _rec(label: str, rep: int, client_us: float, apw: float, recv: float) -> dict[str, Any]:
    rec: dict[str, Any] = {"label": label, "model": "add_sub", "mode": "grpc", "concurrency": 8, "repeat": rep,
           "infer_per_s": 5000 + rep, "p50_us": 900, "cpu_us_per_req": {"client": client_us, "service": 40.0},
           "client_user_sys_us": [client_us / 2, client_us / 2],
           "per_req": {"client": {"recv": recv, "send": 0.9, "wait": 0.3, "futex": 2.0, "context_switches": 1.5}},
           "writes": {"answers_per_write": apw}}
    if label == "gateway":
        rec["cpu_us_per_req"]["gateway"] = 55.0
    return rec


def test_report_rows_per_server_in_order() -> None:
    records = [_rec(label, rep, us, apw, recv) for rep in range(3)
               for label, us, apw, recv in (("direct", 36.0 + rep, 4.1, 0.49), ("gateway", 47.0 + rep, 2.8, 0.56))]
    records.append({"label": "gateway", "model": "add_sub", "mode": "grpc", "concurrency": 8})  # a failed run
    text = client_cost.report(records, {"when": "now", "command": "x", "commit": "abc", "tree_b": "",
                                        "load_start": 1.0, "load_end": 2.0})
    rows = [line for line in text.splitlines() if line.startswith("| add_sub")]
    assert len(rows) == 2 and "| direct |" in rows[0] and "| gateway |" in rows[1]
    cells = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert cells[6].startswith("48 (47–49)")  # client µs per request: median (min–max) of the 3 repeats
    assert cells[7] == "0.56 (0.56–0.56) / 0.9 (0.9–0.9) / 0.3 (0.3–0.3) / 2 (2–2)"  # recv / send / wait / futex
    assert cells[9] == "2.8 (2.8–2.8)" and cells[10] == "55 (55–55)"  # answers per write; gateway µs
    assert rows[0].split("|")[11].strip() == "–"  # direct: no gateway
