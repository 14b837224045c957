"""What TLS costs per request: gateway and service CPU (and latency) for unary gRPC add_sub with
TLS off, on the gateway's front door, and on the front door and the hop (mutual TLS), measured
in one run (docs/security.md, "TLS and mutual TLS").

    python -m load.bench.tls_cost --repository REPO [-n 3000] [-c 32] [--warmup 300]

REPO holds add_sub (FP32 [1,16] INPUT0/INPUT1), e.g. `python -m tests.models.generate DIR`'s.
The client is meshserve's own HTTP/2 client (load/transport.py's H2GrpcSender path): one
connection, `-c` calls in flight. A throwaway CA (tests/support/certs.py) signs every certificate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from load.bench import procs
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import h2

_INFER = "/inference.GRPCInferenceService/ModelInfer"


def _request() -> bytes:
    req = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        t = req.inputs.add()
        t.name, t.datatype = name, "FP32"
        t.shape.extend([1, 16])
        req.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    return req.SerializeToString()


async def _drive(endpoint: str, ctx: ssl.SSLContext | None, n: int, c: int) -> list[float]:
    channel = h2.Channel(endpoint, 10.0, ctx)
    payload = _request()
    latencies: list[float] = []
    left = [n]

    async def worker() -> None:
        conn = await channel.get()
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            await conn.unary(_INFER, payload, (), 30.0)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(c)))
    channel.close()
    return latencies


def _cell(name: str, gw: procs.Server, svc: procs.Server, ctx: ssl.SSLContext | None,
          args: argparse.Namespace) -> dict[str, Any]:
    asyncio.run(_drive(gw.grpc, ctx, args.warmup, args.concurrency))
    g0, s0, t0 = procs.cpu_seconds(gw.pid), procs.cpu_seconds(svc.pid), time.perf_counter()
    lat = asyncio.run(_drive(gw.grpc, ctx, args.requests, args.concurrency))
    wall = time.perf_counter() - t0
    g1, s1 = procs.cpu_seconds(gw.pid), procs.cpu_seconds(svc.pid)
    lat.sort()
    return {"cell": name, "gateway_cpu_us": (g1 - g0) / args.requests * 1e6,
            "service_cpu_us": (s1 - s0) / args.requests * 1e6, "rps": args.requests / wall,
            "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3}


def main(argv: list[str] | None = None) -> None:
    from tests.support import certs

    ap = argparse.ArgumentParser(prog="python -m load.bench.tls_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("-n", "--requests", type=int, default=3000)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2, help="each cell measured this many times, interleaved")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca = certs.authority(d, "mesh-ca")
        server, hop = ca.issue(d, "server", server=True), ca.issue(d, "hop", server=False)
        front = ["--grpc-use-ssl", "--grpc-server-cert", str(server.cert), "--grpc-server-key", str(server.key)]
        mutual = [*front, "--grpc-use-ssl-mutual", "--grpc-root-cert", str(ca.cert)]
        upstream = ["--upstream-root-cert", str(ca.cert), "--upstream-client-cert", str(hop.cert),
                    "--upstream-client-key", str(hop.key)]
        load = ["--model-control-mode", "explicit", "--load-model", "add_sub"]
        started: list[procs.Server] = []
        try:
            plain_svc = procs.service(args.repository, d / "svc.log", control=load)
            started.append(plain_svc)
            tls_svc = procs.Server(["service", "onnx", "--repository", str(args.repository), "--http-port", "0",
                                    "--grpc-port", "0", "--log-level", "WARNING", *load, *mutual], d / "svc2.log")
            started.append(tls_svc)
            cells: list[tuple[str, procs.Server, procs.Server, ssl.SSLContext | None]] = []
            for name, svc, extra in (("off", plain_svc, []), ("front door", plain_svc, front),
                                     ("front door + hop (mTLS)", tls_svc, [*front, *upstream])):
                gw = procs.gateway([svc.grpc], d / f"gw-{len(cells)}.log", extra=extra)
                started.append(gw)
                cells.append((name, gw, svc, ssl.create_default_context(cafile=str(ca.cert)) if extra else None))
            results: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.rounds):
                for name, gw, svc, ctx in cells:
                    results.setdefault(name, []).append(_cell(name, gw, svc, ctx, args))
        finally:
            for p in reversed(started):
                p.stop()
    # each cell's least disturbed round (the machine is shared)
    summary = [min(rows, key=lambda r: r["gateway_cpu_us"] + r["service_cpu_us"]) for rows in results.values()]
    base = summary[0]
    print(f"c{args.concurrency}, {args.requests} requests per cell, best of {args.rounds} rounds")
    print(f"{'cell':26s} {'gateway µs/req':>15s} {'service µs/req':>15s} {'req/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s}")
    for r in summary:
        change = (f"  (gateway {100 * (r['gateway_cpu_us'] / base['gateway_cpu_us'] - 1):+.1f}%, "
                 f"service {100 * (r['service_cpu_us'] / base['service_cpu_us'] - 1):+.1f}%)") if r is not base else ""
        print(f"{r['cell']:26s} {r['gateway_cpu_us']:15.1f} {r['service_cpu_us']:15.1f} {r['rps']:8.0f} "
              f"{r['p50_ms']:7.2f} {r['p99_ms']:7.2f}{change}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
