"""Infer requests multiplexed over a few long-lived ModelStreamInfer calls per replica.

A message on an open stream costs far less than a unary call, so the gateway -> service hop
uses streams, on meshserve's own HTTP/2 client (meshserve/server/h2/client.py: a request is one
DATA frame in the connection's write buffer, a response goes to a callback from the frame
loop). Requests are matched to responses by a gateway-assigned id appended to the request
bytes (protobuf: the last occurrence of a singular field wins); the client's own id is
restored on the response. Requests that never reached the stream are safe to retry
elsewhere (NotSent).

Requests leave in the order they were handed to the pool: a stream is made at once, and
what is sent while its connection is still opening waits in order and is written when it is
up. A sequence's requests (pinned to one stream) reach the service in the order the client
sent them, also on a gateway's first requests and after a reconnect.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import zlib

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import wire
from meshserve.protocol.errors import Code, InferError
from meshserve.server import h2
from meshserve.telemetry import metrics, tracing

log = logging.getLogger("meshserve.gateway.stream")

_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_CODES = {c.value: c for c in Code}
_STREAM_METADATA = ((tracing.HOP_HEADER, tracing.HOP_GATEWAY),)
_CONNECT_TIMEOUT_S = 5.0


class NotSent(Exception):
    """The request was not written to any stream (safe to retry on another replica)."""


class StreamBroken(InferError):
    """An answered stream broke with requests in flight: they may have run, so never retry them."""


class _Stream:
    """One ModelStreamInfer call. Made without waiting: requests sent before its connection and
    call are open wait in ``_backlog`` (in order) and are written the moment the call opens, so
    ``send`` never suspends and never lets a later request overtake an earlier one."""

    def __init__(self, channel: h2.Channel, name: str):
        self.name = name
        self.pending: dict[str, asyncio.Future[pb.ModelStreamInferResponse]] = {}
        self._ids = itertools.count(1)
        self.broken = False
        self.answered = False  # a response arrived: the stream reached the service
        self._call: h2.ClientStream | None = None
        self._backlog: list[tuple[str, bytes]] = []  # (id, request) sent while opening
        # (asyncio.get_running_loop() makes a getpid system call each time on Python 3.11: not per request)
        self._loop = asyncio.get_running_loop()
        self._opening: asyncio.Task[None] | None = self._loop.create_task(self._open(channel))

    async def _open(self, channel: h2.Channel) -> None:
        try:
            conn = await channel.get()
            if self.broken:  # closed while connecting
                return
            # the marker tells the service that requests without trace parameters were not sampled
            call = conn.open_stream(_METHOD, _STREAM_METADATA, self._on_message, self._on_close)
        except Exception as exc:  # connect refused / timed out, connection closing: nothing was sent
            self._on_close(h2.Status.UNAVAILABLE, f"cannot connect: {exc}" if str(exc) else
                           f"cannot connect: {type(exc).__name__}")
            return
        finally:
            self._opening = None
        self._call = call
        backlog, self._backlog = self._backlog, []
        for cid, raw in backlog:  # in order, in this one step: nothing can come between
            if cid not in self.pending:  # timed out or cancelled while waiting: never sent
                continue
            try:
                call.send(raw)
            except ConnectionError:
                self._on_close(h2.Status.UNAVAILABLE, "stream closed while opening")
                return

    def _on_message(self, raw: bytes) -> None:
        try:
            msg = pb.ModelStreamInferResponse.FromString(raw)
        except Exception as exc:  # keep the gateway alive; fail this stream's requests
            log.error("stream %s: undecodable response: %s", self.name, exc)
            if self._call is not None:
                self._call.cancel()
            self._on_close(13, f"undecodable response: {exc}")
            return
        self.answered = True
        fut = self.pending.pop(msg.infer_response.id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _on_close(self, code: int, detail: str) -> None:
        self.broken = True
        self._backlog.clear()
        detail = detail or f"the service ended the stream (gRPC status {code})"
        for fut in self.pending.values():
            if not fut.done():  # a stream that never answered never connected: safe to retry
                fut.set_exception(StreamBroken(Code.UNAVAILABLE, f"{self.name}: stream to the service "
                                               f"broke: {detail}") if self.answered
                                  else NotSent(f"{self.name}: {detail}"))
        self.pending.clear()

    def send(self, raw_request: bytes) -> asyncio.Future[pb.ModelStreamInferResponse]:
        if self.broken:
            raise NotSent(f"{self.name}: stream closed")
        cid = f"~gw{next(self._ids)}"
        fut: asyncio.Future[pb.ModelStreamInferResponse] = self._loop.create_future()
        raw = wire.with_request_id(raw_request, cid)
        if self._call is None:
            self._backlog.append((cid, raw))
        else:
            try:
                self._call.send(raw)
            except ConnectionError:
                self.broken = True
                raise NotSent(f"{self.name}: stream closed") from None
        self.pending[cid] = fut
        return fut

    def forget(self, fut: asyncio.Future[pb.ModelStreamInferResponse]) -> None:
        for cid, f in list(self.pending.items()):
            if f is fut:
                del self.pending[cid]
                break

    async def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self._call is not None:
            self._call.cancel()
        self._on_close(1, "stream closed by the gateway")


class StreamPool:
    """A few streams to one replica; requests spread round-robin."""

    def __init__(self, endpoint: str, streams: int = 2):
        self.endpoint = endpoint
        self.size = streams
        self._streams: list[_Stream | None] = [None] * streams
        self._rr = itertools.count()
        self._channel = h2.Channel(endpoint, _CONNECT_TIMEOUT_S)
        self.latency = metrics.Histogram()  # microseconds per upstream infer, any outcome (/metrics)

    @property
    def connected(self) -> bool:
        """Whether the connection the streams run on is up."""
        return self._channel.connected

    def _stream(self, affinity: str | None = None) -> _Stream:
        # One sequence always uses the same stream, so its requests reach the service in order.
        # Never awaits: a request waiting here for a connection could be overtaken by a later one.
        i = (zlib.crc32(affinity.encode()) if affinity is not None else next(self._rr)) % self.size
        s = self._streams[i]
        if s is None or s.broken:
            s = self._streams[i] = _Stream(self._channel, f"service {self.endpoint}")
        return s

    async def infer(self, raw_request: bytes, client_id: str, timeout: float | None,
                    affinity: str | None = None) -> pb.ModelInferResponse:
        stream = self._stream(affinity)
        if timeout is not None:  # streams carry no per-message deadline: tell the service in band
            raw_request = wire.with_int_parameter(raw_request, wire.DEADLINE_PARAMETER, max(1, int(timeout * 1e6)))
        fut = stream.send(raw_request)
        t0 = time.perf_counter_ns()
        try:
            msg = await (fut if timeout is None else asyncio.wait_for(fut, timeout))
        except TimeoutError:
            stream.forget(fut)
            raise InferError(Code.DEADLINE_EXCEEDED,
                             f"deadline exceeded waiting for service {self.endpoint}") from None
        except asyncio.CancelledError:
            stream.forget(fut)
            raise
        finally:
            self.latency.observe((time.perf_counter_ns() - t0) / 1000)
        resp = msg.infer_response
        if msg.error_message or wire.ERROR_CODE_PARAMETER in resp.parameters:
            code = _CODES.get(resp.parameters[wire.ERROR_CODE_PARAMETER].string_param, Code.UNKNOWN) \
                if wire.ERROR_CODE_PARAMETER in resp.parameters else Code.UNKNOWN
            raise InferError(code, msg.error_message or f"{code.value} from service {self.endpoint} (no details)")
        resp.id = client_id
        return resp

    async def close(self) -> None:
        for s in self._streams:
            if s is not None:
                await s.close()
        self._channel.close()
