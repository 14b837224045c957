"""Figures from a run: every number in the JSON carries its definition under `definitions`."""
from __future__ import annotations

import os
import platform
import socket
import sys
from collections import Counter
from typing import Any

import numpy as np

from load.runner import Driver, RunState
from load.transport import OK

PERCENTILES = (50, 90, 95, 99, 99.9)

DEFINITIONS: dict[str, str] = {
    "measured_s": "length of the measurement window: from the end of warm-up to the last answer of a "
                  "measured request (open loop with a duration: at least that duration)",
    "sent": "requests whose send time (scheduled time in open loop) fell in the measurement window",
    "succeeded": "measured requests answered with HTTP 200 / gRPC OK",
    "failed": "measured requests answered with an error, timed out, or not sent (client max_inflight)",
    "throughput_rps": "sent / measured_s: request rate the client achieved (open loop: vs target rate)",
    "goodput_rps": "succeeded / measured_s",
    "rows_per_s": "batch rows of succeeded requests / measured_s (what the server counts as inferences)",
    "latency_ms": "successful requests only; closed loop: answer time - send time; open loop: answer "
                  "time - *scheduled* send time (includes any wait in the client, no coordinated omission)",
    "errors": "count of failed measured requests by status: 'http N', 'grpc CODE', 'grpc-stream CODE', "
              "'timeout', 'client <exception>', 'client max_inflight'",
    "send_lag_ms": "open loop: actual send - scheduled send; large values mean the client fell behind",
    "achieved_rate": "open loop: measured requests actually sent / time from the end of warm-up to the "
                     "last actual send (at least the scheduled window)",
    "timeline": "per 1 s bucket of send time (s since start, warm-up included, `warm` marks it): "
                "requests sent, goodput, p50/p99 latency of successes in the bucket, errors",
    "client_cpu": "os.times() of the load generator process over the whole run (warm-up included): "
                  "cores = (user+sys)/wall; us_per_request = (user+sys)/all requests sent",
    "server_stats": "deltas of the server's statistics extension (/v2/models/<m>/stats) over the whole "
                    "run, warm-up included: inference_count (rows), execution_count (model executions), "
                    "rows_per_execution, batch_sizes = executions per batch size",
    "all_requests": "every request of the run, warm-up included (compare with server_stats)",
    "cdf_ms": "latency CDF of successes: [latency_ms, fraction <= latency] pairs",
}


def _pct(a: np.ndarray) -> dict[str, float | None]:
    if a.size == 0:
        empty: dict[str, float | None] = {f"p{p:g}": None for p in PERCENTILES}
        return empty | {"mean": None, "min": None, "max": None}
    q = np.percentile(a, PERCENTILES) * 1e3
    out: dict[str, float | None] = {f"p{p:g}": round(float(v), 3) for p, v in zip(PERCENTILES, q, strict=True)}
    out.update(mean=round(float(a.mean() * 1e3), 3), min=round(float(a.min() * 1e3), 3),
               max=round(float(a.max() * 1e3), 3))
    return out


def _stat_count(s: dict[str, Any] | None, key: str) -> tuple[int, int, dict[int, int]]:
    """Sum over versions of inference_count, execution_count and executions per batch size."""
    inf = ex = 0
    batches: Counter[int] = Counter()
    for m in (s or {}).get("model_stats", []):
        inf += int(m.get("inference_count", 0))
        ex += int(m.get("execution_count", 0))
        for b in m.get("batch_stats", []) or []:
            batches[int(b["batch_size"])] += int(b.get("compute_infer", {}).get("count", 0))
    return inf, ex, dict(batches)


def server_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for m, b in before.items():
        i0, e0, b0 = _stat_count(b, m)
        i1, e1, b1 = _stat_count(after.get(m), m)
        sizes = {k: b1.get(k, 0) - b0.get(k, 0) for k in sorted(b1)}
        ex = e1 - e0
        out[m] = {"inference_count": i1 - i0, "execution_count": ex,
                  "rows_per_execution": round((i1 - i0) / ex, 3) if ex else None,
                  "batch_sizes": {str(k): v for k, v in sizes.items() if v}}
    return out


