"""HTTP/REST front end: the KServe v2 REST API + Triton extensions over any V2Core.

Served by meshserve's HTTP/1.1 server (meshserve/server/http1) on its own request and answer
types (`http1.Request`, `http1.Answer`, `http1.Stream`). Routes are declared once, in
`meshserve/server/access.py:HTTP_ROUTES` (method, template, op, handler): `HttpFrontend`
compiles them at start (`meshserve/server/http1/routing.py:Router`), authorizes every
request by its row's op before its handler runs (infer excepted: the core admits it), and
dispatches to the row's handler, a method of this class. A path already matched is looked up
by its raw target at once (`HttpFrontend.seen`). Bodies are parsed and rendered only by
meshserve.protocol.http_codec.

Limits (ServerLimits; docs/security.md) are the server's: a body is read by
`http1.Request.read_body` (--max-request-bytes before and after decoding, --max-receive-bytes,
Content-Encoding), and the header, read, body and idle timeouts and the heap trim after a
large body are `meshserve/server/http1/server.py`'s. JSON larger than
`body_worker.OFFLOAD_BYTES` is decoded in a worker process.
"""
from __future__ import annotations

import asyncio
import json
import logging
from functools import partialmethod
from typing import Any, cast

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import generate_codec, http_codec, wire
from meshserve.protocol.errors import Code, InferError, internal_error
from meshserve.repository.names import check_version
from meshserve.server import admission, body_worker, deflate, http1, observe, shm, tls
from meshserve.server.access import HTTP_ROUTES, Grant, Op, Rule
from meshserve.server.core import InferResult, RequestContext, V2Core
from meshserve.server.http1 import Answer, Request, Stream
from meshserve.server.http1.request import SMALL_BODY_BYTES, text_headers
from meshserve.server.http1.routing import Match, Router
from meshserve.server.limits import ServerLimits
from meshserve.telemetry import tracing

log = logging.getLogger("meshserve.http")

_JSON = "application/json"
_JSON_TYPE = {"Content-Type": _JSON}
_EVENTS = {"Content-Type": generate_codec.EVENT_STREAM_CONTENT_TYPE, "Cache-Control": "no-cache"}
Params = dict[str, str]


def _json_response(obj: Any, status: int = 200) -> Answer:
    return Answer(json.dumps(obj, separators=(",", ":")).encode(), dict(_JSON_TYPE), status)


def _error_response(exc: InferError) -> Answer:
    headers = dict(_JSON_TYPE)
    if (retry_after := exc.retry_after_header) is not None:
        headers["Retry-After"] = retry_after
    # 413: the rest of the body is not read, so this connection ends after the answer
    return Answer(http_codec.error_body(exc.message), headers, exc.http_status, close=exc.code is Code.TOO_LARGE)


def _empty(status: int = 200) -> Answer:
    return Answer(b"", {"Content-Type": "text/plain"}, status)


def _health(request: Request, probe: str, state: bool) -> Answer:
    """A health answer as Triton's (and the Open Inference Protocol's): the status is the answer,
    200 for true and 400 for false, with an empty body, which scripts compare whole (NVIDIA's QA
    waits for ``curl -s -w %{http_code}`` to print exactly ``200``). The body ``{"ready": true}``
    goes to a client that reads one: one whose Accept names application/json, and the KServe SDK's
    ``InferenceRESTClient`` (httpx, whose Accept is ``*/*``), which parses it whatever the status."""
    accept = request.header("accept") or ""
    if "application/json" in accept or (request.header("user-agent") or "").startswith("python-httpx/"):
        return _json_response({probe: state}, 200 if state else 400)
    return _empty(200 if state else 400)


def _joined(chunks: list[bytes]) -> bytes:
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _context_headers(request: Request) -> dict[str, str]:
    """The request's headers for the core, as valid text (`meshserve/server/http1/request.py:text_headers`),
    with the client certificate's names where a gateway with tenants serves mutual TLS."""
    headers = text_headers(request.lower)
    if tls.cert_names_http:  # a gateway with tenants and mutual TLS: the client certificate's names
        tls.client_cert(headers, request.conn.transport)
    return headers


