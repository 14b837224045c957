"""StubCore: the parts of a V2Core that stand-in services (tests/integration/slow_service.py,
decoupled_service.py) share: everyone allowed, always live and ready, a fixed model list
(``MODELS``, version 1), empty statistics and metrics, model control a no-op."""
from __future__ import annotations

import argparse

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server import limits as server_limits
from meshserve.server.access import ALL, Grant, Op
from meshserve.server.core import EXTENSIONS, RequestContext
from meshserve.server.process import run, serve


class StubCore:
    NAME = "stub"
    MODELS: tuple[str, ...] = ()

    def authorize(self, op: Op, model: str, ctx: RequestContext) -> Grant:
        return ALL

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=self.NAME, version="0", extensions=EXTENSIONS)

    async def model_ready(self, name: str, version: str) -> bool:
        return name in self.MODELS and version in ("", "1")

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        return pb.ModelStatisticsResponse()

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse:
        out = pb.RepositoryIndexResponse()
        for m in self.MODELS:
            out.models.add(name=m, version="1", state="READY")
        return out

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None:
        return None

    async def unload_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                           ctx: RequestContext) -> None:
        return None

    async def metrics_text(self) -> tuple[bytes, str]:
        return b"", "text/plain"

    async def stop(self, drain: bool = True) -> None:
        return None


def serve_main(core: object, name: str) -> None:
    """A stand-in service's ``main``: ``core`` served on --grpc-port / --http-port (0: free
    ports, printed in the ready line) with a service's limits flags."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc-port", type=int, default=0)
    ap.add_argument("--http-port", type=int, default=None)
    server_limits.add_arguments(ap)
    args = ap.parse_args()
    run(serve(core, name=name, host="127.0.0.1", grpc_port=args.grpc_port,  # type: ignore[arg-type]
              http_port=args.http_port, limits=server_limits.from_args(args)))
