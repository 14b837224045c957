"""Entry point shared by every backend service: `meshserve service KIND ...`."""
from __future__ import annotations

import argparse
from pathlib import Path

from meshserve.server.process import run, serve, setup_logging
from services.base.core import ServiceCore
from services.base.runtime import RuntimeAdapter


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repository", required=True, type=Path, help="Triton-layout model repository")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--grpc-port", type=int, default=8101, help="gRPC port (0 = pick a free one)")
    ap.add_argument("--http-port", type=int, default=None, help="also serve v2 REST on this port")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ap.add_argument("--log-level", default="INFO")


def main(kind: str, adapters: dict[str, RuntimeAdapter], args: argparse.Namespace,
         gpu_available: bool = False) -> None:
    setup_logging(args.log_level)
    if not args.repository.is_dir():
        raise SystemExit(f"meshserve service {kind}: model repository {args.repository} does not exist")

    async def amain() -> None:
        core = ServiceCore(kind, args.repository, adapters, gpu_available=gpu_available)
        await core.start()
        await serve(core, name=f"{kind}-service", host=args.host, grpc_port=args.grpc_port,
                    http_port=args.http_port, metrics_port=args.metrics_port)

    run(amain())
