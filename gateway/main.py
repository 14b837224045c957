"""`meshserve gateway`: the front door process."""
from __future__ import annotations

import argparse

from gateway.core import GatewayCore
from meshserve.server.process import run, serve, setup_logging


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="also serve Prometheus /metrics on this port (always on the HTTP port too)")
    ap.add_argument("--upstream", action="append", default=[], metavar="HOST:PORT",
                    help="a service's gRPC endpoint (repeat for each service / replica)")
    ap.add_argument("--discovery-interval", type=float, default=2.0, metavar="SECONDS")
    ap.add_argument("--coalesce-inflight", type=int, default=2, metavar="N",
                    help="merge concurrently pending requests for a batchable model while N merged "
                         "requests per replica are in flight (0 = never merge)")
    ap.add_argument("--log-level", default="INFO")


def main(args: argparse.Namespace) -> None:
    setup_logging(args.log_level)
    if not args.upstream:
        raise SystemExit("meshserve gateway: give at least one --upstream HOST:PORT")

    async def amain() -> None:
        core = GatewayCore(args.upstream, args.discovery_interval, args.coalesce_inflight)
        await core.start()
        await serve(core, name="gateway", host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                    metrics_port=args.metrics_port)

    run(amain())