def _inline(chunks: list[bytes], size: int | None = None) -> bool:
    """Is the JSON to decode (`size`, default the whole body) small enough for this loop?"""
    return (sum(map(len, chunks)) if size is None else size) <= body_worker.OFFLOAD_BYTES


async def _decode(request: Request, fn: Any, chunks: list[bytes], *args: Any, size: int | None = None) -> Any:
    """fn(body, *args) (an http_codec parser): in place when the JSON to decode is small
    (_inline), else in the body worker process, off this event loop, in the line of the
    request's tenant (with tenants: one tenant's large bodies hold at most its share of the workers)."""
    if _inline(chunks, size):
        return fn(_joined(chunks), *args)
    return await _in_worker(request, fn.__name__, chunks, *args)


async def _in_worker(request: Request, fn_name: str, body: Any, *args: Any) -> Any:
    """The body worker's ``fn_name(body, *args)``, in the line of the request's tenant (with
    tenants: one tenant's large bodies and answers hold at most its share of the workers)."""
    who = request.caller()
    if who is None:
        return await body_worker.worker().call(fn_name, body, *args)
    return await body_worker.worker().call(fn_name, body, *args, tenant=who[0], share=who[1])


def _route_arm(message: pb.ModelInferResponse, headers: dict[str, str]) -> None:
    """The gateway's A/B route of an answer (its parameter) as the header clients read."""
    if message.parameters:
        arm = message.parameters.get(wire.ROUTE_ARM_PARAMETER)
        if arm is not None:
            headers[wire.ROUTE_ARM_HEADER] = arm.string_param


async def _generate_body(request: Request, result: InferResult, infer_request: pb.ModelInferRequest) -> bytes:
    """One generate answer's JSON: in place, or for a large answer (every output is written as
    JSON: ~2 s of this loop for 8 million floats) in the body worker, in the line of the
    request's tenant (docs/security.md, "Session 23: answers written as JSON")."""
    held = result.held_raw
    if (len(held) if held is not None else result.message().ByteSize()) <= body_worker.OFFLOAD_BYTES:
        return generate_codec.render_generate_response(result.message(), infer_request)
    return cast(bytes, await _in_worker(request, "render_generate_answer", result.serialized(),
                                        http_codec.rendering_request(infer_request)))


