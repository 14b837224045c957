"""load/bench/tls_front.py: the table of CPU, calls and TLS records per request (no servers)."""
from __future__ import annotations

import math

from load.bench import tls_front


def run(gw: float, client: float, svc: float, rate: float, reads: float, writes: float, gw_in: float,
        gw_out: float) -> dict[str, float]:
    return {"gw": gw, "client": client, "svc": svc, "rate": rate, "hop_calls": 0.5, "gw_reads": reads,
            "gw_writes": writes, "gw_in": gw_in, "gw_out": gw_out}


def test_medians_costs_and_records_per_request() -> None:
    runs = {
        # three rounds: the median of each column, not of a round
        ("add_sub", "http", "off"): [run(60, 40, 30, 900, 1, 1, 650, 517), run(50, 50, 40, 1000, 1, 1, 650, 517),
                                     run(70, 45, 20, 1100, 1, 1, 650, 517)],
        # 2 records in (650 -> 694 bytes), one out (517 -> 539)
        ("add_sub", "http", "tls"): [run(66, 55, 30, 800, 1, 1, 694, 539)] * 3,
    }
    rows = tls_front._table(runs, ["off", "tls"], ["add_sub"], ["http"]).splitlines()
    # (half a call to the service per request: two requests per call)
    assert rows[2] == "| add_sub | http | off | 60.0 | 45.0 | 30.0 | 135.0 | 1000 | 2.00 | 1.00 / 1.00 | – |"
    assert rows[3] == ("| add_sub | http | tls | 66.0 (+10.0%) | 55.0 (+22.2%) | 30.0 (+0.0%) | 151.0 (+11.9%) | 800 "
                       "| 2.00 | 1.00 / 1.00 | 2.00 / 1.00 |")


def test_labels_driven_together_leave_the_shared_service_out() -> None:
    nan = math.nan
    runs = {("mlp", "grpc", "off"): [run(50, 40, nan, 1000, 0.3, 0.4, 100, 100)],
            ("mlp", "grpc", "tls"): [run(55, 40, nan, 1000, 0.3, 0.4, 111, 111)]}
    rows = tls_front._table(runs, ["off", "tls"], ["mlp"], ["grpc"]).splitlines()
    assert rows[3] == ("| mlp | grpc | tls | 55.0 (+10.0%) | 40.0 (+0.0%) | nan | 95.0 (+5.6%) | 1000 | 2.00 | 0.30 / 0.40 "
                       "| 0.50 / 0.50 |")


def test_callgrind_counts_get_their_own_column() -> None:
    runs = {("add_sub", "http", g): [{**run(1, 1, 1, 100, 1, 1, 0, 0), "instr": n}] for g, n in
            (("off", 400_000.0), ("tls", 430_000.0))}
    rows = tls_front._table(runs, ["off", "tls"], ["add_sub"], ["http"]).splitlines()
    assert rows[0].endswith("| TLS records in / out | gateway instructions |")
    assert rows[2].endswith("| – | 400,000 |")
    assert rows[3].endswith("| 0.00 / 0.00 | 430,000 (+7.5%) |")
