"""gateway/upstream/discovery.py: a replica whose probe times out once stays in the pool (a busy
service answers its requests but may miss one probe); two timed-out probes in a row, or a refused
one, take it out."""
from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from gateway.upstream import discovery
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc


class FakeReplica:
    def __init__(self) -> None:
        self.endpoint = "127.0.0.1:1"
        self.healthy = False
        self.answer = "ok"  # ok | slow (DEADLINE_EXCEEDED) | refused (UNAVAILABLE)

    def set_healthy(self, healthy: bool) -> bool:
        changed, self.healthy = healthy != self.healthy, healthy
        return changed

    async def server_ready(self, request: pb.ServerReadyRequest, timeout: float) -> pb.ServerReadyResponse:
        if self.answer != "ok":
            code = grpc.StatusCode.DEADLINE_EXCEEDED if self.answer == "slow" else grpc.StatusCode.UNAVAILABLE
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "")
        return pb.ServerReadyResponse(ready=True)

    async def index(self, ready: bool, timeout: float) -> pb.RepositoryIndexResponse:
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name="m", version="1", state="READY")])

    async def model_config(self, request: pb.ModelConfigRequest, timeout: float) -> pb.ModelConfigResponse:
        return pb.ModelConfigResponse(config=mc.ModelConfig(name="m", max_batch_size=8))


@pytest.mark.parametrize("second", ["slow", "refused"])
def test_one_slow_probe_keeps_the_replica_two_in_a_row_or_a_refusal_do_not(second: str) -> None:
    replica = FakeReplica()
    disc = discovery.Discovery(types.SimpleNamespace(replicas=[replica]))  # type: ignore[arg-type]

    def probe(answer: str) -> bool:
        replica.answer = answer
        asyncio.run(disc.refresh())
        routed = disc.table.models.get("m")
        assert routed is not None  # (a down replica's versions stay routed: 503, not 404)
        return replica.healthy

    assert probe("ok")
    assert probe("slow")  # one probe past its timeout: still in the pool, still routed to
    assert disc.config_for("m", "") is not None
    assert not probe(second)  # a second in a row, or refused: out
    assert probe("ok")  # back
    assert probe("slow")  # the count started again
    assert probe("ok") and probe("slow") and not probe("slow")
    assert discovery.SLOW_PROBES == 2
