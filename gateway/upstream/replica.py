"""One upstream service replica: a gRPC channel with raw-bytes infer and typed control calls."""
from __future__ import annotations

from typing import Any

import grpc

from gateway.upstream.stream import StreamPool
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.wire import MAX_MESSAGE_BYTES, SERVICE_KIND_METADATA
from meshserve.server.access import METRICS_SERVICE

_SERVICE = "/inference.GRPCInferenceService/"
CHANNEL_OPTIONS = [  # same message size limit as every server hop
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    ("grpc.keepalive_time_ms", 30000),
    ("grpc.keepalive_timeout_ms", 10000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def _typed(channel: grpc.aio.Channel, method: str, req_type: Any, resp_type: Any) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(_SERVICE + method, request_serializer=req_type.SerializeToString,
                               response_deserializer=resp_type.FromString)


class Replica:
    """A service endpoint the gateway forwards to. Counters are the gateway's own view."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        ch = self.channel
        # Infer travels as request bytes over long-lived streams (see stream.py).
        self.streams = StreamPool(endpoint)
        self.server_ready = _typed(ch, "ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse)
        self.model_ready = _typed(ch, "ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse)
        self.model_metadata = _typed(ch, "ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse)
        self.model_config = _typed(ch, "ModelConfig", pb.ModelConfigRequest, pb.ModelConfigResponse)
        self.statistics = _typed(ch, "ModelStatistics", pb.ModelStatisticsRequest, pb.ModelStatisticsResponse)
        self.repository_index = _typed(ch, "RepositoryIndex", pb.RepositoryIndexRequest, pb.RepositoryIndexResponse)
        self.load = _typed(ch, "RepositoryModelLoad", pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse)
        self.unload = _typed(ch, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest,
                             pb.RepositoryModelUnloadResponse)
        # the service's /metrics text over gRPC (bytes in, bytes out): --federate-metrics
        self.scrape = ch.unary_unary(f"/{METRICS_SERVICE}/Scrape")
        self.outstanding = 0
        self.healthy = False
        self.errors = 0
        self.requests = 0
        self.kind: str | None = None  # the service kind it announced (onnx, ...), once it answered an index

    async def index(self, ready_only: bool, timeout: float) -> pb.RepositoryIndexResponse:
        """RepositoryIndex, noting the service kind the replica announces with it."""
        call = self.repository_index(pb.RepositoryIndexRequest(ready=ready_only), timeout=timeout)
        response = await call
        for key, value in await call.trailing_metadata() or ():
            if key == SERVICE_KIND_METADATA and isinstance(value, str):
                self.kind = value
        return response

    def __repr__(self) -> str:
        return f"Replica({self.endpoint}, healthy={self.healthy}, outstanding={self.outstanding})"

    async def close(self) -> None:
        await self.streams.close()
        await self.channel.close()
