"""gRPC front end: inference.GRPCInferenceService over any V2Core.

ModelInfer is registered with raw-bytes (de)serializers: the request is parsed once here
and its original bytes travel on in RequestContext.raw, so the gateway can forward them
without re-serializing; responses go out as whatever bytes the core produced.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop, http_codec, infer_checks, wire
from meshserve.protocol.errors import Code, InferError, internal_error
from meshserve.protocol.wire import MAX_MESSAGE_BYTES
from meshserve.server import access, admission, body_worker, inflate, observe, shm, tls
from meshserve.server.core import RequestContext, V2Core
from meshserve.server.h2 import Abort, Call, H2GrpcServer, Inbox, Method, Status
from meshserve.server.h2.connection import HCACHE_FIELDS_MAX
from meshserve.server.h2.server import TASK_NAME
from meshserve.server.health import HealthServicer, HealthState
from meshserve.server.limits import STREAMS, ServerLimits
from meshserve.telemetry.tracing import TRACEPARENT

log = logging.getLogger("meshserve.grpc")

SERVICE = access.GRPC_SERVICE


STREAM_INFLIGHT = 1024  # requests of one ModelStreamInfer call in progress or awaiting their write
# bytes of one ModelStreamInfer call's requests in progress (read, not yet ended), each counted
# twice (its message and its parse): while over it, the next message is not read, so HTTP/2 flow
# control stops the client (the message that goes over it is still read: one up to the message
# limit always fits). A gateway's hop carries every tenant's requests, each admitted there (the
# tenant's share of --max-inflight-bytes) and again here: its bound follows the service's
# --max-inflight-bytes (held_budget), so that one tenant's large requests do not hold up the others' on the hop
STREAM_HELD_BYTES = 64 << 20
HOP_HELD_BYTES = 256 << 20

# a streamed request's Task, named (as the h2 server's calls: meshserve/server/h2/server.py:TASK_NAME)
_Task = asyncio.Task
STREAM_BACKLOG = 256  # responses of decoupled models answered on one call but not yet written
_STREAM = hop.STREAM
_CANCEL = hop.CANCEL
_FINAL = wire.FINAL_RESPONSE_PARAMETER
_FINAL_TRUE = wire.bool_parameter_entry(_FINAL, True)
_STREAM_KEYS = itertools.count(1)  # one per ModelStreamInfer call (RequestContext.stream)
_FINAL_FALSE = wire.bool_parameter_entry(_FINAL, False)


def held_budget(from_gateway: bool) -> int:
    """The bytes one ModelStreamInfer call may hold in progress (each request counted twice):
    a client's STREAM_HELD_BYTES; a gateway's hop at least HOP_HELD_BYTES and twice this process's
    --max-inflight-bytes, so that where the flag is raised the service's admission (per request,
    its refusal carried back to the tenant) bounds the hop, not the stream's reading, which would
    hold up every tenant's requests behind one tenant's large ones."""
    if not from_gateway:
        return STREAM_HELD_BYTES
    bound = admission.gate.max_bytes
    return HOP_HELD_BYTES if bound >= admission.UNBOUNDED else max(HOP_HELD_BYTES, 2 * bound)


def _flag(request: pb.ModelInferRequest, key: str) -> bool:
    """A boolean request parameter (false when absent; a bool, or a nonzero int, is true)."""
    params = request.parameters
    if not params or key not in params:
        return False
    p = params[key]
    return p.bool_param or bool(p.int64_param) or p.string_param.lower() == "true"


def _drop_frames(exc: BaseException | None) -> None:
    """A request's error, once answered, lets go of the frames it was raised through: each that
    held it in a local (observe.infer_stream keeps its error to end its span) made a cycle with
    its traceback, and with it the request and its bytes stayed alive until the collector ran,
    which with GEN0_THRESHOLD (meshserve/server/process.py) is rare. A flood of refused 24 MiB
    ModelStreamInfer requests kept every one: gateway RSS +2.9 GiB, not given back."""
    seen = 0
    while exc is not None and seen < 8:  # (the chain: its cause or context, a few deep at most)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
        seen += 1


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


# A call's vetted headers by its metadata tuple, which the h2 server keeps per header block
# (meshserve/server/h2/connection.py:H2Endpoint.hcache: the same block, the same tuple): a
# connection's calls with the same headers share one dict (read only: nothing writes a context's
# headers but vet and tls.client_cert, which never run on a kept one). Keyed by the tuple's id, the
# tuple held with it (an id is not reused while its object lives); only a call without the hop
# marker (vet hands those on unchanged; a marked call's token is checked per call) and without
# mutual-TLS certificate names (per connection). Bounded: all dropped when full (16 tuples, each
# within the header list limit, meshserve/server/h2/frames.py:MAX_HEADER_BLOCK; a client's few KB).
_VETTED: dict[int, tuple[tuple[tuple[str, Any], ...], dict[str, str]]] = {}
_VETTED_KEPT = 16


async def _in_worker(fn_name: str, raw: bytes, headers: dict[str, str], *args: Any) -> Any:
    """body_worker's ``fn_name``(raw, *args), in the line of the caller's tenant (``headers``: its
    RequestContext's; an unknown key is UNAUTHENTICATED here, as at admission)."""
    worker = body_worker.worker()
    if (find := inflate.tenant_of) is None:
        return await worker.call(fn_name, raw, *args)
    tenant, share = find(headers)
    return await worker.call(fn_name, raw, *args, tenant=tenant, share=share)


async def parse_off_loop(raw: bytes, headers: dict[str, str]) -> pb.ModelInferRequest:
    """The ModelInferRequest ``raw`` (infer_checks.heavy) read by the body worker
    (http_codec.parse_grpc_infer_request)."""
    return await _in_worker("parse_grpc_infer_request", raw, headers)  # type: ignore[no-any-return]


async def parse_stream_message(raw: bytes, headers: dict[str, str]) -> tuple[pb.ModelInferRequest,
                                                                              InferError | None]:
    """A ModelStreamInfer message ``raw`` (infer_checks.heavy) read by the body worker
    (http_codec.parse_grpc_stream_request): (the request, None), or (what its answer in band
    needs: its id, model and version, the refusal) for one that parsed but was refused. A
    malformed one raises."""
    got = await _in_worker("parse_grpc_stream_request", raw, headers)
    if isinstance(got, http_codec.Refused):
        return (pb.ModelInferRequest(id=got.id, model_name=got.model_name, model_version=got.model_version),
                InferError(Code(got.code), got.message))
    return got, None


def _context(call: Call, raw: bytes | None = None) -> RequestContext:
    md = call.invocation_metadata()
    # the one place a call's metadata is read: the hop marker believed only on an authenticated
    # call (meshserve/protocol/hop.py:vet, once per call: per stream); a gateway with tenants and
    # mutual TLS adds the client certificate's names (meshserve/server/tls.py:client_cert)
    if not md:
        headers: dict[str, str] = {}
    elif (kept := _VETTED.get(id(md))) is not None and kept[0] is md and not tls.cert_names_grpc:
        headers = kept[1]
    else:
        headers = {k: v for k, v in md if isinstance(v, str)}
        if hop.HEADER in headers or tls.cert_names_grpc:
            headers = hop.vet(headers)
            if tls.cert_names_grpc:
                tls.client_cert(headers, tls.grpc_transport(call))
        elif len(md) <= HCACHE_FIELDS_MAX:  # (vet would hand it on unchanged; a long one is not kept)
            if len(_VETTED) >= _VETTED_KEPT:
                _VETTED.clear()
            _VETTED[id(md)] = (md, headers)
    # (positional: a dataclass __init__ called with keywords costs ~2.3k instructions more)
    return RequestContext("grpc", headers, call.deadline, raw)


def _control_context(call: Call) -> RequestContext:
    """A repository-control call's context: also the peer's address (loopback-only control)."""
    ctx = _context(call)
    ctx.peer = call.peer()
    return ctx


def _key_check(core: V2Core) -> Callable[[str, tuple[tuple[str, Any], ...]], tuple[int, str] | None]:
    """The HTTP/2 server's check at a call's headers: a unary method whose rule is not open needs
    a valid key (UNAUTHENTICATED, when there are tenants) before its message is received, as the
    HTTP front end checks before reading a body; the method's own rule follows as before."""
    open_paths = {f"/{access.GRPC_SERVICE}/{name}" for name, row in access.GRPC_METHODS.items()
                  if isinstance(row.op, access.Op) and row.op.rule is access.Rule.OPEN}
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
        # (metadata of ~2,000 fields is ~250 KB: 1,024 of them kept were 256 MiB of the process)
        if len(metadata) <= HCACHE_FIELDS_MAX:
            if len(passed) >= 1024:
                passed.clear()
            passed.add(metadata)
        return None

    return check


def _fail(call: Call, exc: BaseException) -> None:
    """Set the call's error status. The handler then returns None (the server sends the status
    alone), which avoids abort()'s exception machinery: rejections come by the thousand (quota floods)."""
    if isinstance(exc, InferError):
        call.set_status(exc.grpc_status.value[0], exc.message)
        if exc.retry_after_ms is not None:  # HTTP's Retry-After, as gRPC's server pushback
            call.set_trailing_metadata(((wire.RETRY_PUSHBACK_METADATA, str(exc.retry_after_ms)),))
        return
    log.exception("internal error while serving a gRPC call")
    call.set_status(Status.INTERNAL, internal_error(exc).message)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


def _checked(core: V2Core | None, row: access.GrpcMethod,
             fn: Callable[..., Awaitable[Any]]) -> Callable[[Any, Call], Awaitable[Any]]:
    """A unary method with a message type: the access table's verdict on the call first (open
    calls cost nothing), then ``fn(request, call)`` (``fn(request, call, grant)`` under the rule
    OWN: the tenant's own shared-memory regions), its answer filtered by the grant; an error is
    the call's status, never a crash."""
    with_grant = isinstance(row.op, access.Op) and row.op.rule is access.Rule.OWN

    async def handler(request: Any, call: Call) -> Any:
        try:
            if request.__class__ is _Unread:
                request = await request.read(_context(call).headers)
            op, model = row.resolve(request)
            if op.rule is access.Rule.OPEN:
                grant = access.ALL
            else:
                assert core is not None  # (only the inference service has rules that are not open)
                grant = core.authorize(op, model, _context(call))
            if with_grant:
                return await fn(request, call, grant)
            return grant.filter(await fn(request, call))
        except (asyncio.CancelledError, Abort):
            raise
        except Exception as exc:  # mapped to a status, never a crash
            _fail(call, exc)
            return None

    return handler


def methods(servicer: Any, table: dict[str, access.GrpcMethod], core: V2Core | None = None) -> dict[str, Method]:
    """The h2 server's methods of one service: each row of its access table (name, rule, message
    type, shape) with the servicer's method of that name. A unary row with a message type is
    checked against the table (_checked); a row without one takes and answers raw bytes and makes
    its own checks (ModelInfer and ModelStreamInfer: admission on the infer path; Scrape)."""
    out: dict[str, Method] = {}
    for name, row in table.items():
        fn = getattr(servicer, name)
        if row.request is None:
            out[name] = Method(fn, row.request_streaming, row.response_streaming)
        elif row.request_streaming or row.response_streaming:
            out[name] = Method(fn, row.request_streaming, row.response_streaming, row.request.FromString, _serialize)
        else:
            out[name] = Method(_checked(core, row, fn), False, False, _reader(row.request), _serialize)
    return out


class _Unread:
    """A unary request over body_worker.OFFLOAD_BYTES, parsed by the body worker when its handler
    starts (_reader, _checked)."""

    __slots__ = ("raw", "type_name", "parse")

    def __init__(self, raw: bytes, type_name: str, parse: Callable[[bytes], Any]) -> None:
        self.raw, self.type_name, self.parse = raw, type_name, parse

    async def read(self, headers: dict[str, str]) -> Any:
        return self.parse(await _in_worker("parse_grpc_message", self.raw, headers, self.type_name))


def _reader(kind: Any) -> Callable[[bytes], Any]:
    """The request deserializer of a unary method of message type ``kind``: a message of at most
    infer_checks.COUNT_FROM bytes is parsed; one of at most body_worker.OFFLOAD_BYTES is parsed
    and its maps and repeated fields counted (infer_checks.check_message_counts: MAX_PARAMETERS
    entries each); a larger one of grpc_service.proto is left to the body worker (_Unread): it
    sends back the message with one entry per key, which parses at memcpy speed (a million map
    entries of a model load held the loop 1.5 s before). A deserializer's ValueError is the
    call's INVALID_ARGUMENT."""
    parse = kind.FromString
    name: str = kind.DESCRIPTOR.name
    type_name = name if getattr(pb, name, None) is kind else None  # (grpc_service.proto's: the worker knows it)

    def read(raw: bytes) -> Any:
        n = len(raw)
        if n <= infer_checks.COUNT_FROM:
            return parse(raw)
        if n > body_worker.OFFLOAD_BYTES and type_name is not None:
            return _Unread(raw, type_name, parse)
        message = parse(raw)
        try:
            infer_checks.check_message_counts(message)
        except InferError as exc:
            raise ValueError(exc.message) from None
        return message

    return read


class InferenceServicer:
    """inference.GRPCInferenceService over one core: one method per RPC (access.GRPC_METHODS has
    each one's rule, message type and shape). A unary method with a message type returns its
    response (the table's check and error mapping wrap it: `methods`); ModelInfer and
    ModelStreamInfer take raw bytes."""

    def __init__(self, core: V2Core):
        self.core = core
        kind = getattr(core, "kind", None)  # a service announces its kind to gateways (wire.SERVICE_KIND_METADATA)
        self.kind_metadata = ((wire.SERVICE_KIND_METADATA, kind),) if isinstance(kind, str) else ()
        # a gateway's response cache answers a hit here, before parsing (gateway/cache.py:FrontDoor);
        # where it answers without waiting, before the call's Task instead (``answer_at_once``: register)
        self.hit = getattr(core, "grpc_hit", None)
        self.front = getattr(core, "grpc_front", None)  # gateway/cache.py:FrontDoor, when it never waits
        # a gateway with tenants refuses a caller past its share before the parse (gateway/core.py)
        self.door = getattr(core, "grpc_door", None)

    async def ServerLive(self, req: pb.ServerLiveRequest, call: Call) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.core.live())

    async def ServerReady(self, req: pb.ServerReadyRequest, call: Call) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def ModelReady(self, req: pb.ModelReadyRequest, call: Call) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self.core.model_ready(req.name, req.version))

    async def ServerMetadata(self, req: pb.ServerMetadataRequest, call: Call) -> pb.ServerMetadataResponse:
        return self.core.server_metadata()

    async def ModelMetadata(self, req: pb.ModelMetadataRequest, call: Call) -> pb.ModelMetadataResponse:
        return await self.core.model_metadata(req.name, req.version)

    async def ModelConfig(self, req: pb.ModelConfigRequest, call: Call) -> pb.ModelConfigResponse:
        return await self.core.model_config(req.name, req.version)

    async def ModelStatistics(self, req: pb.ModelStatisticsRequest, call: Call) -> pb.ModelStatisticsResponse:
        return await self.core.statistics(req.name, req.version)

    async def TraceSetting(self, req: pb.TraceSettingRequest, call: Call) -> pb.TraceSettingResponse:
        # no settings: a read (tritonclient's get_trace_settings); an empty value list clears a model's key
        changes = {key: list(v.value) or None for key, v in req.settings.items()}
        settings = await observe.trace_setting(self.core, req.model_name, changes)
        response = pb.TraceSettingResponse()
        for key, values in settings.items():
            response.settings[key].value.extend(values)
        return response

    async def LogSettings(self, req: pb.LogSettingsRequest, call: Call) -> pb.LogSettingsResponse:
        changes = {}  # no settings: a read (tritonclient's get_log_settings)
        for key, v in req.settings.items():
            kind = v.WhichOneof("parameter_choice")
            if kind is None:
                raise InferError.invalid(f"log setting '{key}' has no value")
            changes[key] = getattr(v, kind)
        response = pb.LogSettingsResponse()
        observe.fill_log_settings(response.settings, await observe.log_setting(self.core, changes))
        return response

    async def RepositoryIndex(self, req: pb.RepositoryIndexRequest, call: Call) -> pb.RepositoryIndexResponse:
        if self.kind_metadata:
            call.set_trailing_metadata(self.kind_metadata)
        return await self.core.repository_index(req.ready)

    async def RepositoryModelLoad(self, req: pb.RepositoryModelLoadRequest, call: Call
                                  ) -> pb.RepositoryModelLoadResponse:
        await self.core.load_model(req.model_name, dict(req.parameters), _control_context(call))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, req: pb.RepositoryModelUnloadRequest, call: Call
                                    ) -> pb.RepositoryModelUnloadResponse:
        await self.core.unload_model(req.model_name, dict(req.parameters), _control_context(call))
        return pb.RepositoryModelUnloadResponse()

    async def ModelInfer(self, raw: bytes, call: Call) -> bytes | None:
        try:
            if self.hit is not None and (hit := self.hit(raw, call, _context)) is not None:
                return hit if hit.__class__ is bytes else await hit  # type: ignore[no-any-return,misc]
            ctx = _context(call, raw)
            if (door := self.door) is not None and (refused := door(raw, ctx)) is not None:
                _fail(call, refused)  # (a caller past its share, refused before the parse: gateway/core.py)
                return None
            data: bytes | None = raw  # (the request's bytes; None: the worker's message is the request)
            if len(raw) > infer_checks.HEAVY_FROM and infer_checks.heavy(raw):
                request = await parse_off_loop(raw, ctx.headers)
                ctx.raw = data = None
                ctx.nbytes = len(raw)  # (what admission counts)
            else:
                try:
                    request = pb.ModelInferRequest.FromString(raw)
                except Exception as exc:
                    raise InferError.invalid(f"malformed ModelInferRequest: {exc}") from None
                if len(raw) > infer_checks.COUNT_FROM:
                    infer_checks.check_counts(request)
            if shm.uses_shared_memory(request, data):
                infer = shm.infer
            elif (admitted := observe.admitted(request, ctx)) is not None:  # observe.infer's common path, here
                try:
                    answer = await self.core.infer(request, ctx)
                except Exception as exc:
                    raise observe.failed(request, ctx, exc) from None
                finally:
                    observe.release(admitted)
                return answer.serialized()
            else:
                infer = observe.infer
            result, span = await infer(self.core, request, ctx)
            if span is not None:
                call.set_trailing_metadata(((TRACEPARENT, span.traceparent()),))
            return result.serialized()
        except (asyncio.CancelledError, Abort):
            raise
        except Exception as exc:
            _fail(call, exc)
            return None

    def answer_at_once(self, raw: bytes, call: Call | None) -> bytes | None:
        """ModelInfer's cache hit, before the call's Task is made (H2GrpcServer.at_once): the
        answer, b"" with the call's error status set (a tenant's 403, 429), or None: ModelInfer.
        ``call`` is None without tenants (the door reads it only to admit)."""
        try:
            return self.front.grpc(raw, call, _context)  # type: ignore[no-any-return,union-attr]
        except InferError as exc:
            assert call is not None  # (only admission refuses, and with tenants the call is given)
            _fail(call, exc)
            return b""

    async def ModelStreamInfer(self, requests: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
        # Requests on one stream run concurrently; responses are written as they complete
        # (each carries its request id). Per-request errors travel in band, with their status
        # code in an infer_response parameter so a gateway can map them back to a status.
        # At most STREAM_INFLIGHT requests of a stream are in progress or answered but not yet
        # written, and (beyond the one that goes over it) STREAM_HELD_BYTES of them in progress
        # (HOP_HELD_BYTES on a gateway's hop): beyond either the next message is not read, so
        # HTTP/2 flow control stops a client that sends faster than the models answer (or than
        # it reads its answers). A compressed message's inflated bytes stay charged to the
        # process's budget (inflate.INFLATING) until its request ends (Call.keep_inflated).
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
        # once per call: asyncio.get_running_loop() (and ensure_future) make a getpid system call
        # each time on Python 3.11
        loop = asyncio.get_running_loop()
        # the answers for the writer below, its one reader (a list: one answer's pieces, which the
        # h2 server writes without joining them)
        out: Inbox = Inbox(loop)
        pending: set[asyncio.Task[None]] = set()  # a client's requests, a gateway's streamed ones
        # a gateway's requests in progress by id (to cancel; its unstreamed ones are only here:
        # each takes itself out as its answer is queued, so nothing else tracks it)
        by_id: dict[str, asyncio.Task[None]] = {}
        core = self.core
        base = _context(call)
        stream_key = f"c{next(_STREAM_KEYS)}"  # (RequestContext.stream)
        slots = asyncio.Semaphore(STREAM_INFLIGHT)
        backlog = asyncio.Semaphore(STREAM_BACKLOG)
        queued = [0]  # bytes of streamed answers queued, not yet written: at most --max-stream-backlog-bytes
        room = asyncio.Event()  # (beyond one answer); set when the writer takes one
        failed: list[tuple[int, str]] = []  # what ends the stream: (gRPC status, details)
        order: collections.deque[list[Any]] = collections.deque()  # [answer bytes or None, ready]
        in_bytes = [0]  # bytes of the requests in progress (read, their tasks not ended): at most ``budget``
        drained: list[asyncio.Future[None] | None] = [None]  # the reader waiting for in_bytes to fall

        def in_order(place: list[Any], item: bytes | None) -> None:
            """A request's one answer (None: nothing to write) takes its place; what is ready at
            the head of the order leaves."""
            place[0], place[1] = item, True
            while order and order[0][1]:
                held = order.popleft()[0]
                if held is not None:
                    out.put_nowait(held)

        async def one(request: pb.ModelInferRequest, raw: bytes | None, cost: int, place: list[Any] | None = None,
                      hop_id: str = "", hop_stream: bool = False, refused: InferError | None = None) -> None:
            streamed = False
            owns_slot = True  # until an item that ends the request is queued (the writer gives it back)
            try:
                if refused is not None:  # (read by the body worker: answered in band below)
                    if from_gateway:
                        by_id.pop(hop_id, None)
                    raise refused
                ctx = RequestContext("grpc", base.headers, base.deadline, raw)  # (positional: see _context)
                ctx.stream = stream_key
                if raw is None:
                    ctx.nbytes = cost // 2  # (the worker's message: admission counts the bytes that came)
                elif len(raw) > infer_checks.COUNT_FROM:
                    infer_checks.check_counts(request)
                if from_gateway and not hop_stream:  # (the reader read the parameters: hop_stream)
                    # the gateway's hop, one answer per request (its requests name no shared-memory region)
                    try:
                        result, _ = await observe.infer(core, request, ctx)
                    finally:
                        by_id.pop(hop_id, None)
                    owns_slot = False
                    body = result.serialized()  # (its ModelStreamInferResponse field's head, then the body: not joined)
                    out.put_nowait([wire.STREAM_RESPONSE_INFER_TAG + wire.varint(len(body)), body])
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
                    _drop_frames(exc)
                    exc = internal_error(exc)
                _drop_frames(exc)
                if grpc_error_mode:  # the call ends with the first error's status (Triton's triton_grpc_error)
                    if not failed:
                        failed.append((exc.grpc_status.value[0], exc.message))
                    out.put_nowait(None)
                    return
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
                in_bytes[0] -= cost
                if (waiter := drained[0]) is not None and in_bytes[0] <= budget:
                    drained[0] = None
                    if not waiter.done():
                        waiter.set_result(None)

        from_gateway = hop.from_gateway(base.headers)  # (this call is a gateway's hop: never in a gateway)
        # Triton's gRPC error mode (the client's metadata triton_grpc_error: true): a request's error
        # ends the call with its status and message instead of travelling in band, and nothing follows
        grpc_error_mode = not from_gateway and base.headers.get("triton_grpc_error") == "true"
        budget = held_budget(from_gateway)
        # whether a client's request is for a decoupled model (its answers are not held in order);
        # a core that cannot tell serves none
        decoupled: Callable[[str, str], bool] | None = None if from_gateway else getattr(core, "is_decoupled", None)

        def take(raw: bytes, release: Callable[[], None] | None, parsed: pb.ModelInferRequest | None = None,
                 refused: InferError | None = None) -> bool:
            """One message read: its request started (False: the stream ends here). ``release``
            gives back its inflated bytes' charge (a compressed message): when its request ends.
            ``parsed``: the request the body worker read from ``raw`` (parse_stream_message);
            ``refused``: the worker's refusal of it (``parsed`` then holds only its id, model and
            version), answered in band."""
            cost = 2 * len(raw)  # (its bytes, and their parse)
            kept: bytes | None = raw  # (the request's bytes for its RequestContext; None: the worker's message)
            if parsed is not None:
                request, kept = parsed, None
            else:
                try:
                    request = pb.ModelInferRequest.FromString(raw)
                except Exception as exc:  # what a failed deserializer reports on a unary call
                    failed.append((Status.INVALID_ARGUMENT, f"Exception deserializing request: {exc}"))
                    if release is not None:
                        release()
                    return False
            params = request.parameters
            if from_gateway and params and _CANCEL in params:  # the gateway's client went away
                slots.release()
                if release is not None:
                    release()
                cancelled = by_id.pop(request.id, None)
                if cancelled is not None:
                    cancelled.cancel()
                return True
            in_bytes[0] += cost
            if from_gateway:
                hop_id = request.id
                hop_stream = bool(params) and _STREAM in params
                task = _Task(one(request, kept, cost, None, hop_id, hop_stream, refused), loop=loop, name=TASK_NAME)
                repeated = by_id.get(hop_id)
                by_id[hop_id] = task
                if repeated is not None:  # a repeated id (not the gateway's way): still awaited
                    pending.add(repeated)
                    repeated.add_done_callback(pending.discard)
                if release is not None:
                    task.add_done_callback(lambda _: release())
                if not hop_stream:
                    return True  # (it takes itself out of by_id as its answer is queued)
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
                task = _Task(one(request, kept, cost, place, refused=refused), loop=loop, name=TASK_NAME)
                if release is not None:
                    task.add_done_callback(lambda _: release())
            pending.add(task)
            task.add_done_callback(pending.discard)
            return True

        async def reader() -> None:
            try:
                async for raw in requests:  # bytes: parsed here, so each request keeps its own (RequestContext.raw)
                    await slots.acquire()  # given back when its answer is written
                    parsed = refused = None
                    if len(raw) > infer_checks.HEAVY_FROM and infer_checks.heavy(raw):
                        try:
                            parsed, refused = await parse_stream_message(raw, base.headers)
                        except InferError as exc:  # (malformed: as a failed parse; the stream ends)
                            failed.append((exc.grpc_status.value[0], exc.message))  # (or the worker's UNAVAILABLE)
                            break
                    if not take(raw, call.keep_inflated(), parsed, refused):
                        break
                    del raw  # (not held while the next one is awaited)
                    while in_bytes[0] > budget:  # the next message waits: flow control stops the client
                        drained[0] = waiter = loop.create_future()
                        await waiter
                if pending or by_id:
                    await asyncio.gather(*pending, *by_id.values(), return_exceptions=True)
            finally:
                out.put_nowait(None)

        read_task = _Task(reader(), loop=loop, name=TASK_NAME)
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
                await call.abort(*failed[0])
        finally:
            read_task.cancel()
            for t in [*pending, *by_id.values()]:
                t.cancel()

    # the shared-memory extensions (meshserve.server.shm): the caller's tenant's regions only (rule OWN)
    async def SystemSharedMemoryStatus(self, req: pb.SystemSharedMemoryStatusRequest, call: Call,
                                       grant: access.Grant) -> pb.SystemSharedMemoryStatusResponse:
        return shm.system_status_pb(shm.registry.status(grant.tenant, req.name, shm.SYSTEM))

    async def SystemSharedMemoryRegister(self, req: pb.SystemSharedMemoryRegisterRequest, call: Call,
                                         grant: access.Grant) -> pb.SystemSharedMemoryRegisterResponse:
        shm.registry.register_system(grant.tenant, req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, req: pb.SystemSharedMemoryUnregisterRequest, call: Call,
                                           grant: access.Grant) -> pb.SystemSharedMemoryUnregisterResponse:
        shm.registry.unregister(grant.tenant, req.name, shm.SYSTEM)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, req: pb.CudaSharedMemoryStatusRequest, call: Call,
                                     grant: access.Grant) -> pb.CudaSharedMemoryStatusResponse:
        return shm.cuda_status_pb(shm.registry.status(grant.tenant, req.name, shm.CUDA))

    async def CudaSharedMemoryRegister(self, req: pb.CudaSharedMemoryRegisterRequest, call: Call,
                                       grant: access.Grant) -> pb.CudaSharedMemoryRegisterResponse:
        if req.device_id < 0:
            raise InferError.invalid(f"failed to register CUDA shared memory region '{req.name}': invalid args "
                                     f"(device_id {req.device_id})")
        shm.registry.register_cuda(grant.tenant, req.name, req.raw_handle, req.device_id, req.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, req: pb.CudaSharedMemoryUnregisterRequest, call: Call,
                                         grant: access.Grant) -> pb.CudaSharedMemoryUnregisterResponse:
        shm.registry.unregister(grant.tenant, req.name, shm.CUDA)
        return pb.CudaSharedMemoryUnregisterResponse()


