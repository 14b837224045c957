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


# ---- HTTP: (method, path) → op; {m} a model name, {v} a version, {r} a repository name,
# {n} a shared-memory region name ----
HTTP_ROUTES: tuple[tuple[str, str, Op], ...] = (
    ("GET", "/v2/health/live", Op.HEALTH),
    ("GET", "/v2/health/ready", Op.HEALTH),
    ("GET", "/metrics", Op.METRICS),
    ("GET", "/v2", Op.SERVER_METADATA),
    ("GET", "/v2/models/{m}[/versions/{v}]", Op.MODEL_METADATA),
    ("GET", "/v2/models/{m}[/versions/{v}]/ready", Op.MODEL_READY),
    ("GET", "/v2/models/{m}[/versions/{v}]/config", Op.MODEL_CONFIG),
    ("GET", "/v2/models/{m}[/versions/{v}]/stats", Op.MODEL_STATISTICS),
    ("GET", "/v2/models/stats", Op.ALL_STATISTICS),
    ("POST", "/v2/models/{m}[/versions/{v}]/infer", Op.INFER),
    ("POST", "/v2/models/{m}[/versions/{v}]/generate", Op.GENERATE),
    ("POST", "/v2/models/{m}[/versions/{v}]/generate_stream", Op.GENERATE),
    ("GET", "/v2/trace/setting", Op.TRACE_GET),
    ("POST", "/v2/trace/setting", Op.TRACE_UPDATE),
    ("GET", "/v2/models/{m}/trace/setting", Op.MODEL_TRACE_GET),
    ("POST", "/v2/models/{m}/trace/setting", Op.MODEL_TRACE_UPDATE),
    ("GET", "/v2/logging", Op.LOG_GET),
    ("POST", "/v2/logging", Op.LOG_UPDATE),
    ("POST", "/v2/repository[/{r}]/index", Op.REPOSITORY_INDEX),
    ("POST", "/v2/repository[/{r}]/models/{m}/load", Op.REPOSITORY_LOAD),
    ("POST", "/v2/repository[/{r}]/models/{m}/unload", Op.REPOSITORY_UNLOAD),
    ("GET", "/v2/systemsharedmemory[/region/{n}]/status", Op.SHM_STATUS),
    ("POST", "/v2/systemsharedmemory/region/{n}/register", Op.SHM_REGISTER),
    ("POST", "/v2/systemsharedmemory[/region/{n}]/unregister", Op.SHM_UNREGISTER),
    ("GET", "/v2/cudasharedmemory[/region/{n}]/status", Op.SHM_STATUS),
    ("POST", "/v2/cudasharedmemory/region/{n}/register", Op.SHM_REGISTER),
    ("POST", "/v2/cudasharedmemory[/region/{n}]/unregister", Op.SHM_UNREGISTER),
    ("GET", "/v2/placement", Op.PLACEMENT),
)


def _by_settings(read: Op, update: Op) -> Callable[[Any], Op]:
    return lambda request: update if request.settings else read


def _trace(request: pb.TraceSettingRequest) -> Op:
    if request.model_name:
        return Op.MODEL_TRACE_UPDATE if request.settings else Op.MODEL_TRACE_GET
    return Op.TRACE_UPDATE if request.settings else Op.TRACE_GET


# ---- gRPC: method → op, or a function of the request for methods that read and write ----
GRPC_SERVICE = "inference.GRPCInferenceService"
HEALTH_SERVICE = "grpc.health.v1.Health"
GRPC_METHODS: dict[str, Op | Callable[[Any], Op]] = {
    "ServerLive": Op.HEALTH,  # tritonclient's is_server_live / is_server_ready: liveness probes
    "ServerReady": Op.HEALTH,
    "ServerMetadata": Op.SERVER_METADATA,
    "ModelReady": Op.MODEL_READY,
    "ModelMetadata": Op.MODEL_METADATA,
    "ModelConfig": Op.MODEL_CONFIG,
    "ModelStatistics": lambda request: Op.MODEL_STATISTICS if request.name else Op.ALL_STATISTICS,
    "RepositoryIndex": Op.REPOSITORY_INDEX,
    "RepositoryModelLoad": Op.REPOSITORY_LOAD,
    "RepositoryModelUnload": Op.REPOSITORY_UNLOAD,
    "ModelInfer": Op.INFER,
    "ModelStreamInfer": Op.INFER,
    "TraceSetting": _trace,
    "LogSettings": _by_settings(Op.LOG_GET, Op.LOG_UPDATE),
    "SystemSharedMemoryStatus": Op.SHM_STATUS,
    "SystemSharedMemoryRegister": Op.SHM_REGISTER,
    "SystemSharedMemoryUnregister": Op.SHM_UNREGISTER,
    "CudaSharedMemoryStatus": Op.SHM_STATUS,
    "CudaSharedMemoryRegister": Op.SHM_REGISTER,
    "CudaSharedMemoryUnregister": Op.SHM_UNREGISTER,
}
HEALTH_METHODS: dict[str, Op] = {"Check": Op.HEALTH, "Watch": Op.HEALTH}
# meshserve's own: a process's /metrics text over gRPC (empty request, the exposition as bytes);
# a gateway with --federate-metrics reads its services' with it
METRICS_SERVICE = "meshserve.Metrics"
METRICS_METHODS: dict[str, Op] = {"Scrape": Op.METRICS}


def grpc_op(method: str, request: Any) -> tuple[Op, str]:
    """(op, the model it names or "") of one GRPCInferenceService call."""
    entry = GRPC_METHODS[method]
    op = entry if isinstance(entry, Op) else entry(request)
    model = getattr(request, "model_name", "") or getattr(request, "name", "") \
        if op.rule is Rule.MODEL else ""
    return op, model


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
