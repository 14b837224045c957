"""`meshserve gateway --workers N`: N gateway processes on the same ports (SO_REUSEPORT).

The supervisor and what the workers share are meshserve/server/workers.py's; this module is
the gateway's part: which flags a worker is started with, which combinations are refused,
and the gateway's /metrics across the workers (docs/gateway.md, "Worker processes").
"""
from __future__ import annotations

import argparse
import sys

from gateway.core import GatewayCore
from meshserve.server import workers
from meshserve.telemetry import metrics


class WorkerGatewayCore(GatewayCore):
    """A worker's core: its /metrics shows every worker's counts.

    A scrape lands on one worker; that worker reads each sibling's own exposition over loopback
    (meshserve/server/workers.py:WorkerMetrics) and serves them all, every sample labelled with
    its worker (``worker="0"`` ...), next to its own and (with --federate-metrics) the services'
    families, which are read once, by the answering worker. Labels, not sums: a counter summed
    over workers would go backwards when a restarted worker starts again from 0, where
    Prometheus handles a reset per series; ``sum without (worker)`` gives the gateway's total.
    The response cache's ``nv_cache_*`` are the exception: the workers count into one shared
    table (gateway/shared_cache.py), so the answering worker renders those totals once, without
    a worker label, as Triton names them."""

    worker: workers.Worker

    async def local_metrics_text(self) -> tuple[bytes, str]:
        """This worker's own samples (what a sibling reads; not the shared cache counts)."""
        samples, families = self.own_metrics(cache=False)
        return metrics.render(samples, families), metrics.CONTENT_TYPE

    async def metrics_text(self) -> tuple[bytes, str]:
        services = await self.federation.families() if self.federate_metrics else []  # first: it sets up
        samples, families = self.own_metrics(cache=False)
        own = metrics.federate(metrics.render(samples, families).decode(), {"worker": str(self.worker.index)})
        siblings = [metrics.federate(text, {"worker": str(index)})
                    for index, text in await self.worker.metrics.sibling_texts()]
        shared = self.cache.counts.samples() if self.cache is not None else []
        return metrics.render(shared, families, [own, *siblings, *services]), metrics.CONTENT_TYPE


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=workers.DEFAULT_WORKERS, metavar="N",
                    help="gateway processes sharing the ports (SO_REUSEPORT; the kernel spreads the "
                         f"connections); default {workers.DEFAULT_WORKERS}: one process, no supervisor")
    ap.add_argument("--worker-state", default=None, help=argparse.SUPPRESS)  # set by the supervisor
    ap.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> None:
    """Refuse what several workers cannot do as one process."""
    if args.workers < 1:
        raise SystemExit(f"meshserve gateway: --workers must be at least 1, got {args.workers}")
    if args.workers > 1 and args.tenants is not None and args.quota_store == "memory":
        raise SystemExit(
            f"meshserve gateway: --workers {args.workers} with --tenants and --quota-store memory: each worker would "
            "enforce every tenant's full quota on its own; use --quota-store redis://HOST:PORT (shared by the "
            "workers) or --workers 1")


def supervise(args: argparse.Namespace) -> int:
    """Run args.workers gateway workers (each this command with --workers 1 and the chosen ports)."""
    raw: list[str] = list(getattr(args, "raw_argv", None) or sys.argv[1:])
    ports = {"grpc": args.grpc_port, "http": args.http_port}
    if args.metrics_port is not None:
        ports["metrics"] = args.metrics_port

    def argv(index: int, chosen: dict[str, int], directory: str) -> list[str]:
        out = [sys.executable, "-m", "meshserve", *raw, "--workers", "1", "--worker-state", directory,
               "--worker-index", str(index)]
        for key, port in chosen.items():
            out += [f"--{key}-port", str(port)]
        return out

    return workers.supervise("gateway", args.workers, args.host, ports, argv)
