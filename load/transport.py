"""Senders: pre-encoded payloads over HTTP (JSON / binary extension) and gRPC (unary / stream).

Each `send` returns a status label ("ok" or e.g. "http 404", "grpc NOT_FOUND", "timeout") and
never raises, so the runner records every outcome. gRPC uses raw bytes (no protobuf
serialization on the request path) with meshserve's own method names.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import grpc
import grpc.aio

from load.inputs import Payload
from load.rawhttp import HttpPool, build_request
from load.scenario import Target
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop, wire
from meshserve.server import h2

OK = "ok"
_INFER = "/inference.GRPCInferenceService/ModelInfer"
_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


_STATUS_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _exc_label(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "timeout"
    return f"client {type(exc).__name__}"


class HttpSender:
    def __init__(self, session: aiohttp.ClientSession, base: str, target: Target, api_key: str | None,
                 timeout_s: float):
        v = f"/versions/{target.version}" if target.version else ""
        self.url = f"http://{base}/v2/models/{target.model}{v}/infer"
        self.session = session
        self.binary = target.protocol == "http-binary"
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def send(self, p: Payload) -> str:
        if self.binary:
            headers = {"Inference-Header-Content-Length": str(p.http_binary_header_len),
                       "Content-Type": "application/octet-stream", **self.auth}
            body = p.http_binary
        else:
            headers = {"Content-Type": "application/json", **self.auth}
            body = p.http_json
        try:
            async with self.session.post(self.url, data=body, headers=headers, timeout=self.timeout) as r:
                await r.read()
                return OK if r.status == 200 else f"http {r.status}"
        except Exception as exc:  # every outcome is a recorded status
            return _exc_label(exc)


class RawHttpSender:
    """HTTP over load.rawhttp: requests pre-built to the byte, cached per payload."""

    def __init__(self, pool: HttpPool, base: str, target: Target, api_key: str | None, timeout_s: float):
        v = f"/versions/{target.version}" if target.version else ""
        self.path = f"/v2/models/{target.model}{v}/infer"
        self.host = base
        self.pool = pool
        self.binary = target.protocol == "http-binary"
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout_s
        self.cache: dict[int, bytes] = {}

    def _raw(self, p: Payload) -> bytes:
        raw = self.cache.get(id(p))
        if raw is None:
            if self.binary:
                headers = {"Inference-Header-Content-Length": str(p.http_binary_header_len),
                           "Content-Type": "application/octet-stream", **self.auth}
                raw = build_request(self.host, self.path, p.http_binary, headers)
            else:
                raw = build_request(self.host, self.path, p.http_json,
                                    {"Content-Type": "application/json", **self.auth})
            self.cache[id(p)] = raw
        return raw

    async def send(self, p: Payload) -> str:
        try:
            status = await self.pool.request(self._raw(p), self.timeout)
            return OK if status == 200 else f"http {status}"
        except Exception as exc:
            return _exc_label(exc)


class GrpcSender:
    def __init__(self, channel: grpc.aio.Channel, target: Target, api_key: str | None, timeout_s: float):
        self.call = channel.unary_unary(_INFER, request_serializer=None, response_deserializer=None)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.timeout = timeout_s

    async def send(self, p: Payload) -> str:
        try:
            await self.call(p.grpc, metadata=self.metadata, timeout=self.timeout)
            return OK
        except grpc.aio.AioRpcError as exc:
            return f"grpc {exc.code().name}"
        except Exception as exc:
            return _exc_label(exc)


class H2GrpcSender:
    """Unary ModelInfer on meshserve's own HTTP/2 client: the same bytes on the wire as grpc.aio's
    unary call, at a fraction of its client CPU (which on a small machine competes with the server)."""

    def __init__(self, channel: h2.Channel, target: Target, api_key: str | None, timeout_s: float):
        self.channel = channel
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout_s

    async def send(self, p: Payload) -> str:
        try:
            conn = await self.channel.get()
            await conn.unary(_INFER, p.grpc, self.metadata, self.timeout)
            return OK
        except h2.GrpcError as exc:
            return f"grpc {_STATUS_NAMES.get(exc.code, str(exc.code))}"
        except Exception as exc:
            return _exc_label(exc)


class StreamSender:
    """One bidirectional ModelStreamInfer stream shared by all workers of a target; responses are
    matched to requests by the request id the sender appends to the raw request."""

    def __init__(self, channel: grpc.aio.Channel, target: Target, api_key: str | None, timeout_s: float):
        self.method = channel.stream_stream(_STREAM, request_serializer=None,
                                            response_deserializer=pb.ModelStreamInferResponse.FromString)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.timeout = timeout_s
        self.pending: dict[str, asyncio.Future[str]] = {}
        self.ids = itertools.count()
        self.call: Any = None
        self.reader: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.write_lock = asyncio.Lock()  # grpc.aio allows one outstanding write per stream

    async def _open(self) -> None:
        self.call = self.method(metadata=self.metadata)
        self.reader = asyncio.create_task(self._read(self.call))

    async def _read(self, call: Any) -> None:
        status = "grpc-stream closed"
        try:
            async for resp in call:
                rid = resp.infer_response.id
                fut = self.pending.pop(rid, None)
                if fut is None or fut.done():
                    continue
                if resp.error_message:
                    p = resp.infer_response.parameters.get(hop.ERROR_CODE)
                    code = p.string_param if p is not None and p.string_param else "ERROR"
                    fut.set_result(f"grpc-stream {code}")
                else:
                    fut.set_result(OK)
        except grpc.aio.AioRpcError as exc:
            status = f"grpc {exc.code().name}"
        except Exception as exc:
            status = _exc_label(exc)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(status)
        self.pending.clear()
        self.call = None

    async def send(self, p: Payload) -> str:
        async with self.lock:
            if self.call is None:
                await self._open()
            call = self.call
        rid = f"l{next(self.ids)}"
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            async with self.write_lock:
                await call.write(wire.with_request_id(p.grpc, rid))
            return await asyncio.wait_for(fut, self.timeout)
        except grpc.aio.AioRpcError as exc:
            return f"grpc {exc.code().name}"
        except Exception as exc:
            return _exc_label(exc)
        finally:
            self.pending.pop(rid, None)

    async def close(self) -> None:
        if self.call is not None:
            try:
                await self.call.done_writing()
            except Exception:
                pass
        if self.reader is not None:
            self.reader.cancel()
