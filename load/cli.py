"""`python -m load` / `meshserve load`: run a scenario (YAML or flags), print a summary, write JSON + report."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from load.scenario import PROTOCOLS, Scenario, Target, Tenant, load_scenario


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scenario", type=Path, help="scenario YAML (flags below override its top-level fields)")
    ap.add_argument("-m", "--model", action="append", default=[],
                    help="target model (repeatable; without --scenario)")
    ap.add_argument("--protocol", choices=PROTOCOLS, default=None)
    ap.add_argument("--http", help="HTTP host:port (default 127.0.0.1:8000)")
    ap.add_argument("--grpc", help="gRPC host:port (default 127.0.0.1:8001)")
    ap.add_argument("--mode", choices=("closed", "open"))
    ap.add_argument("-c", "--concurrency", type=int)
    ap.add_argument("-r", "--rate", type=float, help="open loop: target requests/s (implies --mode open)")
    ap.add_argument("-d", "--duration", type=float, dest="duration_s")
    ap.add_argument("-n", "--requests", type=int)
    ap.add_argument("--warmup", type=float, dest="warmup_s")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-file", type=Path, help="perf_analyzer-style JSON input data")
    ap.add_argument("--grpc-client", choices=("h2", "aio"),
                    help="unary gRPC implementation (default h2: meshserve's own HTTP/2 client; aio: grpc.aio)")
    ap.add_argument("--http-client", choices=("raw", "aiohttp"),
                    help="HTTP implementation (default raw: the generator's own keep-alive client)")
    ap.add_argument("--api-key", help="Bearer key for every request (without --scenario)")
    ap.add_argument("--json", type=Path, help="write the results JSON here")
    ap.add_argument("--report", type=Path, help="write a markdown report (+ PNG plots) into this directory")
    ap.add_argument("--quiet", action="store_true", help="no live progress")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    overrides: dict[str, Any] = {k: getattr(args, k) for k in
                                 ("http", "grpc", "mode", "concurrency", "rate", "duration_s", "requests",
                                  "warmup_s", "http_client", "grpc_client")}
    if args.rate is not None and args.mode is None:
        overrides["mode"] = "open"
    if args.requests is not None and args.duration_s is None:
        overrides["duration_s"] = None
    if args.scenario:
        sc = load_scenario(args.scenario, {k: v for k, v in overrides.items() if v is not None})
        if args.requests is not None and args.duration_s is None:
            sc = sc.model_copy(update={"duration_s": None, "requests": args.requests})
        return sc
    if not args.model:
        raise SystemExit("load: give --scenario FILE or at least one -m MODEL")
    tenants = {"default": Tenant(api_key=args.api_key)} if args.api_key else {}
    targets = [Target(model=m, protocol=args.protocol or "http-binary", batch=args.batch,
                      input_file=args.input_file, tenant="default" if args.api_key else None)
               for m in args.model]
    fields = {k: v for k, v in overrides.items() if v is not None}
    if "duration_s" in overrides and overrides["duration_s"] is None:
        fields["duration_s"] = None
    return Scenario(targets=targets, tenants=tenants, **fields)


async def run_scenario(sc: Scenario, quiet: bool = True) -> dict[str, Any]:
    """Run one scenario and return the results dict (see load.results.DEFINITIONS)."""
    from load.progress import Progress
    from load.results import summarize
    from load.runner import Driver

    total = (sc.warmup_s + sc.duration_s) if sc.duration_s else None
    drv = Driver(sc, on_tick=None if quiet else Progress(total))
    st = await drv.run()
    return summarize(drv, st)


def run_sync(sc: Scenario, quiet: bool = True) -> dict[str, Any]:
    try:
        import uvloop

        return uvloop.run(run_scenario(sc, quiet))
    except ImportError:
        return asyncio.run(run_scenario(sc, quiet))


def summary_text(res: dict[str, Any]) -> str:
    lat = res["latency_ms"]
    sc = res["scenario"]

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [f"scenario {sc['name']} ({sc['mode']} loop, "
             + (f"concurrency {sc['concurrency']}" if sc["mode"] == "closed" else f"rate {sc['rate']}/s") + ")",
             f"  measured {res['measured_s']:.2f}s: sent {res['sent']}, ok {res['succeeded']}, "
             f"failed {res['failed']}; throughput {res['throughput_rps']:.1f}/s, goodput {res['goodput_rps']:.1f}/s",
             f"  latency ms: p50 {f(lat['p50'])}  p90 {f(lat['p90'])}  p99 {f(lat['p99'])}  "
             f"p99.9 {f(lat['p99.9'])}  max {f(lat['max'])}",
             f"  client CPU: {res['client_cpu']['cores']} cores, {res['client_cpu']['us_per_request']} us/request"]
    if "open_loop" in res:
        lag = res["open_loop"]["send_lag_ms"]
        lines.append(f"  open loop: target {sc['rate']}/s, achieved {res['throughput_rps']}/s, "
                     f"send lag p50 {f(lag['p50'])} ms p99 {f(lag['p99'])} ms")
    for status, n in sorted(res["errors"].items()):
        lines.append(f"  error {status}: {n}")
    for m, s in res["server_stats"].items():
        lines.append(f"  server {m}: inferences {s['inference_count']} in {s['execution_count']} executions "
                     f"(rows/exec {s['rows_per_execution']}), batch sizes {s['batch_sizes']}")
    for e in res["setup_errors"]:
        lines.append(f"  setup: {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load", description=__doc__)
    add_arguments(ap)
    cmd(ap.parse_args(argv))


def cmd(args: argparse.Namespace) -> None:
    try:
        sc = scenario_from_args(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"load: {exc}") from None
    from load.runner import ModelNotReady

    try:
        res = run_sync(sc, quiet=args.quiet)
    except ModelNotReady as exc:
        raise SystemExit(f"load: {exc}") from None
    print(summary_text(res))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        print(f"results: {args.json}", file=sys.stderr)
    if args.report:
        from load.report import write_report

        path = write_report([res], args.report)
        print(f"report: {path}", file=sys.stderr)
