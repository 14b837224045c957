"""`meshserve tune MODEL --p99-ms N`: sweep queue delay x concurrency, fit compute time per batch,
recommend `max_queue_delay_microseconds` and `preferred_batch_size` for a p99 target.

Each queue delay is applied by reloading the model with a config override through the repository
extension (`POST /v2/repository/models/<m>/load` with `{"parameters": {"config": "<json>"}}`); the
original config is loaded back at the end. Compute time per batch size comes from the statistics
extension (`batch_stats[].compute_infer`, ns per execution of that batch size).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from load.scenario import Scenario, Target


@dataclass
class Cell:
    delay_us: int
    concurrency: int
    goodput: float
    p50_ms: float | None
    p99_ms: float | None
    errors: int
    rows_per_exec: float | None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model")
    ap.add_argument("--p99-ms", type=float, required=True, help="latency target (p99, ms, client-side)")
    ap.add_argument("--url", default="127.0.0.1:8000", help="HTTP host:port of the gateway or service")
    ap.add_argument("--grpc", default=None, help="gRPC host:port (with --protocol grpc)")
    ap.add_argument("--protocol", default="http-binary", choices=("http-binary", "http-json", "grpc"))
    ap.add_argument("--delays", default="0,500,1000,2000,4000", help="queue delays to try, µs")
    ap.add_argument("--concurrency", default="1,4,16,32", help="concurrency levels to try")
    ap.add_argument("--step-s", type=float, default=3.0, help="seconds measured per cell")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--input-file", default=None)
    ap.add_argument("--json", default=None, help="write the sweep, the fit and the advice here")


async def _post_load(session: aiohttp.ClientSession, url: str, model: str, config: dict[str, Any] | None) -> None:
    body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
    async with session.post(f"http://{url}/v2/repository/models/{model}/load", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"tune: reloading '{model}' with a config override failed: HTTP {r.status} "
                             f"{(await r.text())[:300]} (the service needs `--model-control-mode explicit "
                             f"--load-model '*'` where it has model control modes)")


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as r:
        if r.status != 200:
            raise SystemExit(f"tune: GET {url}: HTTP {r.status} {(await r.text())[:300]}")
        return await r.json(content_type=None)


def _batch_totals(stats: dict[str, Any]) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for m in stats.get("model_stats", []):
        for b in m.get("batch_stats", []) or []:
            ci = b.get("compute_infer", {})
            c, ns = out.get(int(b["batch_size"]), (0, 0))
            out[int(b["batch_size"])] = (c + int(ci.get("count", 0)), ns + int(ci.get("ns", 0)))
    return out


def fit_linear(samples: dict[int, tuple[int, int]]) -> tuple[float, float] | None:
    """Weighted least squares of compute ms per execution ≈ a·batch + b over batch sizes seen."""
    pts = [(bs, ns / c / 1e6, c) for bs, (c, ns) in samples.items() if c > 0]
    if not pts:
        return None
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts])
    w = np.sqrt(np.array([p[2] for p in pts], dtype=float))
    if len(pts) == 1:
        return 0.0, float(y[0])
    a, b = np.polyfit(x, y, 1, w=w)
    return max(float(a), 0.0), max(float(b), 0.0)


def recommend(cells: list[Cell], fit: tuple[float, float] | None, p99_ms: float, max_batch: int) -> dict[str, Any]:
    ok = [c for c in cells if c.p99_ms is not None and c.p99_ms <= p99_ms and c.errors == 0]
    best = max(ok, key=lambda c: c.goodput) if ok else None
    pref = None
    if fit is not None and max_batch > 0:
        a, b = fit
        budget = p99_ms / 2  # half the target for one execution; the rest for queueing + transport
        cands = [bs for bs in range(1, max_batch + 1) if a * bs + b <= budget]
        pref = max(cands) if cands else 1
        if best is not None:
            pref = max(1, min(pref, best.concurrency))  # a batch the load can actually fill
    delay = best.delay_us if best else None
    note = ""
    if best is not None and best.concurrency == 1:
        # one request at a time never forms a batch: a queue delay would only add latency
        delay, pref = 0, None
        note = "the target is met only at concurrency 1, where nothing can be batched: no queue delay"
    return {"best_cell": best.__dict__ if best else None,
            "max_queue_delay_microseconds": delay,
            "preferred_batch_size": pref,
            "met_target": best is not None, "note": note}


def snippet(rec: dict[str, Any]) -> str:
    lines = ["dynamic_batching {"]
    if rec["preferred_batch_size"]:
        lines.append(f"  preferred_batch_size: [ {rec['preferred_batch_size']} ]")
    if rec["max_queue_delay_microseconds"] is not None:
        lines.append(f"  max_queue_delay_microseconds: {rec['max_queue_delay_microseconds']}")
    lines.append("}")
    return "\n".join(lines)


async def tune(args: argparse.Namespace) -> dict[str, Any]:
    from load.cli import run_scenario

    delays = [int(x) for x in str(args.delays).split(",") if x]
    concs = [int(x) for x in str(args.concurrency).split(",") if x]
    url = args.url
    async with aiohttp.ClientSession() as session:
        original = await _get(session, f"http://{url}/v2/models/{args.model}/config")
        max_batch = int(original.get("max_batch_size", 0) or 0)
        if max_batch <= 0:
            raise SystemExit(f"tune: '{args.model}' has max_batch_size 0: it does not batch, nothing to tune")
        samples: dict[int, tuple[int, int]] = {}
        cells: list[Cell] = []
        try:
            for d in delays:
                cfg = copy.deepcopy(original)
                db = cfg.setdefault("dynamic_batching", {})
                db["max_queue_delay_microseconds"] = d
                db.pop("preferred_batch_size", None)  # measure the plain delay policy
                await _post_load(session, url, args.model, cfg)
                for c in concs:
                    sc = Scenario(name=f"delay{d}-c{c}", http=url, grpc=args.grpc or url, concurrency=c,
                                  duration_s=args.step_s, warmup_s=args.warmup_s,
                                  targets=[Target(model=args.model, protocol=args.protocol,
                                                  input_file=args.input_file)])
                    before = _batch_totals(await _get(session, f"http://{url}/v2/models/{args.model}/stats"))
                    res = await run_scenario(sc, quiet=True)
                    after = _batch_totals(await _get(session, f"http://{url}/v2/models/{args.model}/stats"))
                    for bs, (cnt, ns) in after.items():
                        c0, n0 = before.get(bs, (0, 0))
                        if cnt >= c0:
                            cnt, ns = cnt - c0, ns - n0
                        s0 = samples.get(bs, (0, 0))
                        samples[bs] = (s0[0] + cnt, s0[1] + ns)
                    rpe = [s["rows_per_execution"] for s in res["server_stats"].values()]
                    cell = Cell(d, c, res["goodput_rps"], res["latency_ms"]["p50"], res["latency_ms"]["p99"],
                                res["failed"], rpe[0] if rpe else None)
                    cells.append(cell)
                    print(f"  delay {d:>6} µs  c {c:>3}: {cell.goodput:8.1f}/s  p50 {cell.p50_ms} ms  "
                          f"p99 {cell.p99_ms} ms  rows/exec {cell.rows_per_exec}  errors {cell.errors}", flush=True)
        finally:
            await _post_load(session, url, args.model, original)
    fit = fit_linear(samples)
    rec = recommend(cells, fit, args.p99_ms, max_batch)
    return {"model": args.model, "p99_target_ms": args.p99_ms, "cells": [c.__dict__ for c in cells],
            "compute_ms_by_batch": {str(bs): round(ns / c / 1e6, 4) for bs, (c, ns) in sorted(samples.items()) if c},
            "fit": {"a_ms_per_row": fit[0], "b_ms": fit[1]} if fit else None,
            "recommendation": rec, "snippet": snippet(rec)}


def cmd(args: argparse.Namespace) -> None:
    print(f"tune {args.model}: p99 target {args.p99_ms} ms against {args.url}", flush=True)
    out = asyncio.run(tune(args))
    fit = out["fit"]
    if fit:
        print(f"compute ≈ {fit['a_ms_per_row']:.4f} ms × batch + {fit['b_ms']:.4f} ms "
              f"(from batch_stats compute_infer: {out['compute_ms_by_batch']})")
    rec = out["recommendation"]
    if rec["met_target"]:
        b = rec["best_cell"]
        print(f"best cell meeting p99 ≤ {args.p99_ms} ms: delay {b['delay_us']} µs at concurrency "
              f"{b['concurrency']}: {b['goodput']:.1f}/s, p99 {b['p99_ms']} ms")
        if rec["note"]:
            print(rec["note"])
    else:
        print(f"no swept cell met p99 ≤ {args.p99_ms} ms: the snippet only sets the batch size; "
              f"lower the load or raise the target")
    print("\nconfig.pbtxt snippet:\n" + out["snippet"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="meshserve tune", description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(ap)
    cmd(ap.parse_args(argv))


if __name__ == "__main__":
    main()