def summarize(drv: Driver, st: RunState) -> dict[str, Any]:
    sc = drv.sc
    r = st.record
    sched = np.asarray(r.sched)
    lat = np.asarray(r.latency)
    lag = np.asarray(r.lag)
    ok = np.asarray([s == OK for s in r.status], dtype=bool)
    warm = np.asarray(r.warm, dtype=bool)
    rows = np.asarray(r.rows)
    meas = ~warm
    done_at = sched + lat
    end = float(done_at[meas].max()) if meas.any() else st.warmup_end
    measured_s = max(end - st.warmup_end, 1e-9)
    if sc.mode == "open" and sc.duration_s is not None:
        # the schedule's window, stretched when answers come later than it (a client or server behind)
        measured_s = max(sc.duration_s, measured_s)
    m_ok = meas & ok
    errors = Counter(s for s, m, o in zip(r.status, meas, ok, strict=True) if m and not o)
    per_target = {}
    for i, t in enumerate(sc.targets):
        sel = meas & (np.asarray(r.target) == i)
        label = t.label if t.label not in per_target else f"{t.label}#{i}"
        per_target[label] = {"sent": int(sel.sum()), "succeeded": int((sel & ok).sum()),
                               "latency_ms": _pct(lat[sel & ok]),
                               "errors": dict(Counter(s for s, k, o in zip(r.status, sel, ok, strict=True)
                                                      if k and not o))}
    timeline = []
    if sched.size:
        for b in range(int(sched.max()) + 1):
            sel = (sched >= b) & (sched < b + 1)
            s_ok = sel & ok
            ls = lat[s_ok]
            timeline.append({"t": b, "warm": bool(b < st.warmup_end), "sent": int(sel.sum()),
                             "goodput_rps": int(s_ok.sum()),
                             "p50_ms": round(float(np.percentile(ls, 50) * 1e3), 3) if ls.size else None,
                             "p99_ms": round(float(np.percentile(ls, 99) * 1e3), 3) if ls.size else None,
                             "errors": int((sel & ~ok).sum())})
    ok_lat = np.sort(lat[m_ok])
    cdf: list[list[float]] = []
    if ok_lat.size:
        qs = np.linspace(0, 1, 201)
        cdf = [[round(float(v) * 1e3, 4), round(float(q), 3)] for v, q in zip(np.quantile(ok_lat, qs), qs, strict=True)]
    cpu_s = drv.cpu.get("user_s", 0.0) + drv.cpu.get("sys_s", 0.0)
    res: dict[str, Any] = {
        "definitions": DEFINITIONS,
        "scenario": sc.model_dump(mode="json"),
        "environment": {"host": socket.gethostname(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "platform": platform.platform(), "loadavg": os.getloadavg()},
        "setup_errors": drv.setup_errors,
        "measured_s": round(measured_s, 3),
        "sent": int(meas.sum()),
        "succeeded": int(m_ok.sum()),
        "failed": int((meas & ~ok).sum()),
        "throughput_rps": round(meas.sum() / measured_s, 2),
        "goodput_rps": round(m_ok.sum() / measured_s, 2),
        "rows_per_s": round(float(rows[m_ok].sum()) / measured_s, 2),
        "latency_ms": _pct(lat[m_ok]),
        "errors": dict(errors),
        "per_target": per_target,
        "timeline": timeline,
        "cdf_ms": cdf,
        "client_cpu": {**{k: round(v, 3) for k, v in drv.cpu.items()},
                       "wall_s": round(drv.wall_s, 3), "cores": round(cpu_s / drv.wall_s, 3) if drv.wall_s else None,
                       "us_per_request": round(cpu_s / len(r.status) * 1e6, 1) if r.status else None},
        "all_requests": {"sent": len(r.status), "succeeded": int(ok.sum()),
                         "succeeded_rows": int(rows[ok].sum()), "warmup_sent": int(warm.sum())},
        "server_stats": server_deltas(drv.stats_before, drv.stats_after),
    }
    if sc.mode == "open":
        actual = sched + lag
        sent_for_real = meas & (np.asarray(r.status) != "client max_inflight")
        span = sc.duration_s if sc.duration_s is not None else (sc.requests or 0) / (sc.rate or 1)
        if sent_for_real.any():
            span = max(span, float(actual[sent_for_real].max()) - st.warmup_end)
        res["open_loop"] = {"target_rate": sc.rate,
                            "achieved_rate": round(int(sent_for_real.sum()) / span, 2) if span else None,
                            "send_lag_ms": _pct(lag[meas])}
    return res
