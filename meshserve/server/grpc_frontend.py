"""gRPC front end: inference.GRPCInferenceService over any V2Core.

ModelInfer is registered with raw-bytes (de)serializers: the request is parsed once here
and its original bytes travel on in RequestContext.raw, so the gateway can forward them
without re-serializing; responses go out as whatever bytes the core produced.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop, wire
from meshserve.protocol.errors import InferError, internal_error
from meshserve.protocol.wire import MAX_MESSAGE_BYTES
from meshserve.server import access, observe, shm, tls
from meshserve.server.core import RequestContext, V2Core
from meshserve.server.h2 import H2GrpcServer
from meshserve.server.health import HealthState, health_handler
from meshserve.server.limits import STREAMS, ServerLimits
from meshserve.telemetry.tracing import TRACEPARENT

log = logging.getLogger("meshserve.grpc")

SERVICE = access.GRPC_SERVICE
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),
]


STREAM_INFLIGHT = 1024  # requests of one ModelStreamInfer call in progress or awaiting their write
STREAM_BACKLOG = 256  # responses of decoupled models answered on one call but not yet written
_STREAM = hop.STREAM
_CANCEL = hop.CANCEL
_FINAL = wire.FINAL_RESPONSE_PARAMETER
_FINAL_TRUE = wire.bool_parameter_entry(_FINAL, True)
_FINAL_FALSE = wire.bool_parameter_entry(_FINAL, False)


def _flag(request: pb.ModelInferRequest, key: str) -> bool:
    """A boolean request parameter (false when absent; a bool, or a nonzero int, is true)."""
    params = request.parameters
    if not params or key not in params:
        return False
    p = params[key]
    return p.bool_param or bool(p.int64_param) or p.string_param.lower() == "true"


def _forget(tasks: dict[str, asyncio.Task[None]], key: str, task: asyncio.Task[None]) -> None:
    if tasks.get(key) is task:
        del tasks[key]


def _empty_final(request: pb.ModelInferRequest, on_hop: bool) -> bytes:
    """Triton's empty final response: the request's id, model name and version, and only the
    triton_final_response flag (on a gateway's hop also hop.EMPTY_FINAL)."""
    response = pb.ModelInferResponse(id=request.id, model_name=request.model_name,
                                     model_version=request.model_version)
    response.parameters[_FINAL].bool_param = True
    if on_hop:
        hop.set_empty_final(response)
    return response.SerializeToString()


def _context(context: grpc.aio.ServicerContext, raw: bytes | None = None) -> RequestContext:
    remaining = context.time_remaining()
    md = context.invocation_metadata() or ()
    # the one place a call's metadata is read: the hop marker believed only on an authenticated
    # call (meshserve/protocol/hop.py:vet, once per call: per stream); a gateway with tenants and
    # mutual TLS adds the client certificate's names (meshserve/server/tls.py:client_cert)
    headers = hop.vet({k: v for k, v in md if isinstance(v, str)})
    if tls.cert_names_grpc:
        tls.client_cert(headers, tls.grpc_transport(context))
    return RequestContext(
        protocol="grpc",
        headers=headers,
        deadline=None if remaining is None else time.monotonic() + remaining,
        raw=raw,
    )


def _control_context(context: grpc.aio.ServicerContext) -> RequestContext:
    """A repository-control call's context: also the peer's address (loopback-only control)."""
    ctx = _context(context)
    ctx.peer = context.peer()
    return ctx
def _key_check(core: V2Core) -> Callable[[str, tuple[tuple[str, Any], ...]], tuple[int, str] | None]:
    """The HTTP/2 server's check at a call's headers: a unary method whose rule is not open needs
    a valid key (UNAUTHENTICATED, when there are tenants) before its message is received, as the
    HTTP front end checks before reading a body; the method's own rule follows as before."""
    open_paths = {f"/{access.GRPC_SERVICE}/{name}" for name, op in access.GRPC_METHODS.items()
                  if isinstance(op, access.Op) and op.rule is access.Rule.OPEN}
    open_paths |= {f"/{access.HEALTH_SERVICE}/{name}" for name in access.HEALTH_METHODS}
    open_paths |= {f"/{access.METRICS_SERVICE}/{name}" for name in access.METRICS_METHODS}  # (its own rule)
    # ModelStreamInfer answers every request's error in band (as Triton does), a missing key too;
    # its messages are taken one at a time (the stream's own window), so it is not refused here
    open_paths.add(f"/{access.GRPC_SERVICE}/ModelStreamInfer")

    # metadata (the server's parsed tuple: the same object for a repeated header block) that passed
    # lately: only an early filter (the method's own check follows), so a key revoked since is
    # still refused, by that check; a hit costs one hash of the tuple, nothing allocated
    passed: set[tuple[tuple[str, Any], ...]] = set()

    def check(path: str, metadata: tuple[tuple[str, Any], ...]) -> tuple[int, str] | None:
        if metadata in passed or path in open_paths or tls.cert_names_grpc:  # (mutual TLS: the method's check)
            return None
        try:  # (the rule every non-open op starts with: any valid key)
            core.authorize(access.Op.SERVER_METADATA, "", RequestContext(protocol="grpc", headers=dict(metadata)))
        except InferError as exc:
            return exc.grpc_status.value[0], exc.message
        if len(passed) >= 1024:
            passed.clear()
        passed.add(metadata)
        return None

    return check


def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Set the call's error status. The handler then returns normally: grpc.aio drops the
    response of a call whose code is not OK, and this avoids context.abort()'s exception
    machinery, which matters when rejections come by the thousand (quota floods)."""
    if isinstance(exc, InferError):
        context.set_code(exc.grpc_status)
        context.set_details(exc.message)
        if exc.retry_after_ms is not None:  # HTTP's Retry-After, as gRPC's server pushback
            context.set_trailing_metadata(((wire.RETRY_PUSHBACK_METADATA, str(exc.retry_after_ms)),))
        return
    log.exception("internal error while serving a gRPC call")
    context.set_code(grpc.StatusCode.INTERNAL)
    context.set_details(internal_error(exc).message)


def _authorize(core: V2Core, method: str, request: Any, context: grpc.aio.ServicerContext) -> access.Grant:
    """The core's verdict on this call (meshserve.server.access's table); open calls cost nothing."""
    op, model = access.grpc_op(method, request)
    if op.rule is access.Rule.OPEN:
        return access.ALL
    return core.authorize(op, model, _context(context))


def _unary(core: V2Core, method: str, fn: Callable[..., Awaitable[Any]], request_type: Any,
           with_grant: bool = False) -> grpc.RpcMethodHandler:
    """A unary method: the access table's verdict, then ``fn(request, context)`` (``fn(request,
    context, grant)`` with ``with_grant``), its answer filtered by the grant."""
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            grant = _authorize(core, method, request, context)
            if with_grant:
                return await fn(request, context, grant)
            return grant.filter(await fn(request, context))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # mapped to a status, never a crash
            _fail(context, exc)
            return None

    return grpc.unary_unary_rpc_method_handler(
        handler, request_deserializer=request_type.FromString,
        response_serializer=lambda m: m.SerializeToString())


def inference_handler(core: V2Core) -> grpc.GenericRpcHandler:
    """The GRPCInferenceService method table for one core, as a generic handler."""
    return grpc.method_handlers_generic_handler(SERVICE, inference_methods(core))


def inference_methods(core: V2Core) -> dict[str, grpc.RpcMethodHandler]:
    """The GRPCInferenceService method table for one core."""

    async def server_live(req: pb.ServerLiveRequest, ctx: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=core.live())

    async def server_ready(req: pb.ServerReadyRequest, ctx: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=core.ready())

    async def model_ready(req: pb.ModelReadyRequest, ctx: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await core.model_ready(req.name, req.version))

    async def server_metadata(req: pb.ServerMetadataRequest, ctx: grpc.aio.ServicerContext
                              ) -> pb.ServerMetadataResponse:
        return core.server_metadata()

    async def model_metadata(req: pb.ModelMetadataRequest, ctx: grpc.aio.ServicerContext
                             ) -> pb.ModelMetadataResponse:
        return await core.model_metadata(req.name, req.version)

    async def model_config(req: pb.ModelConfigRequest, ctx: grpc.aio.ServicerContext) -> pb.ModelConfigResponse:
        return await core.model_config(req.name, req.version)

    async def model_statistics(req: pb.ModelStatisticsRequest, ctx: grpc.aio.ServicerContext
                               ) -> pb.ModelStatisticsResponse:
        return await core.statistics(req.name, req.version)

    async def trace_setting(req: pb.TraceSettingRequest, ctx: grpc.aio.ServicerContext) -> pb.TraceSettingResponse:
        # no settings: a read (tritonclient's get_trace_settings); an empty value list clears a model's key
        changes = {key: list(v.value) or None for key, v in req.settings.items()}
        settings = await observe.trace_setting(core, req.model_name, changes)
        response = pb.TraceSettingResponse()
        for key, values in settings.items():
            response.settings[key].value.extend(values)
        return response

    async def log_settings(req: pb.LogSettingsRequest, ctx: grpc.aio.ServicerContext) -> pb.LogSettingsResponse:
        changes = {}  # no settings: a read (tritonclient's get_log_settings)
        for key, v in req.settings.items():
            kind = v.WhichOneof("parameter_choice")
            if kind is None:
                raise InferError.invalid(f"log setting '{key}' has no value")
            changes[key] = getattr(v, kind)
        response = pb.LogSettingsResponse()
        for key, value in observe.log_setting(changes).items():
            entry = response.settings[key]
            if isinstance(value, bool):
                entry.bool_param = value
            elif isinstance(value, int):
                entry.uint32_param = value
            else:
                entry.string_param = value
        return response

    kind = getattr(core, "kind", None)  # a service announces its kind to gateways (wire.SERVICE_KIND_METADATA)
    kind_metadata = ((wire.SERVICE_KIND_METADATA, kind),) if isinstance(kind, str) else ()

    async def repository_index(req: pb.RepositoryIndexRequest, ctx: grpc.aio.ServicerContext
                               ) -> pb.RepositoryIndexResponse:
        if kind_metadata:
            ctx.set_trailing_metadata(kind_metadata)
        return await core.repository_index(req.ready)

    async def model_load(req: pb.RepositoryModelLoadRequest, ctx: grpc.aio.ServicerContext
                         ) -> pb.RepositoryModelLoadResponse:
        await core.load_model(req.model_name, dict(req.parameters), _control_context(ctx))
        return pb.RepositoryModelLoadResponse()

    async def model_unload(req: pb.RepositoryModelUnloadRequest, ctx: grpc.aio.ServicerContext
                           ) -> pb.RepositoryModelUnloadResponse:
        await core.unload_model(req.model_name, dict(req.parameters), _control_context(ctx))
        return pb.RepositoryModelUnloadResponse()

    async def model_infer(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            try:
                request = pb.ModelInferRequest.FromString(raw)
            except Exception as exc:
                raise InferError.invalid(f"malformed ModelInferRequest: {exc}") from None
            infer = shm.infer if shm.uses_shared_memory(request, raw) else observe.infer
            result, span = await infer(core, request, _context(context, raw))
            if span is not None:
                context.set_trailing_metadata(((TRACEPARENT, span.traceparent()),))
            return result.serialized()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            _fail(context, exc)
            return b""  # discarded: the status is not OK

    async def model_stream_infer(requests: AsyncIterator[bytes],
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        # Requests on one stream run concurrently; responses are written as they complete
        # (each carries its request id). Per-request errors travel in band, with their status
        # code in an infer_response parameter so a gateway can map them back to a status.
        # At most STREAM_INFLIGHT requests of a stream are in progress or answered but not yet
        # written: beyond that the next message is not read, so HTTP/2 flow control stops a
        # client that sends faster than the models answer (or than it reads its answers).
        #
        # A client's requests (and a gateway's marked hop.STREAM) go through
        # core.infer_stream: every response of a decoupled model, each with Triton's
        # triton_final_response flag, and an empty final response where the client asked for it
        # (a gateway always gets it: it ends the request on the hop). At most STREAM_BACKLOG of
        # those responses wait to be written; beyond that the models' answers wait. A gateway
        # cancels a request of its hop (streamed or not) with hop.cancel: {id, hop.CANCEL}.
        #
        # On a client's call (not a gateway's hop), the answers of requests for models that are
        # not decoupled leave in request order, as Triton's do: each such request holds a place
        # in `order` (its answer waits there for the earlier ones'); a decoupled model's answers
        # are written as they come. A gateway's hop keeps completion order (it matches by id).
        out: asyncio.Queue[bytes | tuple[bytes, bool] | None] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()  # a client's requests, a gateway's streamed ones
        # a gateway's requests in progress by id (to cancel; its unstreamed ones are only here:
        # each takes itself out as its answer is queued, so nothing else tracks it)
        by_id: dict[str, asyncio.Task[None]] = {}
        base = _context(context)
        slots = asyncio.Semaphore(STREAM_INFLIGHT)
        backlog = asyncio.Semaphore(STREAM_BACKLOG)
        queued = [0]  # bytes of streamed answers queued, not yet written: at most --max-stream-backlog-bytes
        room = asyncio.Event()  # (beyond one answer); set when the writer takes one
        failed: list[str] = []
        order: collections.deque[list[Any]] = collections.deque()  # [answer bytes or None, ready]

        def in_order(place: list[Any], item: bytes | None) -> None:
            """A request's one answer (None: nothing to write) takes its place; what is ready at
            the head of the order leaves."""
            place[0], place[1] = item, True
            while order and order[0][1]:
                held = order.popleft()[0]
                if held is not None:
                    out.put_nowait(held)

        async def one(request: pb.ModelInferRequest, raw: bytes, place: list[Any] | None = None,
                      hop_id: str = "") -> None:
            streamed = False
            owns_slot = True  # until an item that ends the request is queued (the writer gives it back)
            try:
                ctx = RequestContext(protocol="grpc", headers=base.headers, deadline=base.deadline, raw=raw)
                if from_gateway and not (request.parameters and _STREAM in request.parameters):
                    # the gateway's hop, one answer per request (its requests name no shared-memory region)
                    try:
                        result, _ = await observe.infer(core, request, ctx)
                    finally:
                        by_id.pop(hop_id, None)
                    owns_slot = False
                    out.put_nowait(wire.stream_response(result.serialized()))
                    return
                if not from_gateway and shm.uses_shared_memory(request, raw):
                    result, _ = await shm.infer(core, request, ctx)
                    owns_slot = False
                    reply = wire.stream_response(result.serialized() + _FINAL_TRUE)
                    if place is not None:
                        in_order(place, reply)
                    else:
                        out.put_nowait(reply)
                    return
                streamed = True
                empty_final = from_gateway or _flag(request, wire.EMPTY_FINAL_REQUEST_PARAMETER)
                # appended to each response: its final flag and its request's id (as Triton's have)
                rid = wire.length_delimited(wire.INFER_REQUEST_ID_TAG, request.id.encode()) if request.id else b""
                async for answer, final in observe.infer_stream(core, request, ctx):
                    if answer is not None:
                        body = b"".join((answer.serialized(), _FINAL_TRUE if final else _FINAL_FALSE, rid))
                    elif final and empty_final:
                        body = _empty_final(request, from_gateway)
                    else:
                        if final and owns_slot:
                            owns_slot = False
                            slots.release()
                        continue
                    if place is not None and not place[1]:
                        if final:  # the one answer of a model that is not decoupled: in request order
                            owns_slot = False
                            in_order(place, wire.stream_response(body))
                            continue
                        in_order(place, None)  # a decoupled model after all: its answers are not held
                    await backlog.acquire()
                    msg = wire.stream_response(body)
                    try:
                        while queued[0] and queued[0] + len(msg) > STREAMS.backlog_bytes:
                            room.clear()
                            await room.wait()
                    except asyncio.CancelledError:
                        backlog.release()
                        raise
                    queued[0] += len(msg)
                    if final:
                        owns_slot = False
                    out.put_nowait((msg, final))
                if owns_slot:  # (a core that ended without a final answer)
                    owns_slot = False
                    slots.release()
            except asyncio.CancelledError:
                if owns_slot:
                    slots.release()
                raise
            except Exception as exc:
                if not isinstance(exc, InferError):
                    log.exception("internal error in a streamed request")
                    exc = internal_error(exc)
                err = pb.ModelStreamInferResponse(
                    error_message=exc.message,
                    infer_response=pb.ModelInferResponse(
                        id=request.id, model_name=request.model_name, model_version=request.model_version))
                hop.set_error(err.infer_response, exc.code, exc.retry_after_ms if from_gateway else None)
                if streamed:
                    err.infer_response.parameters[_FINAL].bool_param = True
                if not owns_slot:  # (its final answer is queued: nothing may follow it)
                    log.warning("error after the final answer of request %r: %s", request.id, exc.message)
                elif place is not None and not place[1]:
                    in_order(place, err.SerializeToString())
                else:
                    out.put_nowait(err.SerializeToString())
            finally:
                if place is not None and not place[1]:  # (no answer to write: its place is freed)
                    in_order(place, None)

        from_gateway = hop.from_gateway(base.headers)  # (this call is a gateway's hop: never in a gateway)
        # whether a client's request is for a decoupled model (its answers are not held in order);
        # a core that cannot tell serves none
        decoupled: Callable[[str, str], bool] | None = None if from_gateway else getattr(core, "is_decoupled", None)
        # once per call: asyncio.get_running_loop() (and ensure_future) make a getpid system call
        # each time on Python 3.11
        loop = asyncio.get_running_loop()

        async def reader() -> None:
            try:
                async for raw in requests:  # bytes: parsed here, so each request keeps its own (RequestContext.raw)
                    await slots.acquire()  # given back when its answer is written
                    try:
                        request = pb.ModelInferRequest.FromString(raw)
                    except Exception as exc:  # what a failed deserializer reports on a unary call
                        failed.append(f"Exception deserializing request: {exc}")
                        break
                    params = request.parameters
                    if from_gateway and params and _CANCEL in params:  # the gateway's client went away
                        slots.release()
                        cancelled = by_id.pop(request.id, None)
                        if cancelled is not None:
                            cancelled.cancel()
                        continue
                    if from_gateway:
                        hop_id = request.id
                        task = loop.create_task(one(request, raw, None, hop_id))
                        repeated = by_id.get(hop_id)
                        by_id[hop_id] = task
                        if repeated is not None:  # a repeated id (not the gateway's way): still awaited
                            pending.add(repeated)
                            repeated.add_done_callback(pending.discard)
                        if not (params and _STREAM in params):
                            continue  # (it takes itself out of by_id as its answer is queued)
                        task.add_done_callback(functools.partial(_forget, by_id, hop_id))
                    else:
                        place = None
                        try:
                            held = decoupled is None or not decoupled(request.model_name, request.model_version)
                        except Exception:
                            held = True  # (an unknown model's error comes in order too, as Triton's)
                        if held:
                            place = [None, False]
                            order.append(place)
                        task = loop.create_task(one(request, raw, place))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                if pending or by_id:
                    await asyncio.gather(*pending, *by_id.values(), return_exceptions=True)
            finally:
                out.put_nowait(None)

        read_task = loop.create_task(reader())
        try:
            while True:
                item = await out.get()
                if item is None:
                    break
                if item.__class__ is tuple:  # a streamed answer: (bytes, final)
                    yield item[0]  # type: ignore[index]
                    backlog.release()
                    queued[0] -= len(item[0])  # type: ignore[index]
                    room.set()
                    if item[1]:  # type: ignore[index]
                        slots.release()
                    continue
                yield item  # type: ignore[misc]
                slots.release()
            if failed:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, failed[0])
        finally:
            read_task.cancel()
            for t in [*pending, *by_id.values()]:
                t.cancel()

    # the shared-memory extensions (meshserve.server.shm): the caller's tenant's regions only
    def shm_status(kind: str, render: Callable[[list[shm.Region]], Any]) -> Callable[..., Awaitable[Any]]:
        async def status(req: Any, ctx: grpc.aio.ServicerContext, grant: access.Grant) -> Any:
            return render(shm.registry.status(grant.tenant, req.name, kind))
        return status

    def shm_unregister(kind: str, response_type: Any) -> Callable[..., Awaitable[Any]]:
        async def unregister(req: Any, ctx: grpc.aio.ServicerContext, grant: access.Grant) -> Any:
            shm.registry.unregister(grant.tenant, req.name, kind)
            return response_type()
        return unregister

    async def system_shm_register(req: pb.SystemSharedMemoryRegisterRequest, ctx: grpc.aio.ServicerContext,
                                  grant: access.Grant) -> pb.SystemSharedMemoryRegisterResponse:
        shm.registry.register_system(grant.tenant, req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def cuda_shm_register(req: pb.CudaSharedMemoryRegisterRequest, ctx: grpc.aio.ServicerContext,
                                grant: access.Grant) -> pb.CudaSharedMemoryRegisterResponse:
        if req.device_id < 0:
            raise InferError.invalid(f"failed to register CUDA shared memory region '{req.name}': invalid args "
                                     f"(device_id {req.device_id})")
        shm.registry.register_cuda(grant.tenant, req.name, req.raw_handle, req.device_id, req.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    handlers: dict[str, grpc.RpcMethodHandler] = {
        "ServerLive": _unary(core, "ServerLive", server_live, pb.ServerLiveRequest),
        "ServerReady": _unary(core, "ServerReady", server_ready, pb.ServerReadyRequest),
        "ModelReady": _unary(core, "ModelReady", model_ready, pb.ModelReadyRequest),
        "ServerMetadata": _unary(core, "ServerMetadata", server_metadata, pb.ServerMetadataRequest),
        "ModelMetadata": _unary(core, "ModelMetadata", model_metadata, pb.ModelMetadataRequest),
        "ModelConfig": _unary(core, "ModelConfig", model_config, pb.ModelConfigRequest),
        "ModelStatistics": _unary(core, "ModelStatistics", model_statistics, pb.ModelStatisticsRequest),
        "TraceSetting": _unary(core, "TraceSetting", trace_setting, pb.TraceSettingRequest),
        "LogSettings": _unary(core, "LogSettings", log_settings, pb.LogSettingsRequest),
        "RepositoryIndex": _unary(core, "RepositoryIndex", repository_index, pb.RepositoryIndexRequest),
        "RepositoryModelLoad": _unary(core, "RepositoryModelLoad", model_load, pb.RepositoryModelLoadRequest),
        "RepositoryModelUnload": _unary(core, "RepositoryModelUnload", model_unload, pb.RepositoryModelUnloadRequest),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(model_stream_infer),
    }
    for name, fn, req_type in (
        ("SystemSharedMemoryStatus", shm_status(shm.SYSTEM, shm.system_status_pb), pb.SystemSharedMemoryStatusRequest),
        ("SystemSharedMemoryRegister", system_shm_register, pb.SystemSharedMemoryRegisterRequest),
        ("SystemSharedMemoryUnregister", shm_unregister(shm.SYSTEM, pb.SystemSharedMemoryUnregisterResponse),
         pb.SystemSharedMemoryUnregisterRequest),
        ("CudaSharedMemoryStatus", shm_status(shm.CUDA, shm.cuda_status_pb), pb.CudaSharedMemoryStatusRequest),
        ("CudaSharedMemoryRegister", cuda_shm_register, pb.CudaSharedMemoryRegisterRequest),
        ("CudaSharedMemoryUnregister", shm_unregister(shm.CUDA, pb.CudaSharedMemoryUnregisterResponse),
         pb.CudaSharedMemoryUnregisterRequest),
    ):
        handlers[name] = _unary(core, name, fn, req_type, with_grant=True)
    return handlers


def metrics_handler(core: V2Core) -> grpc.GenericRpcHandler:
    """meshserve.Metrics/Scrape: this process's /metrics exposition over gRPC (access.METRICS_METHODS),
    so a gateway can federate its services' metrics over the hop it already has."""
    async def scrape(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            if request:
                raise InferError.invalid("meshserve.Metrics/Scrape takes an empty request")
            core.authorize(access.METRICS_METHODS["Scrape"], "", _context(context))
            body, _ = await core.metrics_text()
            return body
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _fail(context, exc)
            return b""

    return grpc.method_handlers_generic_handler(access.METRICS_SERVICE, {
        "Scrape": grpc.unary_unary_rpc_method_handler(scrape)})


async def start_grpc_server(core: V2Core, host: str, port: int, health: HealthState,
                            extra_options: list[tuple[str, Any]] | None = None,
                            limits: ServerLimits | None = None) -> tuple[Any, int]:
    """Build, bind and start the gRPC server; returns (server, bound port).

    `limits` (default ServerLimits()) bound it: message size, HTTP/2 streams, resets, buffers
    and timeouts (docs/security.md). The server is meshserve's own HTTP/2 implementation (meshserve.server.h2: ~3-4x less CPU per call
    than grpc.aio here); `MESHSERVE_GRPC_SERVER=aio` selects grpc.aio instead."""
    limits = limits or ServerLimits()
    max_receive = limits.max_request_bytes or MAX_MESSAGE_BYTES
    options = SERVER_OPTIONS + [("grpc.max_receive_message_length", max_receive)] + (extra_options or [])
    if os.environ.get("MESHSERVE_GRPC_SERVER", "h2") != "aio":
        h2 = H2GrpcServer(max_receive_message_length=dict(options)["grpc.max_receive_message_length"],
                          limits=limits)
        h2.add_registered_method_handlers(SERVICE, inference_methods(core))
        h2.add_generic_rpc_handlers((health_handler(health), metrics_handler(core)))
        if getattr(core, "admission", None) is not None:  # (tenants: a gateway with --tenants)
            h2.check_headers = _key_check(core)  # without keys to check it would cost every call ~2.6k instructions
        h2.tls = tls.acceptor(limits, "grpc")
        try:
            bound = await h2.bind(host, port)
        except OSError as exc:
            raise OSError(f"cannot bind gRPC port {host}:{port}: {exc}") from None
        await h2.start()
        return h2, bound
    server = grpc.aio.server(options=options)
    if hasattr(server, "add_registered_method_handlers"):
        # Registered methods are matched once at registration, not by name on every call.
        server.add_registered_method_handlers(SERVICE, inference_methods(core))
        server.add_generic_rpc_handlers((health_handler(health), metrics_handler(core)))
    else:  # grpcio < 1.62
        server.add_generic_rpc_handlers((inference_handler(core), health_handler(health), metrics_handler(core)))
    files = limits.tls.grpc
    if files is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:  # grpc.aio's own TLS: no handshake cap, no reload (docs/security.md, "TLS and mutual TLS")
        bound = server.add_secure_port(f"{host}:{port}", tls.aio_credentials(files))
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {host}:{port} (in use?)")
    await server.start()
    return server, bound

