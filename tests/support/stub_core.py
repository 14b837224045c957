"""StubCore: the parts of a V2Core that stand-in services (tests/integration/slow_service.py,
decoupled_service.py) share: everyone allowed, always live and ready, a fixed model list
(``MODELS``, version 1), empty statistics and metrics, model control a no-op."""
from __future__ import annotations

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server.access import ALL, Grant, Op
from meshserve.server.core import EXTENSIONS, RequestContext


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
