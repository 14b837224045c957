"""The gateway's front door with TLS on against off, in CPU per request, with Triton's perf_analyzer
as the client (gRPC, HTTP binary, HTTP JSON): docs/perf/tls-cost.md, "Where the front door's time went".

    python -m load.bench.tls_front [--models add_sub,mlp] [--modes grpc,http,http-json] [-c 32]
        [--rounds 3] [--window 6] [--baseline-tree DIR] [--together]

One ONNX service on the bench models (/tmp/bench-models/onnx_repo, ../shared/bench/gen_models.py)
and, in front of it, a plaintext gateway (label ``off``) and a gateway with TLS on its gRPC and
HTTP ports (``tls``); with --baseline-tree, one more TLS gateway run from another checkout of the
project (``tls@base``: e.g. `git worktree add /tmp/base <rev>`). The hop is plaintext for all.

Per cell, each label is driven in turn by perf_analyzer at concurrency -c for a few seconds; over a
window of --window seconds in its middle the gateway's CPU seconds (/proc) and its own count of
requests answered (meshserve_gateway_requests_total) give µs per request. The machine is shared:
each cell's median over --rounds is printed. --together drives every label at the same time, each
with its own perf_analyzer, so that all see the same machine (their throughputs then differ, and
a gateway's CPU per request falls as its throughput rises: it merges more requests per hop call).
"""
from __future__ import annotations

import argparse
import os
import re
import ssl
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from load.bench import procs

ROOT = procs.ROOT
MODELS = Path(os.environ.get("MODELS_DIR", "/tmp/bench-models"))
PERF_ANALYZER = os.environ.get("PERF_ANALYZER", str(ROOT.parent / "shared" / "tools" / "perf_analyzer"))
MODES = {"grpc": ["-i", "grpc"], "http": ["-i", "http"],
         "http-json": ["-i", "http", "--input-tensor-format=json", "--output-tensor-format=json"]}


def _ready(gw: procs.Server, ctx: ssl.SSLContext | None, timeout: float = 120) -> None:
    procs.wait_ready(gw.http, timeout, gw.proc, ctx)


def _gateway(tree: Path, upstream: str, log: Path, extra: list[str], ctx: ssl.SSLContext | None) -> procs.Server:
    """A gateway run from ``tree`` (procs.Server runs from procs.ROOT; its readiness check is plain HTTP)."""
    here, wait = procs.ROOT, procs.wait_ready
    procs.ROOT, procs.wait_ready = tree, (lambda *a, **k: None)
    try:
        gw = procs.gateway([upstream], log, extra=[*extra, "--metrics-port", "0"])
    finally:
        procs.ROOT, procs.wait_ready = here, wait
    _ready(gw, ctx)
    return gw


def _answered(gw: procs.Server, model: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.ports['metrics']}/metrics", timeout=5) as r:
        text = r.read().decode()
    line = f'meshserve_gateway_requests_total{{model="{model}",outcome="OK"}} '
    found = re.search(re.escape(line) + r"(\d+)", text)
    return int(found.group(1)) if found else 0


def _pa(gw: procs.Server, tls: bool, ca: Path, model: str, mode: str, c: int, seconds: float) -> subprocess.Popen[bytes]:
    if mode == "grpc":
        url, extra = gw.grpc, (["--ssl-grpc-use-ssl", "true", "--ssl-grpc-root-certifications-file", str(ca)]
                               if tls else [])
    else:
        url = ("https://" if tls else "") + gw.http
        extra = (["--ssl-https-verify-peer", "1", "--ssl-https-verify-host", "2",
                  "--ssl-https-ca-certificates-file", str(ca)] if tls else [])
    cmd = [PERF_ANALYZER, "-m", model, "-u", url, *MODES[mode], "--concurrency-range", str(c),
           "--measurement-interval", str(int(seconds * 1000 / 3)), "--max-trials", "3",
           "--stability-percentage", "999", "--input-data", str(MODELS / "perf_data" / f"{model}.json"), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    from meshserve.server import certs

    ap = argparse.ArgumentParser(prog="python -m load.bench.tls_front", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="add_sub")
    ap.add_argument("--modes", default="grpc,http,http-json")
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=6.0, help="seconds measured per cell and label")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="another checkout: its TLS gateway too")
    ap.add_argument("--together", action="store_true", help="drive all labels at once")
    a = ap.parse_args(argv)
    tick = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca = certs.authority(d, "ca")
        server = ca.issue(d, "server", server=True)
        front = ["--grpc-use-ssl", "--http-use-ssl", "--grpc-server-cert", str(server.cert), "--grpc-server-key", str(server.key),
                  "--http-server-cert", str(server.cert), "--http-server-key", str(server.key)]
        ctx = ssl.create_default_context(cafile=str(ca.cert))
        svc = procs.service(MODELS / "onnx_repo", d / "svc.log", env={"BENCH_ORT_THREADS": "2"})
        gws: dict[str, tuple[procs.Server, bool]] = {}
        try:
            gws["off"] = (_gateway(ROOT, svc.grpc, d / "gw-off.log", [], None), False)
            gws["tls"] = (_gateway(ROOT, svc.grpc, d / "gw-tls.log", front, ctx), True)
            if a.baseline_tree is not None:
                gws["tls@base"] = (_gateway(a.baseline_tree.resolve(), svc.grpc, d / "gw-base.log", front, ctx), True)
            runs: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
            for rnd in range(a.rounds):
                for model in a.models.split(","):
                    for mode in a.modes.split(","):
                        groups = [list(gws)] if a.together else [[label] for label in gws]
                        line = f"round {rnd} {model:8s} {mode:9s}"
                        for group in groups:
                            clients = [_pa(gws[g][0], gws[g][1], ca.cert, model, mode, a.concurrency,
                                           a.window + 6) for g in group]
                            time.sleep(3)
                            s0 = {g: (procs.cpu_seconds(gws[g][0].pid), _answered(gws[g][0], model)) for g in group}
                            time.sleep(a.window)
                            s1 = {g: (procs.cpu_seconds(gws[g][0].pid), _answered(gws[g][0], model)) for g in group}
                            for p in clients:
                                p.kill()
                                p.wait()
                            for g in group:
                                n = max(s1[g][1] - s0[g][1], 1)
                                us = (s1[g][0] - s0[g][0]) * 1e6 / n
                                runs.setdefault((model, mode, g), []).append((us, n / a.window))
                                line += f"  {g} {us:6.1f} µs/req {n / a.window:6.0f}/s"
                        print(f"{line}  (load {os.getloadavg()[0]:.1f}; CPU tick {1e6 / tick:.0f} µs)", flush=True)
        finally:
            for gw, _ in gws.values():
                gw.stop()
            svc.stop()
    print(f"\nmedian of {a.rounds} rounds, c{a.concurrency}, gateway CPU µs per request (req/s), "
          f"{'labels driven together' if a.together else 'labels in turn'}")
    print("| model | protocol | " + " | ".join(gws) + " |")
    print("|---|---|" + "---|" * len(gws))
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            base = statistics.median(us for us, _ in runs[(model, mode, "off")])
            cells = []
            for g in gws:
                us = statistics.median(u for u, _ in runs[(model, mode, g)])
                rate = statistics.median(r for _, r in runs[(model, mode, g)])
                cells.append(f"{us:.1f} ({rate:.0f}/s)" + ("" if g == "off" else f" {100 * (us / base - 1):+.1f}%"))
            print(f"| {model} | {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
