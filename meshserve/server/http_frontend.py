"""HTTP/REST front end: the KServe v2 REST API + Triton extensions over any V2Core.

aiohttp's low-level server with our own path dispatch (no framework router on the infer
hot path). Bodies are parsed and rendered only by meshserve.protocol.http_codec.

Limits (ServerLimits; docs/security.md): a body over `max_request_bytes` is 413 before it is
read (Content-Length) or as soon as it passes the limit (chunked, or decompressed: this module
reads the body and `http_codec.BodyDecoder` undoes Content-Encoding as it arrives; aiohttp's
own decompression is off). JSON larger than `body_worker.OFFLOAD_BYTES` is decoded in a worker
process. `header_timeout_s` / `read_timeout_s` close connections whose request headers, or a
body a handler waits for, do not arrive in time (one sweep per server, see _Server);
`idle_timeout_s` is aiohttp's keep-alive timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from meshserve.protocol import generate_codec, http_codec, wire
from meshserve.protocol.errors import Code, InferError, internal_error
from meshserve.repository.names import check_version
from meshserve.server import admission, body_worker, connections, http1, observe, shm, tls
from meshserve.server.access import Grant, Op
from meshserve.server.core import RequestContext, V2Core
from meshserve.server.limits import LISTEN, ServerLimits

log = logging.getLogger("meshserve.http")

_JSON = "application/json"


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                        content_type=_JSON)


def _error_response(exc: InferError, extra_headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(extra_headers or {})
    if (retry_after := exc.retry_after_header) is not None:
        headers["Retry-After"] = retry_after
    return web.Response(body=http_codec.error_body(exc.message), status=exc.http_status,
                        content_type=_JSON, headers=headers)


def _empty(status: int = 200) -> web.Response:
    return web.Response(status=status, content_type="text/plain")


SMALL_BODY_BYTES = 1 << 16  # a body of at most this many bytes with a Content-Length is read in one go


class ReceiveBudget:
    """Bytes of HTTP request bodies received (beyond SMALL_BODY_BYTES each) and not yet answered,
    process-wide, against --max-receive-bytes: counted as they arrive, before decoding and
    admission, and given back when the request's answer is done (`HttpFrontend.answer`)."""

    __slots__ = ("limit", "used")

    def __init__(self) -> None:
        self.limit = 0  # 0: unbounded
        self.used = 0

    def charge(self, n: int) -> None:
        """n more bytes held by the running request; 429 + Retry-After when they do not fit."""
        if self.limit and self.used + n > self.limit:
            raise InferError.exhausted(
                f"server busy: {self.used} bytes of request bodies being received (limit --max-receive-bytes "
                f"{self.limit}); this body's {n} more do not fit, retry later", retry_after_s=admission.RETRY_AFTER_S)
        self.used += n
        held = _held.get()
        if held is None:
            _held.set(held := [0])
        held[0] += n


RECEIVING = ReceiveBudget()
# the bytes the request running in this task holds in RECEIVING (set on its first charge)
_held: ContextVar[list[int] | None] = ContextVar("meshserve_http_body_held", default=None)


def _release_held() -> None:
    held = _held.get()
    if held is not None:
        RECEIVING.used -= held[0]
        _held.set(None)


