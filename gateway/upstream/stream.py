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

A request for a client's streaming call (a decoupled model: zero or many responses) is sent
marked ``hop.STREAM``; its answers arrive on the same stream with its id, each
flagged ``triton_final_response``, until one is final (``Answers``). A client that goes away
cancels it: a ``hop.cancel`` message with its id tells the service to stop it.
The hop's own parameters, marker, errors and cancel are meshserve.protocol.hop's.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import zlib
from collections.abc import Coroutine
from typing import Any, Protocol

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop, wire
from meshserve.protocol.errors import Code, InferError
from meshserve.server import h2, tls
from meshserve.server.deadlines import DeadlineTimer
from meshserve.server.limits import STREAMS
from meshserve.telemetry import metrics

log = logging.getLogger("meshserve.gateway.stream")

_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_CONNECT_TIMEOUT_S = 5.0
# answers of one streamed request the gateway holds for a client that reads them slower than the
# model sends them, and their bytes (--max-stream-backlog-bytes, limits.STREAMS); beyond either the
# request fails (RESOURCE_EXHAUSTED, its one end) and the service stops it
MAX_WAITING_ANSWERS = 1024
_FINAL = wire.FINAL_RESPONSE_PARAMETER
_EMPTY_FINAL = hop.EMPTY_FINAL
_ERROR_CODE = hop.ERROR_CODE
_error = hop.stream_error  # the in-band error a service answered, if it is one (with its retry hint)


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
        self.answers: dict[str, Answers] = {}  # streamed requests (many answers each) by id
        self._ids = itertools.count(1)
        self.broken = False
        self.answered = False  # a response arrived: the stream reached the service
        self.retired = False  # out of its pool (StreamPool.renew): it ends once its requests are answered
        self._call: h2.ClientStream | None = None
        self._backlog: list[tuple[str, bytes]] = []  # (id, request) sent while opening
        # (asyncio.get_running_loop() makes a getpid system call each time on Python 3.11: not per request)
        self._loop = asyncio.get_running_loop()
        # loop-time deadlines of pending requests sent with a timeout, and the one timer that
        # fails them (_on_deadlines; asyncio.wait_for per request cost a timer, a loop pass and
        # a getpid system call each)
        self._due: dict[str, float] = {}
        self._deadlines = DeadlineTimer(self._loop, self._on_deadlines)
        self.opening: asyncio.Task[None] | None = self._loop.create_task(self._open(channel))

    async def _open(self, channel: h2.Channel) -> None:
        try:
            conn = await channel.get()
            if self.broken:  # closed while connecting
                return
            # the marker tells the service that requests without trace parameters were not sampled
            call = conn.open_stream(_METHOD, hop.stream_metadata(), self._on_message, self._on_close)
        except Exception as exc:  # connect refused / timed out, connection closing: nothing was sent
            self._on_close(h2.Status.UNAVAILABLE, f"cannot connect: {exc}" if str(exc) else
                           f"cannot connect: {type(exc).__name__}")
            return
        finally:
            self.opening = None
        self._call = call
        backlog, self._backlog = self._backlog, []
        for cid, raw in backlog:  # in order, in this one step: nothing can come between
            if cid not in self.pending and cid not in self.answers:  # timed out or cancelled while waiting
                continue
            try:
                call.send(raw)
            except ConnectionError:
                self._on_close(h2.Status.UNAVAILABLE, "stream closed while opening")
                return
        self._end_if_retired()

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
        cid = msg.infer_response.id  # (read once: each upb field read makes a new str)
        fut = self.pending.pop(cid, None)
        if fut is not None:
            if self._due:
                self._due.pop(cid, None)
            if not fut.done():
                fut.set_result(msg)
            if self.retired:
                self._end_if_retired()
            return
        answers = self.answers.get(cid)
        if answers is not None and answers.push(msg, len(raw)):
            del self.answers[cid]
            if self.retired:
                self._end_if_retired()

    def retire(self) -> None:
        """Take no more requests (its pool no longer hands it out); end the call once the ones
        it has are answered."""
        self.retired = True
        self._end_if_retired()

    def _end_if_retired(self) -> None:
        if self.retired and not self.pending and not self.answers and not self.broken and self.opening is None:
            if self._call is not None:
                self._call.cancel()
            self._on_close(1, "stream retired by the gateway")

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
        self._due.clear()
        self._deadlines.cancel()
        for answers in self.answers.values():
            answers.push(StreamBroken(Code.UNAVAILABLE, f"{self.name}: stream to the service broke: {detail}")
                         if self.answered else NotSent(f"{self.name}: {detail}"))
        self.answers.clear()

    def _write(self, cid: str, raw: bytes) -> None:
        """``raw`` on the call, or in the backlog while it opens (NotSent when it is closed)."""
        if self._call is None:
            self._backlog.append((cid, raw))
            return
        try:
            self._call.send(raw)
        except ConnectionError:
            self.broken = True
            raise NotSent(f"{self.name}: stream closed") from None

    def send_stream(self, raw_request: bytes, client_id: str, deadline: float | None) -> Answers:
        """Send a streamed request (marked hop.STREAM); its answers gather in the
        returned Answers."""
        if self.broken:
            raise NotSent(f"{self.name}: stream closed")
        cid = f"~gw{next(self._ids)}"
        if client_id:  # (the hop's id is cid: the client's rides along, for a python model's request_id())
            raw_request = hop.with_request_id(raw_request, client_id)
        self._write(cid, wire.with_request_id(raw_request, cid))
        answers = self.answers[cid] = Answers(self, cid, client_id, deadline)
        return answers

    def cancel(self, cid: str) -> None:
        """Stop forwarding the streamed request ``cid`` and tell the service to stop it."""
        if self.answers.pop(cid, None) is not None:
            self._tell_cancel(cid)

    def _tell_cancel(self, cid: str) -> None:
        """Tell the service to stop the request ``cid`` (its client went away)."""
        if self.broken or self._call is None:
            return  # (still in the backlog: _open skips it)
        try:
            self._call.send(hop.cancel(cid))
        except ConnectionError:
            self.broken = True

    def send(self, raw_request: bytes, timeout: float | None = None,
             client_id: str = "") -> asyncio.Future[pb.ModelStreamInferResponse]:
        """Send a request; its answer comes in the future, which fails with DEADLINE_EXCEEDED
        after ``timeout`` seconds."""
        if self.broken:
            raise NotSent(f"{self.name}: stream closed")
        cid = f"~gw{next(self._ids)}"
        fut: asyncio.Future[pb.ModelStreamInferResponse] = self._loop.create_future()
        if client_id:  # (as send_stream)
            raw_request = hop.with_request_id(raw_request, client_id)
        self._write(cid, wire.with_request_id(raw_request, cid))
        self.pending[cid] = fut
        if timeout is not None:
            self._due[cid] = due = self._loop.time() + timeout
            self._deadlines.add(due)
        return fut

    def _on_deadlines(self, now: float) -> float | None:
        """Fail the pending requests whose deadline is up (meshserve/server/deadlines.py); the
        earliest deadline left."""
        later = None
        for cid, due in list(self._due.items()):
            if due <= now:
                del self._due[cid]
                fut = self.pending.pop(cid, None)
                if fut is not None and not fut.done():
                    fut.set_exception(InferError(Code.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self.name}"))
            elif later is None or due < later:
                later = due
        if self.retired:
            self._end_if_retired()
        return later

    def forget(self, fut: asyncio.Future[pb.ModelStreamInferResponse]) -> None:
        """The caller of a pending request went away (its client left): the answer is not
        awaited any more, and the service is told to stop the request."""
        for cid, f in list(self.pending.items()):
            if f is fut:
                del self.pending[cid]
                self._due.pop(cid, None)
                self._tell_cancel(cid)
                self._end_if_retired()
                break

    async def close(self) -> None:
        if self.opening is not None:
            self.opening.cancel()
        if self._call is not None:
            self._call.cancel()
        self._on_close(1, "stream closed by the gateway")


class _Told(Protocol):
    """What Answers needs of its stream (a _Stream): its name, and telling the service to stop a
    request. (A protocol: compiled, a parameter typed with a class refuses any other type.)"""

    name: str

    def cancel(self, cid: str) -> None: ...


class Answers:
    """The answers of one streamed request, in the order they arrive; the last is final."""

    def __init__(self, stream: _Told, cid: str, client_id: str, deadline: float | None):
        self._stream = stream
        self._cid = cid
        self._client_id = client_id
        self._deadline = deadline  # loop time
        self._queue: collections.deque[pb.ModelStreamInferResponse | BaseException] = collections.deque()
        self._sizes: collections.deque[int] = collections.deque()  # the queued items' bytes
        self.waiting_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self.finished = False  # the final answer (or an error) arrived: nothing more will

    def push(self, item: pb.ModelStreamInferResponse | BaseException, size: int = 0) -> bool:
        """An answer of `size` bytes (or the stream's failure) arrives; returns whether it was the last."""
        if self.finished:
            return True
        if isinstance(item, BaseException):
            self.finished = True
            size = 0
        else:
            params = item.infer_response.parameters
            self.finished = bool(item.error_message) or _ERROR_CODE in params or \
                (_FINAL in params and params[_FINAL].bool_param) or _FINAL not in params
            if not self.finished and self._queue and (
                    len(self._queue) >= MAX_WAITING_ANSWERS
                    or self.waiting_bytes + size > STREAMS.backlog_bytes):
                item = InferError.exhausted(
                    f"{len(self._queue)} responses ({self.waiting_bytes} bytes) of this request wait for the "
                    f"client (limits: {MAX_WAITING_ANSWERS} responses, --max-stream-backlog-bytes "
                    f"{STREAMS.backlog_bytes}): it reads them slower than the model sends them")
                self.finished = True
                size = 0
                self._stream.cancel(self._cid)
        self._queue.append(item)
        self._sizes.append(size)
        self.waiting_bytes += size
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return self.finished

    async def _wait(self) -> None:
        while not self._queue:
            self._waiter = asyncio.get_running_loop().create_future()
            timeout = None if self._deadline is None else self._deadline - asyncio.get_running_loop().time()
            if timeout is not None and timeout <= 0:
                self.close()
                raise InferError(Code.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self._stream.name}")
            try:
                await (self._waiter if timeout is None else asyncio.wait_for(self._waiter, timeout))
            except TimeoutError:
                self.close()
                raise InferError(Code.DEADLINE_EXCEEDED, f"deadline exceeded waiting for {self._stream.name}") \
                    from None
            finally:
                self._waiter = None

    async def first(self) -> None:
        """Wait for the first answer; raises the stream's failure if that came instead (NotSent:
        the request never reached the service, and may go to another replica)."""
        await self._wait()
        if isinstance(self._queue[0], BaseException):
            self.waiting_bytes -= self._sizes.popleft()
            raise self._queue.popleft()

    async def next(self) -> tuple[pb.ModelInferResponse | None, bool]:
        """(the next response, or None for an empty final one; whether it is the last). An
        in-band error is raised as the InferError it carries."""
        await self._wait()
        self.waiting_bytes -= self._sizes.popleft()
        if isinstance(self._queue[0], BaseException):
            raise self._queue.popleft()  # (no local holds a raised error: docs/security.md, "Session 11: error cycles")
        item: pb.ModelStreamInferResponse = self._queue.popleft()  # type: ignore[assignment]  # (not an error: above)
        error = _error(item, self._stream.name)
        if error is not None:
            try:
                raise error
            finally:
                del error  # (as above)
        resp = item.infer_response
        params = resp.parameters
        final = params[_FINAL].bool_param if _FINAL in params else True
        if _EMPTY_FINAL in params:
            return None, final
        resp.id = self._client_id
        return resp, final

    def close(self) -> None:
        """The client is done with it: if the service is not, tell it to stop."""
        if not self.finished:
            self.finished = True
            self._stream.cancel(self._cid)


# StreamPool.start: (stream, answer, t0 ns). The stream is held as Any: a frame clears its Sent with
# UNSENT (compiled, a tuple-typed local cannot be deleted, and its _Stream slot would refuse None)
Sent = tuple[Any, "asyncio.Future[pb.ModelStreamInferResponse]", int]
UNSENT: Sent = (None, None, 0)  # type: ignore[assignment]


class StreamPool:
    """A few streams to one replica; requests spread round-robin."""

    def __init__(self, endpoint: str, streams: int = 2):
        self.endpoint = endpoint
        self.size = streams
        self._streams: list[_Stream | None] = [None] * streams
        self._retired: list[_Stream] = []  # out of the pool, still answering (renew)
        self._rr = itertools.count()
        self._channel = h2.Channel(endpoint, _CONNECT_TIMEOUT_S, tls.UPSTREAM.context())  # (--upstream-use-ssl)
        self.latency = metrics.Histogram()  # microseconds per upstream infer, any outcome (/metrics)
        self._where = f"service {endpoint}"  # (an error's words: not formatted per request)

    def renew(self) -> None:
        """Let the next requests open new streams instead of joining one still connecting (its
        own requests stay with it, and it ends after them): the replica came back, maybe as a
        new process."""
        self._retired = [s for s in self._retired if not s.broken]
        for i, s in enumerate(self._streams):
            if s is not None and s.opening is not None:
                self._streams[i] = None
                self._retired.append(s)
                s.retire()

    def leave(self) -> None:
        """The replica left the pool (its service drains, or failed): each stream takes no more
        requests and ends once those it has are answered, so that a draining service's calls end
        with its work instead of holding its stop for the grace; requests from now on (the
        replica back, or one that picked it before it left) get new streams."""
        self._retired = [s for s in self._retired if not s.broken]
        for i, s in enumerate(self._streams):
            if s is not None:
                self._streams[i] = None
                if not s.broken:
                    self._retired.append(s)
                    s.retire()

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

    def infer(self, raw_request: bytes, client_id: str, timeout: float | None,
              affinity: str | None = None) -> Coroutine[Any, Any, pb.ModelInferResponse]:
        """Write the request now (NotSent, raised here, if its stream is closed); the returned
        awaitable is its answer (``finish``'s coroutine: no frame of its own per request)."""
        return self.finish(self.start(raw_request, timeout, affinity, client_id), client_id)

    def start(self, raw_request: bytes, timeout: float | None, affinity: str | None = None,
              client_id: str = "") -> Sent:
        """Write an infer request now (NotSent if its stream is closed); ``finish`` waits for
        its answer. Split from ``infer`` so that a caller outside a task (the coalescer's flush)
        writes in its own loop pass, not in the next one."""
        stream = self._stream(affinity)
        if timeout is not None:  # streams carry no per-message deadline: tell the service in band
            raw_request = hop.with_deadline(raw_request, timeout)
        fut = stream.send(raw_request, timeout, client_id)  # (DEADLINE_EXCEEDED after the timeout)
        return stream, fut, time.perf_counter_ns()

    async def finish(self, sent: Sent, client_id: str) -> pb.ModelInferResponse:
        """The answer to a request ``start`` wrote (its id restored to ``client_id``)."""
        stream, fut, t0 = sent
        try:
            msg = await fut
        except asyncio.CancelledError:
            stream.forget(fut)
            raise
        finally:
            self.latency.observe((time.perf_counter_ns() - t0) / 1000)
            # (a failed future holds its error, whose traceback holds this frame: no local keeps it)
            sent = UNSENT
            del fut
        return self.answer(msg, client_id)

    def answer(self, msg: pb.ModelStreamInferResponse, client_id: str) -> pb.ModelInferResponse:
        """The service's answer to one request: its in-band error raised, or its response with
        the client's id restored."""
        resp = msg.infer_response  # (read once: each upb read makes a new wrapper)
        if msg.error_message or _ERROR_CODE in resp.parameters:  # (hop.stream_error's own first test)
            error = _error(msg, self._where)
            if error is not None:
                try:
                    raise error
                finally:
                    del error  # (its traceback holds this frame: no cycle through a local, docs/security.md, "Session 11: error cycles")
        resp.id = client_id
        return resp

    async def open(self, raw_request: bytes, client_id: str, timeout: float | None,
                   affinity: str | None = None) -> Answers:
        """Send a streamed request and wait for its first answer (the stream's failure before
        that is raised here: NotSent may be retried on another replica)."""
        stream = self._stream(affinity)
        deadline = None
        if timeout is not None:
            raw_request = hop.with_deadline(raw_request, timeout)
            deadline = asyncio.get_running_loop().time() + timeout
        answers = stream.send_stream(raw_request, client_id, deadline)
        try:
            await answers.first()
        except BaseException:
            answers.close()
            raise
        return answers

    async def close(self) -> None:
        for s in [*self._streams, *self._retired]:
            if s is not None:
                await s.close()
        self._channel.close()