class MetricsServicer:
    """meshserve.Metrics/Scrape: this process's /metrics exposition over gRPC (access.METRICS_METHODS),
    so a gateway can federate its services' metrics over the hop it already has."""

    def __init__(self, core: V2Core):
        self.core = core

    async def Scrape(self, request: bytes, call: Call) -> bytes | None:
        try:
            if request:
                raise InferError.invalid("meshserve.Metrics/Scrape takes an empty request")
            self.core.authorize(access.METRICS_METHODS["Scrape"].rule_of(request), "", _context(call))
            body, _ = await self.core.metrics_text()
            return body
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _fail(call, exc)
            return None


def inference_methods(core: V2Core) -> dict[str, Method]:
    """The GRPCInferenceService methods of one core: access.GRPC_METHODS' rows, InferenceServicer's handlers."""
    return methods(InferenceServicer(core), access.GRPC_METHODS, core)


def register(server: H2GrpcServer, core: V2Core, health: HealthState) -> None:
    """Every gRPC service of a process on `server`: inference, grpc.health.v1 and meshserve.Metrics,
    each from its access table's rows (the table the auth test walks is the one that dispatches)."""
    servicer = InferenceServicer(core)
    server.add_methods(access.GRPC_SERVICE, methods(servicer, access.GRPC_METHODS, core))
    front = servicer.front
    if front is not None:  # a gateway's cache hits, answered before any Task
        # (without tenants the door neither reads the call nor refuses: called as it is, without one)
        hook = (servicer.answer_at_once, True) if front.admission is not None else (front.grpc, False)
        path = f"/{access.GRPC_SERVICE}/ModelInfer"
        install = functools.partial(server.at_once.setdefault, path, hook)  # type: ignore[arg-type]
        earlier = front.on_first_entry  # another gRPC server of this process on the same door: each gets it
        front.on_first_entry = install if earlier is None else lambda: (earlier(), install())
        # with tenants from the door's first entry on (a call the door declines cost a ServerCall
        # more); without, at once: a call declined from its two frames costs less than the usual
        # path (ServerConnection._at_once opens its stream: docs/perf/response-cache.md, section 13)
        if front.entries or front.admission is None:
            install()
        servicer.hit = None  # (what the door can answer it answers there: ModelInfer goes on to the pipeline)
    server.add_methods(access.HEALTH_SERVICE, methods(HealthServicer(health), access.HEALTH_METHODS))
    server.add_methods(access.METRICS_SERVICE, methods(MetricsServicer(core), access.METRICS_METHODS, core))


async def start_grpc_server(core: V2Core, host: str, port: int, health: HealthState,
                            limits: ServerLimits | None = None) -> tuple[H2GrpcServer, int]:
    """Build, bind and start the gRPC server (meshserve.server.h2: ~3-4x less CPU per call than
    grpc.aio here); returns (server, bound port). `limits` (default ServerLimits()) bound it:
    message size, HTTP/2 streams, resets, buffers and timeouts (docs/security.md)."""
    limits = limits or ServerLimits()
    server = H2GrpcServer(max_receive_message_length=limits.max_request_bytes or MAX_MESSAGE_BYTES, limits=limits)
    register(server, core, health)
    if getattr(core, "admission", None) is not None:  # (tenants: a gateway with --tenants)
        server.check_headers = _key_check(core)  # without keys to check it would cost every call ~2.6k instructions
    server.tls = tls.acceptor(limits, "grpc")
    try:
        bound = await server.bind(host, port)
    except OSError as exc:
        raise OSError(f"cannot bind gRPC port {host}:{port}: {exc}") from None
    await server.start()
    return server, bound