async def _read_body(request: web.BaseRequest, limit: int) -> list[bytes]:
    """The request body's chunks, decompressed, at most `limit` bytes on the wire and after decoding.

    Read chunk by chunk as it arrives: an announced Content-Length over the limit is refused
    before a byte of the body is read, a chunked or compressed body as soon as it passes the
    limit (TOO_LARGE: 413, and the connection is closed). An unsupported Content-Encoding is
    415 before reading; a malformed or truncated compressed body 400."""
    encoding = _header(request, "content-encoding")
    # (no decoder object for the common plain body: the fast path below stays a few attribute reads)
    decoder = http_codec.BodyDecoder(encoding, limit) if encoding else None
    plain = decoder is None or decoder.identity
    length = request.content_length
    if length is not None and length > limit:
        raise InferError.too_large(
            f"request body of {length} bytes exceeds the {limit}-byte limit (--max-request-bytes)")
    expect = _header(request, "expect")
    if expect is not None and expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits 1 s for it
    conn = request.protocol
    if isinstance(conn, _Connection):
        conn.reading = True
        conn.reading_since = conn._loop.time()
    content = request.content
    # Kept as chunks: a large JSON body goes to the body worker chunk by chunk, never joined here
    # (a join of 64 MiB page-faults a fresh buffer in one go: ~30 ms measured, all on the loop).
    chunks: list[bytes] = []
    wire_size = 0
    try:
        if length is not None and plain and length <= SMALL_BODY_BYTES:
            # the common case, a small plain body of known length: one read (aiohttp holds the
            # parser to Content-Length), not the chunk loop below (measured ~2 µs a request)
            return [await content.read()]
        if length is not None:  # all of it must fit (refused before it is read)
            RECEIVING.charge(length)
            charged = length
        else:
            charged = 0
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            wire_size += len(chunk)
            if wire_size > limit:
                raise InferError.too_large(f"request body exceeds the {limit}-byte limit (--max-request-bytes)")
            if wire_size > charged:  # (chunked: as it comes)
                RECEIVING.charge(wire_size - charged)
                charged = wire_size
            if decoder is None or plain:  # (plain already says it; mypy needs the None test)
                chunks.append(chunk)
                continue
            for n, piece in enumerate(decoder.feed(chunk)):  # bounded slices: let other requests run
                if n:
                    await asyncio.sleep(0)
                chunks.append(piece)
        if decoder is not None:
            decoder.finish()
    except (RequestPayloadError, HttpProcessingError) as exc:  # aiohttp's parser on a broken body
        raise InferError.invalid(f"malformed request body: {exc}") from None
    finally:
        if isinstance(conn, _Connection):
            conn.reading = False
            if wire_size > body_worker.TRIM_AFTER_BYTES:
                conn.trim_heap = True  # read or refused: see HttpFrontend.answer
    return chunks


def _header(request: web.BaseRequest, name: str) -> str | None:
    """A request header's (first) value; ``name`` in lower case."""
    if type(request) is http1.Request:
        return request.header(name)
    return request.headers.get(name)


def _joined(chunks: list[bytes]) -> bytes:
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _context_headers(request: web.BaseRequest) -> dict[str, str]:
    """The request's headers for the core, as valid text: aiohttp keeps bytes that are not UTF-8
    as lone surrogates, which no gRPC metadata or protobuf field can carry (a `tracestate` of
    such bytes was a 500 on a tracing gateway); they become U+FFFD."""
    items = request.lower.items() if type(request) is http1.Request else \
        ((k.lower(), v) for k, v in request.headers.items())
    return {k: v if v.isascii() else v.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            for k, v in items}


def _inline(chunks: list[bytes], size: int | None = None) -> bool:
    """Is the JSON to decode (`size`, default the whole body) small enough for this loop?"""
    return (sum(map(len, chunks)) if size is None else size) <= body_worker.OFFLOAD_BYTES


async def _decode(fn: Any, chunks: list[bytes], *args: Any, size: int | None = None) -> Any:
    """fn(body, *args) (an http_codec parser): in place when the JSON to decode is small
    (_inline), else in the body worker process, off this event loop."""
    if _inline(chunks, size):
        return fn(_joined(chunks), *args)
    return await body_worker.worker().call(fn.__name__, chunks, *args)


def _lost(request: web.BaseRequest) -> asyncio.Future[None]:
    """Resolved when the request's connection is lost."""
    conn = request.protocol
    if not isinstance(conn, _Connection | http1.server.Connection):  # (both keep `lost` and `transport`)
        return asyncio.get_running_loop().create_future()  # (never resolves)
    if conn.lost is None:
        conn.lost = asyncio.get_running_loop().create_future()
        if conn.transport is None or conn.transport.is_closing():
            conn.lost.set_result(None)
    return conn.lost


