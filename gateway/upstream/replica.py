"""One upstream service replica: a gRPC channel with typed control calls, infer over streams
(stream.py), and what a failed call to it means: the client's error, and whether the request
can go to another replica (the only module of the gateway that knows gRPC's status types)."""
from __future__ import annotations

from typing import Any

import grpc

from gateway.upstream.stream import NotSent, StreamBroken, StreamPool
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.wire import MAX_MESSAGE_BYTES, SERVICE_KIND_METADATA
from meshserve.server import tls
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


# What a call to a replica raises when it fails (Replica.failure says what it means).
CALL_ERRORS = (grpc.aio.AioRpcError, InferError, NotSent)


def grpc_error(exc: BaseException) -> InferError | None:
    """A failed gRPC call's status as an InferError (None: ``exc`` is not a gRPC failure)."""
    return InferError.from_grpc(exc.code(), exc.details()) if isinstance(exc, grpc.aio.AioRpcError) else None


def _typed(channel: grpc.aio.Channel, method: str, req_type: Any, resp_type: Any) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(_SERVICE + method, request_serializer=req_type.SerializeToString,
                               response_deserializer=resp_type.FromString)


class Replica:
    """A service endpoint the gateway forwards to. Counters are the gateway's own view."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        creds = tls.UPSTREAM.credentials()  # --upstream-use-ssl (meshserve/server/tls.py)
        self.channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS) if creds is None \
            else grpc.aio.secure_channel(endpoint, creds, options=CHANNEL_OPTIONS)
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
        self.log_settings = _typed(ch, "LogSettings", pb.LogSettingsRequest, pb.LogSettingsResponse)
        # the service's /metrics text over gRPC (bytes in, bytes out): --federate-metrics
        self.scrape = ch.unary_unary(f"/{METRICS_SERVICE}/Scrape")
        self.outstanding = 0
        self.healthy = False
        self.generation = 0  # how many times it joined the pool (set_healthy)
        self.errors = 0
        self.kind: str | None = None  # the service kind it announced (onnx, ...), once it answered an index

    def set_healthy(self, healthy: bool) -> bool:
        """Put the replica in or out of the pool; whether that changed anything. Joining starts
        a new generation: what was begun before (a stream still connecting, perhaps to the
        process that left) no longer speaks for it. Requests from now on get new streams, and a
        failure of an earlier attempt does not eject it (Upstream._failed)."""
        if healthy == self.healthy:
            return False
        self.healthy = healthy
        if healthy:
            self.generation += 1
            self.streams.renew()
        else:
            self.streams.leave()
        return True

    async def index(self, ready_only: bool, timeout: float) -> pb.RepositoryIndexResponse:
        """RepositoryIndex, noting the service kind the replica announces with it."""
        call = self.repository_index(pb.RepositoryIndexRequest(ready=ready_only), timeout=timeout)
        response = await call
        for key, value in await call.trailing_metadata() or ():
            if key == SERVICE_KIND_METADATA and isinstance(value, str):
                self.kind = value
        return response

    def error(self, exc: BaseException) -> InferError:
        """The client's error for a call to this replica that failed with ``exc``."""
        if isinstance(exc, InferError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            return InferError.from_grpc(exc.code(), exc.details(), hop=f"service {self.endpoint}")
        if isinstance(exc, NotSent):
            return InferError.unavailable(str(exc) or f"service {self.endpoint}: stream unavailable")
        return InferError.unavailable(f"service {self.endpoint}: {type(exc).__name__}: {exc}")

    def failure(self, exc: Exception) -> tuple[InferError, bool]:
        """(the client's error, whether to try another replica) for a call that raised one of
        CALL_ERRORS. Another replica is tried only if the request never reached a model: it was
        never written (NotSent), or the channel that carried it (the stream's connection for
        infer, the gRPC channel for control calls) is not connected. A broken stream had the
        request in flight: it may have run, so it is not retried."""
        err = self.error(exc)
        if isinstance(exc, NotSent):
            return err, True
        if err.code is not Code.UNAVAILABLE or isinstance(exc, StreamBroken):
            return err, False
        if isinstance(exc, grpc.aio.AioRpcError):
            return err, self.channel.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY
        return err, not self.streams.connected

    def __repr__(self) -> str:
        return f"Replica({self.endpoint}, healthy={self.healthy}, outstanding={self.outstanding})"

    async def close(self) -> None:
        await self.streams.close()
        await self.channel.close()
