"""`meshserve gateway`: the front door process."""
from __future__ import annotations

import argparse

from gateway import cache as response_cache
from gateway import placement as model_mesh
from gateway import shared_cache
from gateway.auth import Admission, QuotaStore, TenantDirectory
from gateway.core import GatewayCore
from gateway.ensemble.catalog import EnsembleCatalog
from gateway.quotas.memory import MemoryQuotaStore
from gateway.quotas.redis import RedisQuotaStore
from gateway.routes import ABRouter
from gateway.upstream.pool import ReplicaPool
from gateway.workers import WorkerGatewayCore, supervise
from gateway.workers import add_arguments as add_worker_arguments
from gateway.workers import check as check_workers
from meshserve.repository.kinds import add_backend_directory
from meshserve.server import limits as server_limits
from meshserve.server import repository_control, tls
from meshserve.server.core import add_server_name_argument
from meshserve.server.process import configure_tracing, run, serve, setup_logging
from meshserve.server.workers import Worker

add_cache_arguments = response_cache.add_arguments  # --cache-config (also `meshserve up`'s)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    add_backend_directory(ap)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="also serve Prometheus /metrics on this port (always on the HTTP port too)")
    ap.add_argument("--upstream", action="append", default=[], metavar="HOST:PORT",
                    help="a service's gRPC endpoint (repeat for each service / replica); a DNS name is "
                         "re-resolved periodically and every address it resolves to is a replica")
    ap.add_argument("--discovery", default=None, metavar="FILE",
                    help="discovery YAML: services: [{kind, endpoints: [HOST:PORT, ...]}], resolve_interval_s "
                         "(re-read when it changes); adds to --upstream")
    ap.add_argument("--resolve-interval", type=float, default=10.0, metavar="SECONDS",
                    help="how often DNS names among the upstreams are resolved again")
    ap.add_argument("--discovery-interval", type=float, default=2.0, metavar="SECONDS")
    ap.add_argument("--coalesce-inflight", type=int, default=2, metavar="N",
                    help="merge requests for a batchable model that are pending at the same moment; hold "
                         "them in the gateway only while N full batches (max_batch_size rows per instance) "
                         "per replica are in flight (0 = never merge)")
    add_tenant_arguments(ap)
    add_front_door_arguments(ap)
    response_cache.add_arguments(ap)
    ap.add_argument("--federate-metrics", action="store_true",
                    help="/metrics also carries the services' Triton nv_* families (read from each healthy "
                         "replica at scrape time, labelled replica=HOST:PORT); `meshserve up` turns it on. "
                         "Leave it off where Prometheus scrapes the services itself (deploy/prometheus.yml), "
                         "or their counts are summed twice")
    ap.add_argument("--routes", default=None, metavar="PATH",
                    help="routes.yaml: A/B routes addressable like models (weights, sticky header, shadow); "
                         "re-read when it changes")
    ap.add_argument("--repository", default=None, metavar="PATH",
                    help="the model repository: the gateway runs its platform \"ensemble\" models itself "
                         "(their steps go to the services)")
    ap.add_argument("--ensemble-max-inflight-steps", type=int, default=256, metavar="N",
                    help="ensemble step requests in flight at once across all ensembles")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--log-format", choices=("text", "json"), default="text",
                    help="json: one JSON object per log line (request id and trace id as keys)")
    model_mesh.add_arguments(ap)
    add_worker_arguments(ap)
    add_server_name_argument(ap)
    repository_control.add_arguments(ap)
    server_limits.add_arguments(ap)
    tls.add_upstream_arguments(ap)


def add_front_door_arguments(ap: argparse.ArgumentParser) -> None:
    """Triton's --allow-http and --allow-metrics: flags of `meshserve gateway` and `meshserve up`."""
    ap.add_argument("--allow-http", type=tls.bool_argument, nargs="?", const=True, default=True, metavar="BOOL",
                    help="serve HTTP/REST (default true; false: gRPC only, as Triton's flag)")
    ap.add_argument("--allow-metrics", type=tls.bool_argument, nargs="?", const=True, default=True, metavar="BOOL",
                    help="serve /metrics (default true; false: neither the metrics port nor /metrics on the HTTP "
                         "port, as Triton's flag)")


def front_door_flags(args: argparse.Namespace) -> list[str]:
    """add_front_door_arguments's flags of ``args`` that are not their defaults, as a command line."""
    return [f"--{name}=false" for name, on in (("allow-http", args.allow_http), ("allow-metrics", args.allow_metrics))
            if not on]


def add_tenant_arguments(ap: argparse.ArgumentParser) -> None:
    """Tenants, their quotas and /metrics auth: flags of `meshserve gateway` and `meshserve up`."""
    ap.add_argument("--tenants", default=None, metavar="PATH",
                    help="tenants.yaml: API keys, per-tenant rate/burst/concurrency, allowed models "
                         "(re-read when it changes; without it every request is anonymous and unmetered)")
    ap.add_argument("--metrics-auth", action="store_true",
                    help="with --tenants: /metrics (which names models and tenants and carries every "
                         "tenant's counts) needs an admin key; default: open, like the health checks, "
                         "for Prometheus scrapers (keep the port off untrusted networks)")
    ap.add_argument("--quota-store", default="memory", metavar="URL",
                    help="where quota state lives: 'memory' (this process) or redis://HOST:PORT[/DB] "
                         "(shared by every gateway replica)")


