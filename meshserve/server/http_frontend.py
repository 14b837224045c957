"""HTTP/REST front end: the KServe v2 REST API + Triton extensions over any V2Core.

aiohttp's low-level server with our own path dispatch (no framework router on the infer
hot path). Bodies are parsed and rendered only by meshserve.protocol.http_codec.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from meshserve.protocol import http_codec, wire
from meshserve.protocol.errors import InferError
from meshserve.server import observe
from meshserve.server.core import RequestContext, V2Core
from meshserve.server.limits import ServerLimits

log = logging.getLogger("meshserve.http")

MAX_BODY_BYTES = 1 << 30  # 1 GiB; larger bodies get 413 naming the limit
_JSON = "application/json"


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                        content_type=_JSON)


def _error_response(exc: InferError, extra_headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(extra_headers or {})
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s + 0.999)))
    return web.Response(body=http_codec.error_body(exc.message), status=exc.http_status,
                        content_type=_JSON, headers=headers)


def _empty(status: int = 200) -> web.Response:
    return web.Response(status=status, content_type="text/plain")


async def _read_body(request: web.BaseRequest) -> bytes:
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise InferError.invalid(f"request body of {length} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    body = await request.content.read()
    if len(body) > MAX_BODY_BYTES:
        raise InferError.invalid(f"request body exceeds the {MAX_BODY_BYTES}-byte limit")
    return http_codec.decode_body(body, request.headers.get("Content-Encoding"))


class HttpFrontend:
    """Dispatches v2 REST paths to a V2Core."""

    def __init__(self, core: V2Core):
        self.core = core

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except InferError as exc:
            return _error_response(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never a crash; report and keep serving
            log.exception("internal error serving %s %s", request.method, request.path)
            return _error_response(InferError.internal(f"internal error: {type(exc).__name__}: {exc}"))

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.raw_path.split("?", 1)[0]
        parts = [unquote(p) for p in path.strip("/").split("/")]
        method = request.method
        core = self.core
        if parts[0] == "metrics" and len(parts) == 1:
            body, ctype = core.metrics_text()
            return web.Response(body=body, headers={"Content-Type": ctype})
        if not parts or parts[0] != "v2":
            raise InferError.not_found(f"no route for {method} {path}")
        n = len(parts)
        if n == 1:
            self._method(request, "GET")
            return _json_response(http_codec.server_metadata_to_json(core.server_metadata()))
        head = parts[1]
        if head == "health" and n == 3:
            self._method(request, "GET")
            if parts[2] == "live":
                return _empty(200 if core.live() else 503)
            if parts[2] == "ready":
                return _empty(200 if core.ready() else 400)
        if head == "models":
            return await self._models(request, parts[2:])
        if head == "repository":
            return await self._repository(request, parts[2:])
        if head == "trace" and parts[2:] == ["setting"]:
            return await self._trace_setting(request, "")
        if head == "logging" and n == 2:  # the logging extension
            self._method(request, "GET", "POST")
            changes = http_codec.parse_json_object(await _read_body(request), "log settings") \
                if request.method == "POST" else None
            return _json_response(observe.log_setting(changes))
        raise InferError.not_found(f"no route for {method} {path}")

    @staticmethod
    def _method(request: web.BaseRequest, *allowed: str) -> None:
        if request.method not in allowed:
            raise InferError.invalid(f"method {request.method} not allowed on {request.path}; "
                                     f"use {' or '.join(allowed)}")

    async def _models(self, request: web.BaseRequest, rest: list[str]) -> web.StreamResponse:
        core = self.core
        if rest == ["stats"]:
            self._method(request, "GET")
            return _json_response(http_codec.statistics_to_json(await core.statistics("", "")))
        if not rest or not rest[0]:
            raise InferError.not_found("no model name in the path")
        name, tail, version = rest[0], rest[1:], ""
        if len(tail) >= 2 and tail[0] == "versions":
            version, tail = tail[1], tail[2:]
            if not version.isdigit():
                raise InferError.invalid(f"model '{name}': version '{version}' is not a number")
        action = tail[0] if tail else ""
        if tail == ["trace", "setting"] and not version:
            return await self._trace_setting(request, name)
        if len(tail) > 1:
            raise InferError.not_found(f"no route for {request.method} {request.path}")
        if action == "infer":
            self._method(request, "POST")
            return await self._infer(request, name, version)
        if action == "":
            self._method(request, "GET")
            return _json_response(http_codec.model_metadata_to_json(await core.model_metadata(name, version)))
        if action == "ready":
            self._method(request, "GET")
            if await core.model_ready(name, version):
                return _empty(200)
            return web.Response(body=http_codec.error_body("Model version not ready"), status=400,
                                content_type=_JSON)
        if action == "config":
            self._method(request, "GET")
            cfg = await core.model_config(name, version)
            return _json_response(http_codec.model_config_to_json(cfg.config))
        if action == "stats":
            self._method(request, "GET")
            return _json_response(http_codec.statistics_to_json(await core.statistics(name, version)))
        raise InferError.not_found(f"no route for {request.method} {request.path}")

    async def _infer(self, request: web.BaseRequest, name: str, version: str) -> web.StreamResponse:
        body = await _read_body(request)
        hlen = request.headers.get("Inference-Header-Content-Length")
        try:
            header_length = int(hlen) if hlen is not None else None
        except ValueError:
            raise InferError.invalid(f"Inference-Header-Content-Length '{hlen}' is not an integer") from None
        infer_request = http_codec.parse_infer_request(body, header_length, name, version)
        ctx = RequestContext(protocol="http", headers={k.lower(): v for k, v in request.headers.items()},
                             nbytes=len(body))
        result, span = await observe.infer(self.core, infer_request, ctx)
        out_body, headers = http_codec.render_infer_response(result.message(), infer_request)
        arm = result.message().parameters.get(wire.ROUTE_ARM_PARAMETER)  # the gateway's A/B routes
        if arm is not None:
            headers[wire.ROUTE_ARM_HEADER] = arm.string_param
        if span is not None:
            headers["traceparent"] = span.traceparent()
        accept = request.headers.get("Accept-Encoding")
        if accept:
            out_body, encoding = http_codec.encode_body(out_body, accept)
            if encoding:
                headers["Content-Encoding"] = encoding
        return web.Response(body=out_body, headers=headers)

    async def _trace_setting(self, request: web.BaseRequest, model: str) -> web.StreamResponse:
        """GET/POST /v2[/models/{m}]/trace/setting (the trace extension)."""
        self._method(request, "GET", "POST")
        changes = http_codec.parse_trace_settings(await _read_body(request)) if request.method == "POST" else None
        return _json_response(http_codec.trace_settings_to_json(
            await observe.trace_setting(self.core, model, changes)))

    async def _repository(self, request: web.BaseRequest, rest: list[str]) -> web.StreamResponse:
        # /v2/repository[/{repo}]/index and /v2/repository[/{repo}]/models/{m}/load|unload
        self._method(request, "POST")
        if rest and rest[0] not in ("index", "models"):
            rest = rest[1:]  # a repository name; meshserve serves one repository per process
        ctx = RequestContext(protocol="http", headers={k.lower(): v for k, v in request.headers.items()})
        if rest == ["index"]:
            body = await _read_body(request)
            ready = False
            if body.strip():
                try:
                    ready = bool(json.loads(body).get("ready", False))
                except (ValueError, AttributeError):
                    raise InferError.invalid("repository index body must be a JSON object") from None
            idx = await self.core.repository_index(ready)
            return _json_response(http_codec.repository_index_to_json(idx))
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            body = await _read_body(request)
            if rest[2] == "load":
                await self.core.load_model(rest[1], http_codec.parse_load_request(body), ctx)
            else:
                await self.core.unload_model(rest[1], http_codec.parse_unload_request(body), ctx)
            return _empty(200)
        raise InferError.not_found(f"no route for {request.method} {request.path}")


async def start_metrics_server(core: V2Core, host: str, port: int) -> tuple[web.BaseRunner, int]:
    """A /metrics-only endpoint (Triton's :8002 equivalent)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path.rstrip("/") != "/metrics":
            return web.Response(status=404, text="only /metrics is served on this port")
        body, ctype = core.metrics_text()
        return web.Response(body=body, headers={"Content-Type": ctype})

    return await _start(web.Server(handle, access_log=None), host, port)


async def start_http_server(core: V2Core, host: str, port: int,
                            limits: ServerLimits | None = None) -> tuple[web.BaseRunner, int]:
    """Start the REST server on the running loop; returns (runner, bound port)."""
    return await _start(web.Server(HttpFrontend(core).handle, access_log=None), host, port)


async def _start(server: web.Server, host: str, port: int) -> tuple[web.BaseRunner, int]:
    runner = web.ServerRunner(server, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=1024)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound
