"""A stand-in v2 service for the response cache's single-flight test: slow_service's `sleep_a`
(echoes its input after `--delay-ms`) with `response_cache { enable: true }`, and statistics
that count its executions. Run: python -m tests.integration.cache_slow_service."""
from __future__ import annotations

import argparse

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import limits as server_limits
from meshserve.server.core import InferResult, RequestContext
from meshserve.server.process import run, serve
from tests.integration.slow_service import SlowCore


class CachedSlowCore(SlowCore):
    def __init__(self, delay_s: float):
        super().__init__(delay_s)
        self.executions = 0

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse:
        resp = await super().model_config(name, version)
        resp.config.response_cache.enable = True
        return resp

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult:
        self.executions += 1
        return await super().infer(request, ctx)

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        stats = pb.ModelStatistics(name="sleep_a", version="1", execution_count=self.executions,
                                   inference_count=self.executions)
        stats.inference_stats.success.count = self.executions
        return pb.ModelStatisticsResponse(model_stats=[stats])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc-port", type=int, default=0)
    ap.add_argument("--http-port", type=int, default=None)
    ap.add_argument("--delay-ms", type=float, default=300)
    args = ap.parse_args()
    run(serve(CachedSlowCore(args.delay_ms / 1000), name="slow", host="127.0.0.1", grpc_port=args.grpc_port,
              http_port=args.http_port, limits=server_limits.ServerLimits()))


if __name__ == "__main__":
    main()
