"""Who may call what: ONE table of every HTTP route and gRPC method with its access rule.

Both front ends consult it; the core decides (``V2Core.authorize``): a service has no tenants
and allows everything (an internal hop), a gateway with ``--tenants`` checks the caller's key.
Infer is not checked here: ``Rule.INFER`` requests go through the gateway's admission (key,
allowed models, quotas) on the infer path itself, so a request pays for nothing else.

Rules:
    OPEN    no key (liveness/readiness, and /metrics unless the gateway runs with --metrics-auth)
    KEY     any valid key (or anonymous, when the tenants file allows anonymous callers)
    MODEL   a key whose tenant may use the model named in the request (403 otherwise)
    LISTED  any valid key; the answer is filtered to the models the tenant may use
    ADMIN   an admin tenant's key (403 for other tenants and anonymous callers)
    INFER   admission on the infer path (key, allowed models, quotas)
No key where one is needed, or an unknown key: 401 / UNAUTHENTICATED.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import health_pb2


class Rule(enum.Enum):
    OPEN = "open"
    KEY = "any valid key"
    OWN = "any valid key; the tenant's own shared-memory regions"
    MODEL = "may use the model"
    LISTED = "any valid key; filtered to the tenant's models"
    ADMIN = "admin"
    INFER = "infer admission (key, allowed model, quotas)"


class Op(enum.Enum):
    """Every operation a front end serves, with its rule."""

    def __init__(self, label: str, rule: Rule):
        self.label = label
        self.rule = rule

    HEALTH = ("health (live/ready)", Rule.OPEN)
    METRICS = ("metrics", Rule.OPEN)  # the gateway's --metrics-auth makes it ADMIN
    SERVER_METADATA = ("server metadata", Rule.KEY)
    MODEL_READY = ("model ready", Rule.MODEL)
    MODEL_METADATA = ("model metadata", Rule.MODEL)
    MODEL_CONFIG = ("model config", Rule.MODEL)
    MODEL_STATISTICS = ("model statistics", Rule.MODEL)
    ALL_STATISTICS = ("statistics of all models", Rule.LISTED)
    REPOSITORY_INDEX = ("repository index", Rule.LISTED)
    REPOSITORY_LOAD = ("model load", Rule.ADMIN)
    REPOSITORY_UNLOAD = ("model unload", Rule.ADMIN)
    INFER = ("infer", Rule.INFER)
    # the generate extension: the model must be the tenant's (its metadata maps the JSON to
    # inputs), then the inference itself goes through infer admission (quotas) like any other
    GENERATE = ("generate", Rule.MODEL)
    TRACE_GET = ("read global trace settings", Rule.KEY)
    TRACE_UPDATE = ("update global trace settings", Rule.ADMIN)
    MODEL_TRACE_GET = ("read a model's trace settings", Rule.MODEL)
    MODEL_TRACE_UPDATE = ("update a model's trace settings", Rule.ADMIN)
    LOG_GET = ("read log settings", Rule.KEY)
    LOG_UPDATE = ("update log settings", Rule.ADMIN)
    SHM_STATUS = ("shared-memory region status", Rule.OWN)
    SHM_REGISTER = ("register a shared-memory region", Rule.OWN)
    SHM_UNREGISTER = ("unregister shared-memory regions", Rule.OWN)
    PLACEMENT = ("model placement (the gateway's model mesh)", Rule.ADMIN)  # names every model and replica


# ---- HTTP: (method, path template, op, handler) — the table the HTTP front end dispatches by
# (meshserve/server/http_frontend.py:HttpFrontend, through meshserve/server/http1/routing.py:Router;
# the handler is the name of the HttpFrontend method that answers). {m} a model name, {v} a
# version, {r} a repository name, {n} a shared-memory region name; [...] may be left out.
# A new route is one row here plus its handler.
HTTP_ROUTES: tuple[tuple[str, str, Op, str], ...] = (
    ("GET", "/v2/health/live", Op.HEALTH, "live"),
    ("GET", "/v2/health/ready", Op.HEALTH, "ready"),
    ("GET", "/metrics", Op.METRICS, "metrics"),
    ("GET", "/v2", Op.SERVER_METADATA, "server_metadata"),
    ("GET", "/v2/models/{m}[/versions/{v}]", Op.MODEL_METADATA, "model_metadata"),
    ("GET", "/v2/models/{m}[/versions/{v}]/ready", Op.MODEL_READY, "model_ready"),
    ("GET", "/v2/models/{m}[/versions/{v}]/config", Op.MODEL_CONFIG, "model_config"),
    ("GET", "/v2/models/{m}[/versions/{v}]/stats", Op.MODEL_STATISTICS, "model_statistics"),
    ("GET", "/v2/models/stats", Op.ALL_STATISTICS, "all_statistics"),
    ("POST", "/v2/models/{m}[/versions/{v}]/infer", Op.INFER, "infer"),
    ("POST", "/v2/models/{m}[/versions/{v}]/generate", Op.GENERATE, "generate"),
    ("POST", "/v2/models/{m}[/versions/{v}]/generate_stream", Op.GENERATE, "generate_stream"),
    ("GET", "/v2/trace/setting", Op.TRACE_GET, "trace_setting"),
    ("POST", "/v2/trace/setting", Op.TRACE_UPDATE, "trace_setting"),
    ("GET", "/v2/models/{m}/trace/setting", Op.MODEL_TRACE_GET, "trace_setting"),
    ("POST", "/v2/models/{m}/trace/setting", Op.MODEL_TRACE_UPDATE, "trace_setting"),
    ("GET", "/v2/logging", Op.LOG_GET, "log_setting"),
    ("POST", "/v2/logging", Op.LOG_UPDATE, "log_setting"),
    ("POST", "/v2/repository[/{r}]/index", Op.REPOSITORY_INDEX, "repository_index"),
    ("POST", "/v2/repository[/{r}]/models/{m}/load", Op.REPOSITORY_LOAD, "load"),
    ("POST", "/v2/repository[/{r}]/models/{m}/unload", Op.REPOSITORY_UNLOAD, "unload"),
    ("GET", "/v2/systemsharedmemory[/region/{n}]/status", Op.SHM_STATUS, "system_shm_status"),
    ("POST", "/v2/systemsharedmemory/region/{n}/register", Op.SHM_REGISTER, "system_shm_register"),
    ("POST", "/v2/systemsharedmemory[/region/{n}]/unregister", Op.SHM_UNREGISTER, "system_shm_unregister"),
    ("GET", "/v2/cudasharedmemory[/region/{n}]/status", Op.SHM_STATUS, "cuda_shm_status"),
    ("POST", "/v2/cudasharedmemory/region/{n}/register", Op.SHM_REGISTER, "cuda_shm_register"),
    ("POST", "/v2/cudasharedmemory[/region/{n}]/unregister", Op.SHM_UNREGISTER, "cuda_shm_unregister"),
    ("GET", "/v2/placement", Op.PLACEMENT, "placement"),
)


def _by_settings(read: Op, update: Op) -> Callable[[Any], Op]:
    return lambda request: update if request.settings else read


def _trace(request: pb.TraceSettingRequest) -> Op:
    if request.model_name:
        return Op.MODEL_TRACE_UPDATE if request.settings else Op.MODEL_TRACE_GET
    return Op.TRACE_UPDATE if request.settings else Op.TRACE_GET


# ---- gRPC: every method of the three services, one row each ----
@dataclass(frozen=True, slots=True)
class GrpcMethod:
    """One gRPC method: its rule (an op, or a function of the request for methods that read and
    write), the message type the server parses its request into (None: its handler takes the
    raw bytes and answers bytes), and its call shape. Its handler is the servicer's method of the
    same name (grpc_frontend.InferenceServicer, health.HealthServicer, grpc_frontend.MetricsServicer),
    registered from these rows by grpc_frontend.register."""

    op: Op | Callable[[Any], Op]
    request: Any = None
    request_streaming: bool = False
    response_streaming: bool = False

    def rule_of(self, request: Any) -> Op:
        op = self.op
        return op if isinstance(op, Op) else op(request)

    def resolve(self, request: Any) -> tuple[Op, str]:
        """(op, the model it names or "") of one call with this request."""
        op = self.rule_of(request)
        model = getattr(request, "model_name", "") or getattr(request, "name", "") \
            if op.rule is Rule.MODEL else ""
        return op, model


GRPC_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
GRPC_METHODS: dict[str, GrpcMethod] = {
    # tritonclient's is_server_live / is_server_ready: liveness probes
    "ServerLive": GrpcMethod(Op.HEALTH, pb.ServerLiveRequest),
    "ServerReady": GrpcMethod(Op.HEALTH, pb.ServerReadyRequest),
    "ServerMetadata": GrpcMethod(Op.SERVER_METADATA, pb.ServerMetadataRequest),
    "ModelReady": GrpcMethod(Op.MODEL_READY, pb.ModelReadyRequest),
    "ModelMetadata": GrpcMethod(Op.MODEL_METADATA, pb.ModelMetadataRequest),
    "ModelConfig": GrpcMethod(Op.MODEL_CONFIG, pb.ModelConfigRequest),
    "ModelStatistics": GrpcMethod(lambda request: Op.MODEL_STATISTICS if request.name else Op.ALL_STATISTICS,
                                  pb.ModelStatisticsRequest),
    "RepositoryIndex": GrpcMethod(Op.REPOSITORY_INDEX, pb.RepositoryIndexRequest),
    "RepositoryModelLoad": GrpcMethod(Op.REPOSITORY_LOAD, pb.RepositoryModelLoadRequest),
    "RepositoryModelUnload": GrpcMethod(Op.REPOSITORY_UNLOAD, pb.RepositoryModelUnloadRequest),
    # raw bytes: parsed by the handler, which keeps them for the gateway to forward (RequestContext.raw)
    "ModelInfer": GrpcMethod(Op.INFER),
    "ModelStreamInfer": GrpcMethod(Op.INFER, None, request_streaming=True, response_streaming=True),
    "TraceSetting": GrpcMethod(_trace, pb.TraceSettingRequest),
    "LogSettings": GrpcMethod(_by_settings(Op.LOG_GET, Op.LOG_UPDATE), pb.LogSettingsRequest),
    "SystemSharedMemoryStatus": GrpcMethod(Op.SHM_STATUS, pb.SystemSharedMemoryStatusRequest),
    "SystemSharedMemoryRegister": GrpcMethod(Op.SHM_REGISTER, pb.SystemSharedMemoryRegisterRequest),
    "SystemSharedMemoryUnregister": GrpcMethod(Op.SHM_UNREGISTER, pb.SystemSharedMemoryUnregisterRequest),
    "CudaSharedMemoryStatus": GrpcMethod(Op.SHM_STATUS, pb.CudaSharedMemoryStatusRequest),
    "CudaSharedMemoryRegister": GrpcMethod(Op.SHM_REGISTER, pb.CudaSharedMemoryRegisterRequest),
    "CudaSharedMemoryUnregister": GrpcMethod(Op.SHM_UNREGISTER, pb.CudaSharedMemoryUnregisterRequest),
}
HEALTH_METHODS: dict[str, GrpcMethod] = {
    "Check": GrpcMethod(Op.HEALTH, health_pb2.HealthCheckRequest),
    "Watch": GrpcMethod(Op.HEALTH, health_pb2.HealthCheckRequest, response_streaming=True),
}
# meshserve's own: a process's /metrics text over gRPC (empty request, the exposition as bytes);
# a gateway with --federate-metrics reads its services' with it. Its rule is checked by its handler
# (a gateway's --metrics-auth makes it ADMIN).
METRICS_SERVICE = "meshserve.Metrics"
METRICS_METHODS: dict[str, GrpcMethod] = {"Scrape": GrpcMethod(Op.METRICS)}


@dataclass(frozen=True, slots=True)
class Grant:
    """What an authorized caller may see: ``visible`` None = every model; ``tenant``: whose
    shared-memory regions the call acts on ("" without tenants, and for anonymous callers)."""

    visible: Callable[[str], bool] | None = None
    tenant: str = ""

    def filter(self, response: Any) -> Any:
        """Statistics and the repository index reduced to the caller's models (LISTED ops)."""
        if self.visible is None:
            return response
        if isinstance(response, pb.ModelStatisticsResponse):
            return pb.ModelStatisticsResponse(model_stats=[s for s in response.model_stats if self.visible(s.name)])
        if isinstance(response, pb.RepositoryIndexResponse):
            return pb.RepositoryIndexResponse(models=[m for m in response.models if self.visible(m.name)])
        return response


ALL = Grant()