class HttpFrontend:
    """Dispatches v2 REST paths to a V2Core by the route table (see the module docstring)."""

    SEEN_MAX = 1024

    def __init__(self, core: V2Core):
        self.core = core
        self.router = Router(HTTP_ROUTES, self)  # the live table (tests/adversarial/test_auth_table.py walks it)
        for route in self.router.routes:  # infer: admission in the core; health: open to all
            route.checked = not (route.op.rule is Rule.INFER or route.op is Op.HEALTH)
        # raw target (query included) -> its Match, for paths seen before (at most SEEN_MAX, all
        # dropped when full): a request to a known path is dispatched without parsing it
        self.seen: dict[str, Match] = {}
        # a gateway's response cache answers a hit here, after parsing (gateway/cache.py:FrontDoor)
        self.hit = getattr(core, "http_hit", None)
        self.door = getattr(core, "http_door", None)  # a gateway with tenants: a caller past its share
        # a gateway that forwards a templated request's bytes without reading its message
        # (gateway/core.py: no policy stage; not an ensemble's name): ``forwarded``
        self.forwards = getattr(core, "forwards_bytes", False) and self.hit is None
        self.ensembles = getattr(core, "forward_ensembles", None)

    def forwarded(self, name: str) -> bool:
        """Whether a request for ``name`` may be a ``http_codec.ForwardedRequest`` (its message
        made only if read): on a gateway whose pipeline sends its bytes as they are, not an
        ensemble (run in the gateway from the message), tracing off (spans read the message)."""
        if not self.forwards or tracing.enabled:
            return False
        ensembles = self.ensembles
        return ensembles is None or name not in ensembles

    def _match(self, request: Request) -> Match:
        found = self.router.match(request.raw_path)
        if found is None:
            raise InferError.not_found(f"no route for {request.method} {request.raw_path.split('?', 1)[0]}")
        params = found.params
        if params.get("v"):
            check_version(params["v"], params["m"])
        if len(self.seen) >= self.SEEN_MAX:
            self.seen.clear()
        self.seen[request.raw_path] = found
        return found

    async def answer(self, request: Request) -> Answer | Stream:
        """The answer to one request (the http1 server's handler)."""
        try:
            found = self.seen.get(request.raw_path) or self._match(request)
            route = found.methods.get(request.method)
            if route is None:
                raise InferError.invalid(f"method {request.method} not allowed on {request.path}; "
                                         f"use {found.allowed()}")
            if not route.checked:
                return await route.handler(request, found.params, None)
            grant = self.core.authorize(route.op, found.params.get("m", ""),
                                        RequestContext(protocol="http", headers=_context_headers(request)))
            return await route.handler(request, found.params, grant)
        except InferError as exc:
            return _error_response(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never a crash; report and keep serving
            log.exception("internal error serving %s %s", request.method, request.path)
            return _error_response(internal_error(exc))

    # ---- the handlers: (request, the path's placeholders, the grant of the row's op) ----------------

    async def live(self, request: Request, p: Params, grant: Grant | None) -> Answer:
        return _health(request, "live", self.core.live())

    async def ready(self, request: Request, p: Params, grant: Grant | None) -> Answer:
        return _health(request, "ready", self.core.ready())

    async def metrics(self, request: Request, p: Params, grant: Grant) -> Answer:
        if not getattr(self.core, "serves_metrics", True):  # (a gateway with --allow-metrics=false)
            raise InferError.not_found("metrics are off on this server (--allow-metrics=false)")
        body, ctype = await self.core.metrics_text()
        return Answer(body, {"Content-Type": ctype})

    async def server_metadata(self, request: Request, p: Params, grant: Grant) -> Answer:
        return _json_response(http_codec.server_metadata_to_json(self.core.server_metadata()))

    async def model_metadata(self, request: Request, p: Params, grant: Grant) -> Answer:
        return _json_response(http_codec.model_metadata_to_json(await self.core.model_metadata(p["m"], p["v"])))

    async def model_ready(self, request: Request, p: Params, grant: Grant) -> Answer:
        if await self.core.model_ready(p["m"], p["v"]):
            return _empty(200)
        return Answer(http_codec.error_body("Model version not ready"), dict(_JSON_TYPE), 400)

    async def model_config(self, request: Request, p: Params, grant: Grant) -> Answer:
        cfg = await self.core.model_config(p["m"], p["v"])
        return _json_response(http_codec.model_config_to_json(cfg.config))

    async def model_statistics(self, request: Request, p: Params, grant: Grant) -> Answer:
        return _json_response(http_codec.statistics_to_json(await self.core.statistics(p["m"], p["v"])))

    async def all_statistics(self, request: Request, p: Params, grant: Grant) -> Answer:
        return _json_response(http_codec.statistics_to_json(grant.filter(await self.core.statistics("", ""))))

    async def infer(self, request: Request, p: Params, grant: Grant | None) -> Answer:
        name, version = p["m"], p["v"]
        # (Request.header's first case in line: no name repeated, the one value is the first; its
        # three calls were ~1% of the gateway's Python profile, "Session 15")
        lower = request.lower
        single = len(lower) == len(request.fields)
        header_length = http_codec.parse_header_length(
            lower.get("inference-header-content-length") if single else request.header("inference-header-content-length"))
        # Before a byte of the body is read: the key (401 without a valid one, when there are
        # tenants; the model and quota rules follow at admission) and, for a large body, room in
        # the admission gate.
        ctx = RequestContext("http", _context_headers(request))  # (positional: see grpc_frontend._context)
        self.core.authorize(Op.SERVER_METADATA, "", ctx)  # (its rule: any valid key)
        if (door := self.door) is not None and (refused := door(name, ctx)) is not None:
            raise refused  # (a caller past its share, refused before its body is read: gateway/core.py)
        length_text = lower.get("content-length") if single else request.header("content-length")
        if length_text is not None and (length := int(length_text)) > SMALL_BODY_BYTES:  # (llhttp checked the number)
            gate = admission.gate
            if gate.requests >= gate.max_requests or (gate.bytes + length > gate.max_bytes and gate.requests):
                raise gate.refuse(name, 1, length)
        body = request.complete_body()
        if body is None:
            body = await request.read_body()
        plan: http_codec.RenderPlan | None = None
        raw: bytes | None = None  # the request serialized, when the codec made it so (a gateway forwards it)
        nbytes = sum(map(len, body))
        # _decode's first case without its coroutine (and _inline, _joined in line): every request's path
        if header_length == 0:  # Triton's raw binary request: the input's metadata from the model's config
            config = (await self.core.model_config(name, version)).config
            infer_request = http_codec.raw_binary_request(_joined(body), config, name, version)
        elif (nbytes if header_length is None else header_length) <= body_worker.OFFLOAD_BYTES:
            infer_request, plan, raw = http_codec.parse_infer(body[0] if len(body) == 1 else b"".join(body),
                                                              header_length, name, version,
                                                              self.forwards and self.forwarded(name))
        else:
            infer_request = await _decode(request, http_codec.parse_infer_request, body, header_length, name, version,
                                          size=header_length)
        ctx.raw = raw
        ctx.nbytes = nbytes
        uses_shm = plan.shared_memory if plan is not None else shm.uses_shared_memory(infer_request)
        # a client that leaves now cancels this handler, and so the request in the core (its
        # queued entry leaves the queue, a running model sees is_cancelled(), a gateway tells
        # its service): the connection's connection_lost (the server cancels no other handler)
        request.cancel_on_loss = True
        try:
            if self.hit is not None and not uses_shm and (hit := self.hit(infer_request, ctx)) is not None:
                result, span = InferResult(raw=hit if hit.__class__ is bytes else await hit), None
            elif uses_shm or (admitted := observe.admitted(infer_request, ctx)) is None:
                result, span = await (shm.infer if uses_shm else observe.infer)(self.core, infer_request, ctx)
            else:  # observe.infer's common path, in this coroutine (one fewer per request)
                try:
                    result, span = await self.core.infer(infer_request, ctx), None
                except Exception as exc:
                    raise observe.failed(infer_request, ctx, exc) from None
                finally:
                    observe.release(admitted)
        finally:
            request.cancel_on_loss = False
        held = result.held_raw  # (a gateway's answer as its service sent it: rendered from its bytes)
        if (len(held) if held is not None else result.message().ByteSize()) > body_worker.OFFLOAD_BYTES \
                and not http_codec.all_binary(infer_request) \
                and http_codec.json_output_bytes(result.message(), infer_request) > body_worker.OFFLOAD_BYTES:
            out_body, headers = await self._render_off_loop(request, result, infer_request)
        else:
            rendered = http_codec.render_infer_raw(held, infer_request, plan) \
                if held is not None and plan is not None else None
            if rendered is not None:  # (bytes with no parameters: no A/B arm below)
                out_body, headers = rendered
            else:
                message = result.message()
                out_body, headers = http_codec.render_infer_response(message, infer_request, plan)
                _route_arm(message, headers)
        if span is not None:
            headers["traceparent"] = span.traceparent()
        accept = lower.get("accept-encoding") if single else request.header("accept-encoding")
        if accept:
            if len(out_body) <= deflate.INLINE_BYTES:
                out_body, encoding = http_codec.encode_body(out_body, accept)
            else:  # off this loop, in the line of the request's tenant (meshserve/server/deflate.py)
                who = request.caller()
                out_body, encoding = await deflate.deflater().encode(
                    out_body, accept, *(() if who is None else (who[0], who[1])))
            if encoding:
                headers["Content-Encoding"] = encoding
        return Answer(out_body, headers)

    @staticmethod
    async def _render_off_loop(request: Request, result: InferResult, infer_request: pb.ModelInferRequest
                               ) -> tuple[bytes, dict[str, str]]:
        """An answer with much to write as JSON (an element is ~10 bytes of text and a number's
        formatting, in C calls that hold the GIL: 15 million floats held a front door's loop
        for 1.3-2 s), rendered by the body worker, in the line of the request's tenant
        (docs/security.md, "Session 23: answers written as JSON")."""
        out_body, headers = await _in_worker(request, "render_answer", result.serialized(),
                                             http_codec.rendering_request(infer_request))
        _route_arm(result.message(), headers)
        return out_body, headers

    async def generate(self, request: Request, p: Params, grant: Grant) -> Answer | Stream:
        return await self._generate(request, p["m"], p["v"], False)

    async def generate_stream(self, request: Request, p: Params, grant: Grant) -> Answer | Stream:
        return await self._generate(request, p["m"], p["v"], True)

    async def _generate(self, request: Request, name: str, version: str, stream: bool) -> Answer | Stream:
        """Triton's generate extension (meshserve.protocol.generate_codec): the model's answers
        through ``core.infer_stream``. /generate answers one JSON object and needs exactly one
        response; /generate_stream sends every response as a server-sent event. An error before
        the first response is a JSON error with its status; one after it is an error event (the
        status is already sent: Triton's rule, so a client must look for error events)."""
        core = self.core
        ctx = RequestContext(protocol="http", headers=_context_headers(request))
        if (door := self.door) is not None and (refused := door(name, ctx)) is not None:
            raise refused  # (a caller past its share, refused before its body is read: gateway/core.py)
        body = await request.read_body()
        metadata = await core.model_metadata(name, version)
        infer_request = await _decode(request, generate_codec.parse_generate_request, body, name, version,
                                      metadata.SerializeToString())
        ctx.nbytes = sum(map(len, body))
        answers = observe.infer_stream(core, infer_request, ctx)
        # the model's work stops when the connection is lost (the answers' generator is
        # closed: the core stops the request)
        work: asyncio.Future[Answer | Stream] = asyncio.ensure_future(
            self._generate_one(request, answers, infer_request) if not stream
            else self._generate_events(request, answers, infer_request))
        lost = request.lost()
        try:
            await asyncio.wait((work, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            await answers.aclose()
        if not work.done() or work.cancelled() or isinstance(work.exception(), ConnectionError):
            raise asyncio.CancelledError  # the client is gone: nothing to answer (as a cancelled handler)
        try:
            return work.result()
        finally:
            # (a failed task holds its error, whose traceback holds this frame and the request's
            # body: no local keeps it, docs/security.md, "Session 11: error cycles")
            del work

    @staticmethod
    async def _generate_events(request: Request, answers: Any, infer_request: Any) -> Stream:
        events: Stream | None = None
        try:
            async for result, _final in answers:
                if result is None:
                    continue
                event = generate_codec.sse_event(await _generate_body(request, result, infer_request))
                if events is None:
                    events = await request.stream(200, dict(_EVENTS))
                await events.write(event)
        except InferError as exc:
            if events is None:  # the first answer is the error: its status, as an event
                events = await request.stream(exc.http_status, dict(_EVENTS))
            await events.write(generate_codec.sse_error(exc.message))
        if events is None:  # no response at all: an empty event stream
            events = await request.stream(200, dict(_EVENTS))
        await events.end()
        return events

    @staticmethod
    async def _generate_one(request: Request, answers: Any, infer_request: Any) -> Answer:
        results = []
        async for result, _final in answers:
            if result is not None:
                results.append(result)
        if len(results) != 1:
            raise InferError.invalid(generate_codec.NOT_ONE_RESPONSE)
        return Answer(await _generate_body(request, results[0], infer_request), dict(_JSON_TYPE))

    async def trace_setting(self, request: Request, p: Params, grant: Grant) -> Answer:
        """GET/POST /v2[/models/{m}]/trace/setting (the trace extension)."""
        changes = await _decode(request, http_codec.parse_trace_settings, await request.read_body()) \
            if request.method == "POST" else None
        return _json_response(http_codec.trace_settings_to_json(
            await observe.trace_setting(self.core, p.get("m", ""), changes)))

    async def log_setting(self, request: Request, p: Params, grant: Grant) -> Answer:
        """GET/POST /v2/logging (the logging extension)."""
        changes = await _decode(request, http_codec.parse_json_object, await request.read_body(), "log settings") \
            if request.method == "POST" else None
        return _json_response(await observe.log_setting(self.core, changes))

    async def placement(self, request: Request, p: Params, grant: Grant) -> Answer:
        """GET /v2/placement: where each model lives (a gateway's model mesh: docs/model-mesh.md)."""
        view = getattr(self.core, "placement_view", None)  # (a gateway's; None: no placement policy)
        if view is None or (answer := await view()) is None:
            raise InferError.not_found("no model placement here: a gateway with --model-control-mode lazy has one")
        return _json_response(answer)

    # the shared-memory extensions (the caller's tenant's regions only)
    async def _shm_status(self, kind: str, request: Request, p: Params, grant: Grant) -> Answer:
        regions = shm.registry.status(grant.tenant, p["n"], kind)
        return _json_response(shm.system_status_json(regions) if kind == shm.SYSTEM else shm.cuda_status_json(regions))

    async def _shm_register(self, kind: str, request: Request, p: Params, grant: Grant) -> Answer:
        # (a body over 64 KiB, which no register needs, is read in the body worker: _decode)
        body = await request.read_body()
        if kind == shm.SYSTEM:
            shm.registry.register_system(grant.tenant, p["n"],
                                         *await _decode(request, http_codec.parse_system_shm_register, body))
        else:
            shm.registry.register_cuda(grant.tenant, p["n"],
                                       *await _decode(request, http_codec.parse_cuda_shm_register, body))
        return _empty(200)

    async def _shm_unregister(self, kind: str, request: Request, p: Params, grant: Grant) -> Answer:
        await request.read_body()
        shm.registry.unregister(grant.tenant, p["n"], kind)
        return _empty(200)

    system_shm_status = partialmethod(_shm_status, shm.SYSTEM)
    system_shm_register = partialmethod(_shm_register, shm.SYSTEM)
    system_shm_unregister = partialmethod(_shm_unregister, shm.SYSTEM)
    cuda_shm_status = partialmethod(_shm_status, shm.CUDA)
    cuda_shm_register = partialmethod(_shm_register, shm.CUDA)
    cuda_shm_unregister = partialmethod(_shm_unregister, shm.CUDA)

    # the repository extension (meshserve serves one repository per process: {r} is not read)
    async def repository_index(self, request: Request, p: Params, grant: Grant) -> Answer:
        ready = await _decode(request, http_codec.parse_index_request, await request.read_body())
        idx = grant.filter(await self.core.repository_index(ready))
        return _json_response(http_codec.repository_index_to_json(idx))

    async def load(self, request: Request, p: Params, grant: Grant) -> Answer:
        body = await request.read_body()
        await self.core.load_model(p["m"], await _decode(request, http_codec.parse_load_request, body), self._control(request))
        return _empty(200)

    async def unload(self, request: Request, p: Params, grant: Grant) -> Answer:
        body = await request.read_body()
        await self.core.unload_model(p["m"], await _decode(request, http_codec.parse_unload_request, body),
                                     self._control(request))
        return _empty(200)

    @staticmethod
    def _control(request: Request) -> RequestContext:
        return RequestContext(protocol="http", headers=_context_headers(request), peer=request.remote)


async def start_metrics_server(core: V2Core, host: str, port: int, limits: ServerLimits | None = None
                               ) -> tuple[http1.Http1Server, int]:
    """A /metrics-only endpoint (Triton's :8002 equivalent)."""

    async def handle(request: Request) -> Answer:
        if request.path.rstrip("/") != "/metrics":
            return Answer(b"only /metrics is served on this port", {"Content-Type": "text/plain; charset=utf-8"}, 404)
        try:
            core.authorize(Op.METRICS, "", RequestContext(protocol="http", headers=_context_headers(request)))
        except InferError as exc:
            return _error_response(exc)
        body, ctype = await core.metrics_text()
        return Answer(body, {"Content-Type": ctype})

    return await http1.start(handle, host, port, limits or ServerLimits())


async def start_http_server(core: V2Core, host: str, port: int,
                            limits: ServerLimits | None = None) -> tuple[http1.Http1Server, int]:
    """Start the REST server on the running loop; returns (server, bound port)."""
    limits = limits or ServerLimits()
    return await http1.start(HttpFrontend(core).answer, host, port, limits, tls.acceptor(limits, "http"))
