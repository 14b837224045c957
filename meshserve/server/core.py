"""The protocol-free interface every meshserve process implements (gateway and services)."""
from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import InferError
from meshserve.protocol.hop import NO_HOP, Hop
from meshserve.server.access import Grant, Op

SERVER_NAME = "meshserve"  # server metadata's "name" unless --server-name says otherwise


def _package_version() -> str:
    """The installed meshserve distribution's version (pyproject.toml); a source tree run without
    installing it reports "0.0.0+unknown"."""
    try:
        return importlib.metadata.version("meshserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


SERVER_VERSION = _package_version()  # server metadata's "version"


def add_server_name_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--server-name", default=SERVER_NAME, metavar="NAME",
                    help="the name in server metadata (HTTP GET /v2, gRPC ServerMetadata); clients that "
                         "check for Triton's name can be given \"triton\"")


EXTENSIONS = (
    "classification",
    "sequence",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "model_repository",
    "model_repository(unload_dependents)",
    "trace",
    "logging",
    "system_shared_memory",
)


class InferResult:
    """An inference response held as a message, serialized bytes, or both (lazily converted).

    The gateway passes a service's answer on as the bytes it got unless it must change it (a
    merged answer split by rows, the A/B arm parameter, outputs written to shared memory); a
    service builds the message (and may serialize it off the event loop). Each side converts
    only when a front end needs it.
    """

    __slots__ = ("_msg", "_raw")

    def __init__(self, message: pb.ModelInferResponse | None = None, raw: bytes | None = None):
        if message is None and raw is None:
            raise ValueError("InferResult needs a message or raw bytes")
        self._msg = message
        self._raw = raw

    def message(self) -> pb.ModelInferResponse:
        if self._msg is None:
            assert self._raw is not None
            self._msg = pb.ModelInferResponse.FromString(self._raw)
        return self._msg

    @property
    def held_raw(self) -> bytes | None:
        """The serialized answer when it is held as bytes (nothing is serialized here)."""
        return self._raw

    def serialized(self) -> bytes:
        if self._raw is None:
            assert self._msg is not None
            self._raw = self._msg.SerializeToString()
        return self._raw


@dataclass(slots=True)
class RequestContext:
    """Per-request facts the core needs beyond the message itself."""

    protocol: str  # "grpc" | "http"
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names (HTTP headers / gRPC metadata)
    deadline: float | None = None  # absolute time.monotonic() deadline, None = none
    raw: bytes | None = None  # the serialized ModelInferRequest, when it arrived as one
    nbytes: int = 0  # the request's size on the wire when `raw` is None (an HTTP body): admission counts it
    hop: Hop = NO_HOP  # set by the front door (observe.infer) from the request's hop parameters
    peer: str | None = None  # the connection's address, set for repository control (load/unload) only
    # the client's stream (gRPC ModelStreamInfer: one key per call, else None): a gateway sends one
    # stream's streamed requests over one hop stream, so that they reach the service in the order the
    # client sent them, as they reach Triton's scheduler (gateway/upstream/streamed.py)
    stream: str | None = None

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())


StreamAnswer = tuple["InferResult | None", bool]  # (a response or None, final flag)

# Triton's texts for a unary inference call on a decoupled model (its code is UNSUPPORTED, gRPC
# UNIMPLEMENTED / HTTP 501; meshserve answers INVALID_ARGUMENT / 400: the client's call is wrong)
UNARY_DECOUPLED_GRPC = "ModelInfer RPC doesn't support models with decoupled transaction policy"
UNARY_DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"


def unary_decoupled_error(protocol: str) -> InferError:
    """The error of a unary call (gRPC ModelInfer, HTTP infer) on a decoupled model, in Triton's
    words for the client's protocol (``RequestContext.protocol``)."""
    return InferError.invalid(UNARY_DECOUPLED_HTTP if protocol == "http" else UNARY_DECOUPLED_GRPC)


async def single_answer(core: V2Core, request: pb.ModelInferRequest, ctx: RequestContext
                        ) -> AsyncIterator[StreamAnswer]:
    """``V2Core.infer_stream`` of a core whose models are never decoupled: ``infer``'s one answer,
    final."""
    yield await core.infer(request, ctx), True


class V2Core(Protocol):
    """KServe v2 / Triton operations, independent of the wire protocol."""

    def authorize(self, op: Op, model: str, ctx: RequestContext) -> Grant:
        """May this caller do ``op`` (on ``model``)? Raises InferError 401/403, else a Grant whose
        ``filter`` reduces statistics and the index to the caller's models. The front ends call
        it for every operation but infer (which the core admits itself) and open health checks."""
        ...

    def live(self) -> bool: ...

    def ready(self) -> bool: ...

    def server_metadata(self) -> pb.ServerMetadataResponse: ...

    async def model_ready(self, name: str, version: str) -> bool: ...

    async def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse: ...

    async def model_config(self, name: str, version: str) -> pb.ModelConfigResponse: ...

    async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext) -> InferResult: ...

    def infer_stream(self, request: pb.ModelInferRequest, ctx: RequestContext) -> AsyncIterator[StreamAnswer]:
        """Every response of one request, in order; the last item has final=True (its response
        may be None: Triton's empty final flag). For a model that is not decoupled: exactly one
        item, (result, True). Errors raise InferError (before or between responses)."""
        ...

    async def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse: ...

    async def repository_index(self, ready_only: bool) -> pb.RepositoryIndexResponse: ...

    async def load_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                         ctx: RequestContext) -> None: ...

    async def unload_model(self, name: str, parameters: dict[str, pb.ModelRepositoryParameter],
                           ctx: RequestContext) -> None: ...

    async def metrics_text(self) -> tuple[bytes, str]:
        """Prometheus exposition (body, content type), rendered at scrape time."""
        ...