def main(args: argparse.Namespace) -> None:
    setup_logging(args.log_level, args.log_format)
    check_workers(args)
    try:
        cache = response_cache.CacheConfig.parse(args.cache_config)
    except ValueError as exc:
        raise SystemExit(f"meshserve gateway: --cache-config {exc}") from None
    if cache is not None and cache.kind == "local" and args.workers > 1:  # (gateway/shared_cache.py)
        if cache.size < shared_cache.MIN_SIZE:
            raise SystemExit(f"meshserve gateway: --cache-config local,size={cache.size}: with --workers the "
                             f"workers share the cache, which needs at least {shared_cache.MIN_SIZE} bytes")
        if args.workers > shared_cache.WORKER_SLOTS:
            raise SystemExit(f"meshserve gateway: --cache-config local: at most {shared_cache.WORKER_SLOTS} "
                             f"workers share a local cache, got --workers {args.workers} (use redis)")
    if args.workers > 1:  # a supervisor: its workers are this command with --workers 1
        if not args.upstream and not args.discovery:
            raise SystemExit("meshserve gateway: give at least one --upstream HOST:PORT (or --discovery FILE)")
        raise SystemExit(supervise(args))
    worker = Worker(args.worker_state, args.worker_index) if args.worker_state else None
    limits = server_limits.from_args(args)
    tls.configure_upstream(args)  # the hop's TLS (--upstream-use-ssl), before any replica's channel
    tls.configure_hop(limits.tls, args.host, service=False)  # its key (--hop-key-file): every hop stream signed
    configure_tracing("meshserve-gateway", "gateway")  # OTEL_* environment; off by default
    if not args.upstream and not args.discovery:
        raise SystemExit("meshserve gateway: give at least one --upstream HOST:PORT (or --discovery FILE)")
    try:
        pool = ReplicaPool(args.upstream, args.discovery, args.resolve_interval)
    except ValueError as exc:
        raise SystemExit(f"meshserve gateway: {exc}") from None
    if cache is not None and cache.kind == "redis":
        try:
            import redis.asyncio  # noqa: F401  (the Redis cache's client)
        except ImportError:
            raise SystemExit("meshserve gateway: --cache-config redis: the Redis client is not installed "
                             "(pip install 'meshserve[redis]')") from None
    try:
        placement = model_mesh.policy_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"meshserve gateway: {exc}") from None
    admission = _admission(args.tenants, args.quota_store)
    # with tenants, a mutual-TLS port's client certificates may name them (gateway/auth.py)
    tls.configure_cert_names(limits.tls, tenants=admission is not None)
    if args.metrics_auth and admission is None:
        raise SystemExit("meshserve gateway: --metrics-auth needs --tenants (without tenants there are no keys)")
    try:
        routes = ABRouter(args.routes) if args.routes else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"meshserve gateway: --routes: {exc}") from None
    try:
        ensembles = EnsembleCatalog(args.repository, args.ensemble_max_inflight_steps) if args.repository else None
    except OSError as exc:
        raise SystemExit(f"meshserve gateway: --repository: {exc}") from None

    async def amain() -> None:
        kind = GatewayCore if worker is None else WorkerGatewayCore
        core = kind(args.upstream, args.discovery_interval, args.coalesce_inflight, admission=admission,
                    pool=pool, routes=routes, ensembles=ensembles,
                    max_request_bytes=limits.max_request_bytes, metrics_auth=args.metrics_auth,
                    federate_metrics=args.federate_metrics, server_name=args.server_name,
                    control=repository_control.ControlPolicy.from_args(args), cache=cache,
                    cache_share=(worker.state.directory, worker.index) if worker is not None else None,
                    placement=placement)
        core.serves_metrics = args.allow_metrics  # (/metrics on the HTTP port: 404 when off)
        if isinstance(core, WorkerGatewayCore) and worker is not None:
            core.worker = worker
            worker.metrics.local = core.local_metrics_text
        await core.start()
        await serve(core, name="gateway", host=args.host, grpc_port=args.grpc_port,
                    http_port=args.http_port if args.allow_http else None,
                    metrics_port=args.metrics_port if args.allow_metrics else None, limits=limits, worker=worker)

    run(amain())


def _admission(tenants: str | None, store_url: str) -> Admission | None:
    if tenants is None:
        return None
    try:
        directory = TenantDirectory(tenants)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"meshserve gateway: --tenants: {exc}") from None
    store: QuotaStore
    if store_url == "memory":
        store = MemoryQuotaStore()
    elif store_url.startswith(("redis://", "rediss://", "unix://")):
        try:
            store = RedisQuotaStore(store_url)
        except ImportError:
            raise SystemExit(f"meshserve gateway: --quota-store '{store_url}': the Redis client is not installed "
                             "(pip install 'meshserve[redis]')") from None
    else:
        raise SystemExit(f"meshserve gateway: --quota-store '{store_url}': expected 'memory' or redis://HOST:PORT")
    return Admission(directory, store)
