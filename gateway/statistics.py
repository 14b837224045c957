"""The statistics extension at the gateway: each model's statistics merged over the service
replicas that host it (asked through the Upstream), an ensemble's from the gateway, which runs it."""
from __future__ import annotations

from gateway.ensemble.catalog import EnsembleCatalog
from gateway.upstream.replica import Replica, grpc_error
from gateway.upstream.upstream import Upstream
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError
from meshserve.repository.names import check_model_name, check_version

STATISTICS_TIMEOUT_S = 5.0


async def statistics(upstream: Upstream, ensembles: EnsembleCatalog | None, name: str, version: str
                     ) -> pb.ModelStatisticsResponse:
    """Merged from the services' replicas (counts and durations summed); an ensemble's from the
    gateway (all-model statistics list the ensembles too, as Triton's do)."""
    replicas: list[Replica]
    if name:
        check_version(version, check_model_name(name))
        if ensembles is not None and name in ensembles:
            return pb.ModelStatisticsResponse(model_stats=ensembles.statistics(name, version))
        routes = await upstream.routes(name)
        replicas = list({id(r): r for rs in routes.versions.values() for r in rs}.values())
    else:
        replicas = upstream.healthy()
    req = pb.ModelStatisticsRequest(name=name, version=version)
    results = await upstream.each(replicas, lambda r: r.statistics(req, timeout=STATISTICS_TIMEOUT_S))
    merged: dict[tuple[str, str], pb.ModelStatistics] = {}
    errors = []
    for res in results:
        if isinstance(res, BaseException):
            errors.append(res)
            continue
        for s in res.model_stats:
            key = (s.name, s.version)
            if key in merged:
                add_stats(merged[key], s)
            else:
                merged[key] = s
    if not merged and errors and name:
        err = errors[0]
        raise grpc_error(err) or InferError.unavailable(f"statistics for model '{name}' unavailable: {err}")
    if not name and ensembles is not None:
        for s in ensembles.statistics("", ""):
            merged.setdefault((s.name, s.version), s)
    return pb.ModelStatisticsResponse(model_stats=[merged[k] for k in sorted(merged)])


def _add_duration(a: pb.StatisticDuration, b: pb.StatisticDuration) -> None:
    a.count += b.count
    a.ns += b.ns


def add_stats(into: pb.ModelStatistics, other: pb.ModelStatistics) -> None:
    """Add one replica's statistics of a model version to another's."""
    into.last_inference = max(into.last_inference, other.last_inference)
    into.inference_count += other.inference_count
    into.execution_count += other.execution_count
    for f in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
              "cache_hit", "cache_miss"):
        _add_duration(getattr(into.inference_stats, f), getattr(other.inference_stats, f))
    by_size = {b.batch_size: b for b in into.batch_stats}
    for b in other.batch_stats:
        if b.batch_size in by_size:
            mine = by_size[b.batch_size]
            for f in ("compute_input", "compute_infer", "compute_output"):
                _add_duration(getattr(mine, f), getattr(b, f))
        else:
            into.batch_stats.append(b)
