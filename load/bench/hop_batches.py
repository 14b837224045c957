"""Does the gateway hop shrink batches? Rows per execution direct vs through the gateway.

    python -m load.bench.hop_batches [--concurrency 8] [--protocols grpc,http] [--models add_sub,mlp]

One ONNX service on the team's bench models (``../shared/bench/gen_models.py``: max batch 64,
1000 µs queue delay) and one gateway in front of it; per model and protocol, Triton's
perf_analyzer drives the service directly and then through the gateway, and the service's own
statistics give rows per execution (inference_count / execution_count) for each run. Also per
run: the service's and the gateway's CPU per client request (from /proc) and the gateway's merged
sends. Rows per execution is a ratio that stays meaningful on a busy machine; the throughputs and
p99s printed beside it are not (say so when quoting them).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from load.bench import procs

PA = procs.ROOT.parent / "shared" / "tools" / "perf_analyzer"
GEN_MODELS = procs.ROOT.parent / "shared" / "bench" / "gen_models.py"


def bench_models(path: str) -> Path:
    """The team's bench models at ``path`` (gen_models.py with 2 ORT threads; made if missing)."""
    models = Path(path)
    if not (models / "onnx_repo" / "mlp").is_dir():
        subprocess.run([sys.executable, str(GEN_MODELS), str(models)], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "BENCH_ORT_THREADS": "2"})
    return models


def model_stats(http: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of ``model`` at the server ``http``."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as r:
        s = json.load(r)["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


COALESCER_COUNTERS = ("merged_sends", "merged_requests", "coalesce_queued", "coalesce_held", "coalesce_wait_us")


def coalescer_counters(http: str) -> dict[str, float]:
    """The gateway's coalescing counters (COALESCER_COUNTERS) from its /metrics: merged sends and
    the client requests they carried; requests that queued in a group, were held by the in-flight
    bound, and the microseconds they waited there."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {k: re.search(rf"^meshserve_gateway_{k}_total(?:{{}})? (\S+)", text, re.M) for k in COALESCER_COUNTERS}
    return {k: float(m.group(1)) if m else 0.0 for k, m in found.items()}


def perf_analyzer(url: str, model: str, protocol: str, conc: int, interval_ms: int, data: Path,
                  out: Path) -> tuple[float, float] | str:
    """(inferences/s, p99 ms), or the error's last line."""
    cmd = [str(PA), "-m", model, "-u", url, "-i", "grpc" if protocol == "grpc" else "http",
           "--concurrency-range", str(conc), "--measurement-interval", str(interval_ms),
           "--stability-percentage", "100", "--max-trials", "3", "--input-data", str(data), "-f", str(out)]
    if protocol == "http-json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or not out.exists():
        return ((p.stdout + p.stderr).strip().splitlines() or ["failed"])[-1]
    row = next(csv.DictReader(out.open()))
    return float(row["Inferences/Second"]), int(row["p99 latency"]) / 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.hop_batches", description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--protocols", default="grpc", help="comma list of grpc, http, http-json")
    ap.add_argument("--models", default="add_sub,mlp")
    ap.add_argument("--interval", type=int, default=2000, help="perf_analyzer window, ms")
    ap.add_argument("--bench-models", default="/tmp/bench-models", help="gen_models.py output (made if missing)")
    ap.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    a = ap.parse_args(argv)
    models = bench_models(a.bench_models)
    logs = Path(tempfile.mkdtemp(prefix="hop-batches-"))
    svc = procs.service(models / "onnx_repo", logs / "service.log")
    try:
        gw = procs.gateway([svc.grpc], logs / "gateway.log", a.gateway_arg)
    except Exception:
        svc.stop()
        raise
    print(f"c{a.concurrency}; rows/exec = the service's inference_count / execution_count over the run; "
          "CPU per client request from /proc; throughput and p99 only mean something on a quiet machine")
    try:
        for model in a.models.split(","):
            for protocol in a.protocols.split(","):
                for label, target in (("direct", svc), ("gateway", gw)):
                    url = target.grpc if protocol == "grpc" else target.http
                    i0, e0 = model_stats(svc.http, model)
                    c0 = procs.proc_tree_cpu_s(svc.pid), procs.proc_tree_cpu_s(gw.pid)
                    m0 = coalescer_counters(gw.http)
                    res = perf_analyzer(url, model, protocol, a.concurrency, a.interval,
                                        models / "perf_data" / f"{model}.json", logs / f"{model}-{protocol}-{label}.csv")
                    i1, e1 = model_stats(svc.http, model)
                    c1 = procs.proc_tree_cpu_s(svc.pid), procs.proc_tree_cpu_s(gw.pid)
                    m1 = coalescer_counters(gw.http)
                    d = {k: m1[k] - m0[k] for k in COALESCER_COUNTERS}
                    n = max(1, i1 - i0)
                    shown = f"{res[0]:7.0f}/s p99 {res[1]:6.2f} ms" if isinstance(res, tuple) else f"FAILED: {res}"
                    print(f"{model:8s} {protocol:9s} {label:8s} rows/exec {n / max(1, e1 - e0):5.2f}  {shown}  "
                          f"CPU/request: service {1e6 * (c1[0] - c0[0]) / n:4.0f} us, gateway "
                          f"{1e6 * (c1[1] - c0[1]) / n:4.0f} us  merged: {d['merged_requests']:.0f} of {n} requests "
                          f"in {d['merged_sends']:.0f} sends ({d['merged_requests'] / max(1, d['merged_sends']):.1f} "
                          f"per send); queued {d['coalesce_queued']:.0f}, held {d['coalesce_held']:.0f}, "
                          f"{d['coalesce_wait_us'] / max(1, d['coalesce_queued']):.0f} us each", flush=True)
    finally:
        gw.stop()
        svc.stop()


if __name__ == "__main__":
    procs.clean_exit()
    main()