def _allow(core: V2Core, request: web.BaseRequest, op: Op, model: str = "") -> Grant:
    """The core's verdict on ``op`` (meshserve.server.access) for this request's key."""
    return core.authorize(op, model, RequestContext(protocol="http", headers=_context_headers(request)))


class HttpFrontend:
    """Dispatches v2 REST paths to a V2Core."""

    INFER_ROUTES_MAX = 1024

    def __init__(self, core: V2Core, limits: ServerLimits | None = None):
        self.core = core
        limits = limits or ServerLimits()
        self.max_body = limits.max_request_bytes
        RECEIVING.limit = limits.max_receive_bytes  # (process-wide: every front end of a process has the same)
        # raw path (query included) -> (model, version) of a POST that _dispatch found to be an
        # infer route: the next POST to that path goes to _infer without the path's parsing
        # (at most INFER_ROUTES_MAX paths, all dropped when full)
        self.infer_routes: dict[str, tuple[str, str]] = {}

    async def _body(self, request: web.BaseRequest) -> list[bytes]:
        return await _read_body(request, self.max_body)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The answer to one request, as an aiohttp response (aiohttp's server: `_Server`)."""
        conn = request.protocol
        if isinstance(conn, _Connection):
            conn.header_since = 0.0  # this request's headers are in (see _Connection)
            if conn.pipeline_paused and len(conn._messages) <= http1.server.PIPELINE_LOW:
                conn.resume_pipeline()
        response = await self.answer(request)
        return response.to_response() if isinstance(response, http1.Answer) else response

    async def answer(self, request: web.BaseRequest) -> web.StreamResponse | http1.Answer:
        """The answer to one request: the infer route's is an `http1.Answer` (what the httptools
        server writes without an aiohttp response; `handle` converts it for aiohttp's server)."""
        conn = request.protocol
        try:
            if request.method == "POST" and (route := self.infer_routes.get(request.raw_path)) is not None:
                return await self._infer(request, *route)
            return await self._dispatch(request)
        except InferError as exc:
            response = _error_response(exc)
            if exc.code is Code.TOO_LARGE:
                response.force_close()  # the rest of the body is not read: this connection ends
            return response
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never a crash; report and keep serving
            log.exception("internal error serving %s %s", request.method, request.path)
            return _error_response(internal_error(exc))
        finally:
            _release_held()  # the body bytes it held in RECEIVING (one lookup for a small request)
            if isinstance(conn, _Connection) and conn.trim_heap:  # a large body was read (_read_body)
                conn.trim_heap = False
                loop = asyncio.get_running_loop()  # once this request's buffers are gone
                loop.call_later(0.05, loop.run_in_executor, None, body_worker.release_memory)

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse | http1.Answer:
        path = request.raw_path.split("?", 1)[0]
        parts = [unquote(p) for p in path.strip("/").split("/")]
        method = request.method
        core = self.core
        if parts[0] == "metrics" and len(parts) == 1:
            _allow(core, request, Op.METRICS)
            body, ctype = await core.metrics_text()
            return web.Response(body=body, headers={"Content-Type": ctype})
        if not parts or parts[0] != "v2":
            raise InferError.not_found(f"no route for {method} {path}")
        n = len(parts)
        if n == 1:
            self._method(request, "GET")
            _allow(core, request, Op.SERVER_METADATA)
            return _json_response(http_codec.server_metadata_to_json(core.server_metadata()))
        head = parts[1]
        if head == "health" and n == 3 and parts[2] in ("live", "ready"):
            # 200 {"live": true} / {"ready": true}, else 503 with false: tritonclient reads the
            # status, the KServe SDK's InferenceRESTClient the JSON body
            self._method(request, "GET")
            state = core.live() if parts[2] == "live" else core.ready()
            return _json_response({parts[2]: state}, 200 if state else 503)
        if head == "models":
            return await self._models(request, parts[2:])
        if head == "repository":
            return await self._repository(request, parts[2:])
        if head in ("systemsharedmemory", "cudasharedmemory"):
            return await self._shared_memory(request, shm.SYSTEM if head[0] == "s" else shm.CUDA, parts[2:])
        if head == "trace" and parts[2:] == ["setting"]:
            return await self._trace_setting(request, "")
        if head == "placement" and n == 2:  # the model mesh at a gateway (docs/model-mesh.md)
            self._method(request, "GET")
            _allow(core, request, Op.PLACEMENT)
            view = getattr(core, "placement_view", None)  # (a gateway's; None: no placement policy)
            if view is None or (answer := await view()) is None:
                raise InferError.not_found("no model placement here: a gateway with --model-control-mode lazy has one")
            return _json_response(answer)
        if head == "logging" and n == 2:  # the logging extension
            self._method(request, "GET", "POST")
            _allow(core, request, Op.LOG_UPDATE if request.method == "POST" else Op.LOG_GET)
            changes = await _decode(http_codec.parse_json_object, await self._body(request), "log settings") \
                if request.method == "POST" else None
            return _json_response(observe.log_setting(changes))
        raise InferError.not_found(f"no route for {method} {path}")

    @staticmethod
    def _method(request: web.BaseRequest, *allowed: str) -> None:
        if request.method not in allowed:
            raise InferError.invalid(f"method {request.method} not allowed on {request.path}; "
                                     f"use {' or '.join(allowed)}")

    async def _models(self, request: web.BaseRequest, rest: list[str]) -> web.StreamResponse | http1.Answer:
        core = self.core
        if rest == ["stats"]:
            self._method(request, "GET")
            grant = _allow(core, request, Op.ALL_STATISTICS)
            return _json_response(http_codec.statistics_to_json(grant.filter(await core.statistics("", ""))))
        if not rest or not rest[0]:
            raise InferError.not_found("no model name in the path")
        name, tail, version = rest[0], rest[1:], ""
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = check_version(tail[1], name), tail[2:]
        action = tail[0] if tail else ""
        if tail == ["trace", "setting"] and not version:
            return await self._trace_setting(request, name)
        if len(tail) > 1:
            raise InferError.not_found(f"no route for {request.method} {request.path}")
        if action == "infer":
            self._method(request, "POST")
            routes = self.infer_routes
            if len(routes) >= self.INFER_ROUTES_MAX:
                routes.clear()
            routes[request.raw_path] = (name, version)
            return await self._infer(request, name, version)
        if action in ("generate", "generate_stream"):
            self._method(request, "POST")
            return await self._generate(request, name, version, action == "generate_stream")
        if action == "":
            self._method(request, "GET")
            _allow(core, request, Op.MODEL_METADATA, name)
            return _json_response(http_codec.model_metadata_to_json(await core.model_metadata(name, version)))
        if action == "ready":
            self._method(request, "GET")
            _allow(core, request, Op.MODEL_READY, name)
            if await core.model_ready(name, version):
                return _empty(200)
            return web.Response(body=http_codec.error_body("Model version not ready"), status=400,
                                content_type=_JSON)
        if action == "config":
            self._method(request, "GET")
            _allow(core, request, Op.MODEL_CONFIG, name)
            cfg = await core.model_config(name, version)
            return _json_response(http_codec.model_config_to_json(cfg.config))
        if action == "stats":
            self._method(request, "GET")
            _allow(core, request, Op.MODEL_STATISTICS, name)
            return _json_response(http_codec.statistics_to_json(await core.statistics(name, version)))
        raise InferError.not_found(f"no route for {request.method} {request.path}")

    async def _infer(self, request: web.BaseRequest, name: str, version: str) -> http1.Answer:
        header_length = http_codec.parse_header_length(_header(request, "inference-header-content-length"))
        # Before a byte of the body is read: the key (401 without a valid one, when there are
        # tenants; the model and quota rules follow at admission) and, for a large body, room in
        # the admission gate.
        ctx = RequestContext(protocol="http", headers=_context_headers(request))
        self.core.authorize(Op.SERVER_METADATA, "", ctx)  # (its rule: any valid key)
        length = request.content_length
        if length is not None and length > SMALL_BODY_BYTES:
            gate = admission.gate
            if gate.requests >= gate.max_requests or (gate.bytes + length > gate.max_bytes and gate.requests):
                raise gate.refuse(name, 1, length)
        body = await _read_body(request, self.max_body)
        plan: http_codec.RenderPlan | None = None
        raw: bytes | None = None  # the request serialized, when the codec made it so (a gateway forwards it)
        if _inline(body, header_length):  # _decode's first case without its coroutine: every request's path
            infer_request, plan, raw = http_codec.parse_infer(_joined(body), header_length, name, version)
        else:
            infer_request = await _decode(http_codec.parse_infer_request, body, header_length, name, version,
                                          size=header_length)
        ctx.raw = raw
        ctx.nbytes = sum(map(len, body))
        uses_shm = plan.shared_memory if plan is not None else shm.uses_shared_memory(infer_request)
        # a client that leaves now cancels this handler, and so the request in the core (its
        # queued entry leaves the queue, a running model sees is_cancelled(), a gateway tells
        # its service): the connections' connection_lost (neither server cancels handlers itself)
        conn: Any = request.protocol  # (_Connection or http1's Connection: both have cancel_on_loss)
        conn.cancel_on_loss = True
        try:
            result, span = await (shm.infer if uses_shm else observe.infer)(self.core, infer_request, ctx)
        finally:
            conn.cancel_on_loss = False
        message = result.message()
        out_body, headers = http_codec.render_infer_response(message, infer_request, plan)
        if message.parameters:
            arm = message.parameters.get(wire.ROUTE_ARM_PARAMETER)  # the gateway's A/B routes
            if arm is not None:
                headers[wire.ROUTE_ARM_HEADER] = arm.string_param
        if span is not None:
            headers["traceparent"] = span.traceparent()
        accept = _header(request, "accept-encoding")
        if accept:
            out_body, encoding = http_codec.encode_body(out_body, accept)
            if encoding:
                headers["Content-Encoding"] = encoding
        return http1.Answer(out_body, headers)

    async def _generate(self, request: web.BaseRequest, name: str, version: str,
                        stream: bool) -> web.StreamResponse:
        """Triton's generate extension (meshserve.protocol.generate_codec): the model's answers
        through ``core.infer_stream``. /generate answers one JSON object and needs exactly one
        response; /generate_stream sends every response as a server-sent event. An error before
        the first response is a JSON error with its status; one after it is an error event (the
        status is already sent: Triton's rule, so a client must look for error events)."""
        core = self.core
        _allow(core, request, Op.GENERATE, name)
        body = await _read_body(request, self.max_body)
        metadata = await core.model_metadata(name, version)
        infer_request = await _decode(generate_codec.parse_generate_request, body, name, version,
                                      metadata.SerializeToString())
        ctx = RequestContext(protocol="http", headers=_context_headers(request), nbytes=sum(map(len, body)))
        answers = observe.infer_stream(core, infer_request, ctx)
        # aiohttp does not cancel a handler whose client left: the model's work stops when the
        # connection is lost (the answers' generator is closed: the core stops the request)
        work = asyncio.ensure_future(self._generate_one(answers, infer_request) if not stream
                                     else self._generate_events(request, answers, infer_request))
        lost = _lost(request)
        try:
            await asyncio.wait((work, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            await answers.aclose()
        if not work.done() or work.cancelled() or isinstance(work.exception(), ConnectionError):
            raise asyncio.CancelledError  # the client is gone: nothing to answer (as a cancelled handler)
        return work.result()

    async def _generate_events(self, request: web.BaseRequest, answers: Any, infer_request: Any
                               ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        try:
            async for result, _final in answers:
                if result is None:
                    continue
                event = generate_codec.sse_event(generate_codec.render_generate_response(result.message(), infer_request))
                if response is None:
                    response = await self._event_stream(request, 200)
                await response.write(event)
        except InferError as exc:
            if response is None:  # the first answer is the error: its status, as an event
                response = await self._event_stream(request, exc.http_status)
            await response.write(generate_codec.sse_error(exc.message))
        if response is None:  # no response at all: an empty event stream
            response = await self._event_stream(request, 200)
        await response.write_eof()
        return response

    @staticmethod
    async def _generate_one(answers: Any, infer_request: Any) -> web.StreamResponse:
        results = []
        async for result, _final in answers:
            if result is not None:
                results.append(result)
        if len(results) != 1:
            raise InferError.invalid(generate_codec.NOT_ONE_RESPONSE)
        return web.Response(body=generate_codec.render_generate_response(results[0].message(), infer_request),
                            content_type=_JSON)

    @staticmethod
    async def _event_stream(request: web.BaseRequest, status: int) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"Content-Type": generate_codec.EVENT_STREAM_CONTENT_TYPE,
                                                              "Cache-Control": "no-cache"})
        await response.prepare(request)
        return response

    async def _trace_setting(self, request: web.BaseRequest, model: str) -> web.StreamResponse:
        """GET/POST /v2[/models/{m}]/trace/setting (the trace extension)."""
        self._method(request, "GET", "POST")
        post = request.method == "POST"
        _allow(self.core, request, (Op.MODEL_TRACE_UPDATE if post else Op.MODEL_TRACE_GET) if model
               else (Op.TRACE_UPDATE if post else Op.TRACE_GET), model)
        changes = await _decode(http_codec.parse_trace_settings, await self._body(request)) if post else None
        return _json_response(http_codec.trace_settings_to_json(
            await observe.trace_setting(self.core, model, changes)))

    async def _shared_memory(self, request: web.BaseRequest, kind: str, rest: list[str]) -> web.StreamResponse:
        """/v2/{system,cuda}sharedmemory[/region/{n}]/status|unregister and .../region/{n}/register
        (the shared-memory extensions; the caller's tenant's regions only)."""
        name = ""
        if len(rest) == 3 and rest[0] == "region" and rest[1]:
            name, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else ""
        if action not in ("status", "register", "unregister") or (action == "register" and not name):
            raise InferError.not_found(f"no route for {request.method} {request.path}")
        registry = shm.registry
        if action == "status":
            self._method(request, "GET")
            tenant = _allow(self.core, request, Op.SHM_STATUS).tenant
            regions = registry.status(tenant, name, kind)
            return _json_response(shm.system_status_json(regions) if kind == shm.SYSTEM
                                  else shm.cuda_status_json(regions))
        self._method(request, "POST")
        tenant = _allow(self.core, request, Op.SHM_REGISTER if action == "register" else Op.SHM_UNREGISTER).tenant
        body = _joined(await self._body(request))
        if action == "unregister":
            registry.unregister(tenant, name, kind)
        elif kind == shm.SYSTEM:
            registry.register_system(tenant, name, *http_codec.parse_system_shm_register(body))
        else:
            registry.register_cuda(tenant, name, *http_codec.parse_cuda_shm_register(body))
        return _empty(200)

    async def _repository(self, request: web.BaseRequest, rest: list[str]) -> web.StreamResponse:
        # /v2/repository[/{repo}]/index and /v2/repository[/{repo}]/models/{m}/load|unload
        self._method(request, "POST")
        if rest and rest[0] not in ("index", "models"):
            rest = rest[1:]  # a repository name; meshserve serves one repository per process
        ctx = RequestContext(protocol="http", headers=_context_headers(request), peer=request.remote)
        if rest == ["index"]:
            grant = _allow(self.core, request, Op.REPOSITORY_INDEX)
            ready = await _decode(http_codec.parse_index_request, await self._body(request))
            idx = grant.filter(await self.core.repository_index(ready))
            return _json_response(http_codec.repository_index_to_json(idx))
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            _allow(self.core, request, Op.REPOSITORY_LOAD if rest[2] == "load" else Op.REPOSITORY_UNLOAD, rest[1])
            body = await self._body(request)
            if rest[2] == "load":
                await self.core.load_model(rest[1], await _decode(http_codec.parse_load_request, body), ctx)
            else:
                await self.core.unload_model(rest[1], await _decode(http_codec.parse_unload_request, body), ctx)
            return _empty(200)
        raise InferError.not_found(f"no route for {request.method} {request.path}")


_received = RequestHandler.data_received


class _Connection(RequestHandler):
    """aiohttp's connection handler plus what the header and read timeouts need: a count of
    data arrivals and when the headers of the next request started to arrive."""

    __slots__ = ("rx", "rx_seen", "quiet_since", "header_since", "reading", "reading_since", "trim_heap", "lost",
                 "counted", "pipeline_paused", "cancel_on_loss")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rx = 0  # data_received calls so far
        self.rx_seen = 0  # ... when the sweep last looked
        self.quiet_since = 0.0  # sweep time since which no data arrived
        self.header_since = 0.0  # when the pending request's first bytes came; 0: none pending
        self.reading = False  # a handler is waiting for this connection's body
        self.reading_since = 0.0  # ... since then (--body-timeout-s)
        self.counted = False  # in connections.TABLE
        self.pipeline_paused = False  # reading paused: too many pipelined requests wait (data_received)
        self.trim_heap = False  # a large body was read: the heap goes back to the OS after its request
        self.lost: asyncio.Future[None] | None = None  # made by a handler that waits on the model (_lost)
        self.cancel_on_loss = False  # the handler waits on the core: a lost connection cancels it (_infer)

    def connection_lost(self, exc: BaseException | None) -> None:
        # (aiohttp's handler_cancellation, for the infer route only)
        handler = getattr(self, "_task_handler", None) if self.cancel_on_loss else None
        super().connection_lost(exc)
        if handler is not None:
            handler.cancel()
        if self.counted:
            self.counted = False
            connections.TABLE.closed(self)
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.header_since = self.quiet_since = self._loop.time()  # a silent new connection is a slow header
        if not connections.TABLE.opened(self):  # at --max-connections: refused at once
            transport.close()
            return
        self.counted = True

    def resume_pipeline(self) -> None:
        self.pipeline_paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def evict(self) -> bool:
        """Closed to make room for a new connection when no request is in progress."""
        if self._request_in_progress or self._messages or self.transport is None:
            return False
        self.force_close()
        return True

    def data_received(self, data: bytes) -> None:
        _received(self, data)  # aiohttp's (not super(): this runs for every read)
        self.rx += 1
        if self.counted:
            connections.TABLE.idle_now(self)  # (used now: the last to be closed near the cap)
        if len(self._messages) > http1.server.PIPELINE_MAX and self.transport is not None:
            self.pipeline_paused = True  # (resumed by HttpFrontend.handle as they drain)
            self.transport.pause_reading()
        if self._messages or self._request_in_progress:
            self.header_since = 0.0
        elif not self.header_since and data:
            self.header_since = self._loop.time()

    def check(self, now: float, header_timeout: float, read_timeout: float, body_timeout: float) -> str | None:
        """Why this connection must be closed now, if it must."""
        if self.rx != self.rx_seen:
            self.rx_seen, self.quiet_since = self.rx, now
        if self.reading:
            if read_timeout and now - self.quiet_since >= read_timeout:
                return f"no request body bytes for {read_timeout:g} s (--read-timeout-s)"
            if body_timeout and now - self.reading_since >= body_timeout:
                return f"request body not complete after {body_timeout:g} s (--body-timeout-s)"
        elif self.header_since and not self._request_in_progress and not self._messages:
            if header_timeout and now - self.header_since >= header_timeout:
                return f"request headers incomplete after {header_timeout:g} s (--header-timeout-s)"
        return None


class _Server(web.Server):
    """aiohttp's low-level server with the front door's limits (see the module docstring).

    The header and read timeouts are enforced by ONE periodic sweep over the server's
    connections (every quarter of the smaller timeout, at most once a second), not by a timer
    per request or per chunk: the request path only bumps a counter per data arrival. A
    connection is closed between `timeout` and `timeout + tick` after it fell silent."""

    def __init__(self, handler: Any, limits: ServerLimits) -> None:
        idle = limits.idle_timeout_s
        super().__init__(handler, access_log=None, auto_decompress=False,
                         keepalive_timeout=idle if idle > 0 else 1e9)
        self.limits = limits
        timeouts = [t for t in (limits.header_timeout_s, limits.read_timeout_s, limits.body_timeout_s) if t > 0]
        self.tick = min(1.0, max(0.05, min(timeouts) / 4)) if timeouts else 0.0
        self._sweeper: asyncio.TimerHandle | None = None
        if self.tick:
            self._sweeper = self._loop.call_later(self.tick, self._sweep)

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)

    def _sweep(self) -> None:
        now = self._loop.time()
        limits = self.limits
        header, read, body = limits.header_timeout_s, limits.read_timeout_s, limits.body_timeout_s
        for conn in list(self._connections):
            if isinstance(conn, _Connection) and (why := conn.check(now, header, read, body)):
                log.debug("closing HTTP connection from %s: %s", conn.peername, why)
                conn.force_close()
        self._sweeper = self._loop.call_later(self.tick, self._sweep)

    async def shutdown(self, timeout: float | None = None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await super().shutdown(timeout)


async def start_metrics_server(core: V2Core, host: str, port: int, limits: ServerLimits | None = None
                               ) -> tuple[web.BaseRunner | http1.Http1Server, int]:
    """A /metrics-only endpoint (Triton's :8002 equivalent)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path.rstrip("/") != "/metrics":
            return web.Response(status=404, text="only /metrics is served on this port")
        try:
            _allow(core, request, Op.METRICS)
        except InferError as exc:
            return _error_response(exc)
        body, ctype = await core.metrics_text()
        return web.Response(body=body, headers={"Content-Type": ctype})

    limits = limits or ServerLimits()
    if limits.http_server == "httptools":  # --http-server (meshserve/server/http1)
        return await http1.start(handle, host, port, limits)
    return await _start(_Server(handle, limits), host, port)


async def start_http_server(core: V2Core, host: str, port: int,
                            limits: ServerLimits | None = None) -> tuple[web.BaseRunner | http1.Http1Server, int]:
    """Start the REST server on the running loop; returns (runner, bound port)."""
    limits = limits or ServerLimits()
    if limits.http_server == "httptools":  # --http-server (meshserve/server/http1)
        return await http1.start(HttpFrontend(core, limits).answer, host, port, limits, tls.acceptor(limits, "http"))
    # aiohttp's fallback: its own handshakes, no handshake cap, no reload (docs/security.md, "TLS and mutual TLS")
    return await _start(_Server(HttpFrontend(core, limits).handle, limits), host, port,
                        tls.ssl_context(limits.tls.http, "http"))


async def _start(server: web.Server, host: str, port: int,
                 ssl_context: ssl.SSLContext | None = None) -> tuple[web.BaseRunner, int]:
    runner = web.ServerRunner(server, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=LISTEN.reuse_port, backlog=1024,
                       ssl_context=ssl_context)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound
