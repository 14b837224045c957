"""What TLS and the authenticated hop cost per request: gateway and service CPU (and latency) for
unary gRPC add_sub, measured in one run (docs/security.md, "TLS and mutual TLS"; docs/perf/hop-auth.md):

- ``off``: plaintext everywhere, the hop not authenticated;
- ``hop key``: the hop's streams signed with a shared --hop-key-file (HMAC per stream), plaintext;
- ``hop mTLS``: the hop on mutual TLS (a mesh CA), the front door plaintext;
- ``front door``: TLS on the gateway's gRPC port, the hop plaintext;
- ``front door + hop key`` and ``front door + hop (mTLS)``.

    python -m load.bench.tls_cost --repository REPO [-n 3000] [-c 32] [--warmup 300] [--rounds 2]
        [--cells "off,hop key"] [--callgrind]

REPO holds add_sub (FP32 [1,16] INPUT0/INPUT1), e.g. `python -m tests.models.generate DIR`'s.
The client is meshserve's own HTTP/2 client (load/transport.py's H2GrpcSender path): one
connection, `-c` calls in flight. A throwaway CA (tests/support/certs.py) signs every certificate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from load.bench import callgrind, procs
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import h2

_INFER = "/inference.GRPCInferenceService/ModelInfer"
# each cell's hop exactly as its flags say: no key from procs.hop_key_file's default
AS_FLAGGED = {procs.HOP_KEY_ENV: ""}
CELLS = ("off", "hop key", "hop mTLS", "front door", "front door + hop key", "front door + hop (mTLS)")


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


def _instructions(name: str, gw: procs.Server, out: Path, ctx: ssl.SSLContext | None,
                  args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's instructions per request (it runs under callgrind: --callgrind)."""
    asyncio.run(_drive(gw.grpc, ctx, args.warmup, args.concurrency))
    before = set(out.parent.glob(out.name + "*"))
    callgrind.control(gw.pid, "--zero")
    callgrind.control(gw.pid, "--instr=on")
    asyncio.run(_drive(gw.grpc, ctx, args.requests, args.concurrency))
    callgrind.control(gw.pid, "--instr=off")
    callgrind.control(gw.pid, "--dump")
    total, gc = callgrind.totals(callgrind.wait_dump(out, before))
    return {"cell": name, "gateway_instructions": total // args.requests, "gc": gc // args.requests}


def main(argv: list[str] | None = None) -> None:
    from tests.support import certs

    ap = argparse.ArgumentParser(prog="python -m load.bench.tls_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("-n", "--requests", type=int, default=3000)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2, help="each cell measured this many times, interleaved")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated, of: {', '.join(CELLS)}")
    ap.add_argument("--callgrind", action="store_true",
                    help="count the gateway's instructions per request (valgrind) instead of CPU seconds")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    wanted = [c.strip() for c in args.cells.split(",") if c.strip()]
    if not wanted or set(wanted) - set(CELLS):
        raise SystemExit(f"--cells: choose from {', '.join(CELLS)}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca = certs.authority(d, "mesh-ca")
        server, hop = ca.issue(d, "server", server=True), ca.issue(d, "hop", server=False)
        (d / "hop-hmac.key").write_text(secrets.token_hex(32))  # (hop.key: the certificate's)
        front = ["--grpc-use-ssl", "--grpc-server-cert", str(server.cert), "--grpc-server-key", str(server.key)]
        mutual = [*front, "--grpc-use-ssl-mutual", "--grpc-root-cert", str(ca.cert)]
        upstream = ["--upstream-root-cert", str(ca.cert), "--upstream-client-cert", str(hop.cert),
                    "--upstream-client-key", str(hop.key)]
        keyed = ["--hop-key-file", str(d / "hop-hmac.key")]
        load = ["--model-control-mode", "explicit", "--load-model", "add_sub"]
        # each cell: (its service's flags, its gateway's flags, TLS at the front door)
        layout = {"off": ([], [], False), "hop key": (keyed, keyed, False), "hop mTLS": (mutual, upstream, False),
                  "front door": ([], front, True), "front door + hop key": (keyed, [*front, *keyed], True),
                  "front door + hop (mTLS)": (mutual, [*front, *upstream], True)}
        started: list[procs.Server] = []
        try:
            services: dict[tuple[str, ...], procs.Server] = {}  # one per distinct set of flags
            cells: list[tuple[str, procs.Server, procs.Server, ssl.SSLContext | None]] = []
            for name in wanted:
                svc_flags, gw_flags, tls_front = layout[name]
                svc = services.get(tuple(svc_flags))
                if svc is None:
                    svc = procs.Server(["service", "onnx", "--repository", str(args.repository), "--http-port", "0",
                                        "--grpc-port", "0", "--log-level", "WARNING", *load, *svc_flags],
                                       d / f"svc-{len(services)}.log", env=AS_FLAGGED)
                    services[tuple(svc_flags)] = svc
                    started.append(svc)
                prefix = callgrind.command(d / f"cg-{len(cells)}.out", instr_at_start=False) if args.callgrind else None
                gw = procs.gateway([svc.grpc], d / f"gw-{len(cells)}.log", extra=gw_flags, prefix=prefix,
                                   timeout=300, env=AS_FLAGGED)
                started.append(gw)
                cells.append((name, gw, svc, ssl.create_default_context(cafile=str(ca.cert)) if tls_front else None))
            results: dict[str, list[dict[str, Any]]] = {}
            for _ in range(args.rounds):
                for i, (name, gw, svc, ctx) in enumerate(cells):
                    results.setdefault(name, []).append(
                        _instructions(name, gw, d / f"cg-{i}.out", ctx, args) if args.callgrind
                        else _cell(name, gw, svc, ctx, args))
        finally:
            for p in reversed(started):
                p.stop()
    if args.callgrind:
        print(f"c{args.concurrency}, {args.requests} requests per cell, {args.rounds} round(s): the gateway's "
              "instructions per request (callgrind)")
        base_i = results[wanted[0]][0]["gateway_instructions"]
        for name, rows in results.items():
            counts = [r["gateway_instructions"] for r in rows]
            print(f"{name:26s} {', '.join(f'{c:,}' for c in counts)}  ({100 * (min(counts) / base_i - 1):+.1f}%)")
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": results}))
        return
    # each cell's least disturbed round (the machine is shared)
    summary = [min(rows, key=lambda r: r["gateway_cpu_us"] + r["service_cpu_us"]) for rows in results.values()]
    base = summary[0]
    print(f"c{args.concurrency}, {args.requests} requests per cell, best of {args.rounds} rounds; load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (the machine's other work)")
    print(f"{'cell':26s} {'gateway µs/req':>15s} {'service µs/req':>15s} {'req/s':>8s} {'p50 ms':>7s} {'p99 ms':>7s}")
    for r in summary:
        change = (f"  (gateway {100 * (r['gateway_cpu_us'] / base['gateway_cpu_us'] - 1):+.1f}%, "
                 f"service {100 * (r['service_cpu_us'] / base['service_cpu_us'] - 1):+.1f}%)") if r is not base else ""
        print(f"{r['cell']:26s} {r['gateway_cpu_us']:15.1f} {r['service_cpu_us']:15.1f} {r['rps']:8.0f} "
              f"{r['p50_ms']:7.2f} {r['p99_ms']:7.2f}{change}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": results}, indent=1))


if __name__ == "__main__":
    procs.clean_exit()
    main()
