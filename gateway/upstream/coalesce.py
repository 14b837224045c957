"""Request coalescing on the gateway -> service hop.

Requests for the same batchable model that are pending at the same moment are merged into one
v2 request (batch dimension concatenated, bytes only) and the response is split back by rows.
The internal hop then carries fewer, larger messages: per-message cost, not compute, is what a
Python hop pays most for (see load/README.md). No delay is added, and the service must see what
it would see without the gateway (its dynamic batcher forms the batches):

* a request for a model with nothing pending or in flight is sent at once, unless the model's
  last wave was merged (``crowded``: the closed loop of a c8 client sends its requests in
  waves, and the rest of this one arrives in the same event-loop pass): then it joins the
  pass's flush with the rest, and the wave is one hop message, one cohort for the service's
  batcher; a wave of one clears the mark (one client at a time keeps sending at once);
* otherwise it joins its group, and the group is flushed at the end of the current event-loop
  pass: what arrived in the same pass travels as one request, no later than the hop's own write
  (the HTTP/2 connection also writes at the end of the pass);
* the gateway holds requests back only while the rows in flight for the model reach
  ``batches_per_replica`` full batches (``max_batch_size`` rows) per instance and healthy replica:
  then the service already holds more than its instances can take into their next batches, so a
  request held here could not run any sooner; the rows that come back free room, and what waited
  meanwhile leaves as one request. (A bound on *messages* in flight, as before, held requests
  the service's forming batch would have taken, and halved its batches at concurrency 8.)

Only requests validated against the model config are merged (names, datatypes, shapes, byte
sizes, no parameters that change semantics: merging.py, the pure half, holds merge_key, merge
and split; this module is the scheduler, ``Coalescer``), so a malformed request is sent
alone and gets its own precise error; it never fails the requests it would have joined.
The merged request carries `meshserve_merged_requests` so the service's statistics still
count client requests, and, when some members are sampled for tracing, `meshserve_traceparents`
(one line per member) so each keeps its own trace through the service.

Deadlines: a member never fails with another member's deadline. Only members whose deadlines
can each be honoured travel together: none of them has a deadline, or all have one and they lie
within DEADLINE_SPREAD_NS of the chunk's first (a request without a deadline never rides with
one that has a deadline); a merged request carries what remains of its earliest member's
deadline, counted from each member's own arrival. If it still fails with DEADLINE_EXCEEDED,
every member whose own deadline has not passed is sent again, alone, with its own remaining time.
Members of different tenants may share a merge: each gets back only its own rows of each
output (``split``), its own id and nothing of the merged response's parameters; the service's
dynamic batcher would put them in one batch anyway.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from gateway.upstream.merging import Key, ModelShape, Unmergeable, merge, merge_laid_out, split
from gateway.upstream.traced import Member
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import hop
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import InferResult
from meshserve.server.limits import ServerLimits
from meshserve.telemetry import tracing
from meshserve.telemetry.spans import Span

if TYPE_CHECKING:
    from gateway.pipeline import Outcomes
    from gateway.upstream.replica import Replica


class Sender(Protocol):
    """What the coalescer needs of gateway/upstream/upstream.py:Upstream. (A protocol: compiled,
    an attribute typed with a class refuses any other type; unit tests give their own.)"""

    def send(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
             affinity: str | None = None) -> Awaitable[pb.ModelInferResponse]: ...

    def start(self, request: pb.ModelInferRequest, body: bytes, timeout: float | None
              ) -> Awaitable[pb.ModelInferResponse] | None: ...

    def send_merged(self, request: pb.ModelInferRequest, timeout: float | None,
                    members: Sequence[Member]) -> Awaitable[pb.ModelInferResponse]: ...

    @property
    def replicas(self) -> list[Replica]: ...


# A member's share of a merged message: its own message's size (the bytes the client sent, or
# ByteSize when there are none: never its tensors summed, which would copy each out of upb) plus a
# generous bound for what the merge adds per member, so the merge stays under the byte limit.
_MEMBER_OVERHEAD = 4096
# Members with deadlines merge only when their deadlines lie within this of the chunk's first:
# none of them then waits long on a merge that fails at an earlier member's deadline (and if
# one does, it is sent again alone: see _deliver).
DEADLINE_SPREAD_NS = 2_000_000
_DEFAULT_MAX_BYTES = ServerLimits().max_request_bytes


# A request waiting in its group's queue: a tuple (a slots dataclass's __init__ cost ~2.4k
# instructions more per queued request, measured in isolation), read by these indexes:
_REQUEST: Final = 0  # pb.ModelInferRequest
_RAW: Final = 1  # its bytes as the client sent them (forwarded as they are if it travels alone), or None
_ROWS: Final = 2
_FUTURE: Final = 3  # its outcome
_DEADLINE: Final = 4  # monotonic ns: when its client's deadline passes (None: no deadline)
_ENQUEUED: Final = 5  # monotonic ns
_SPAN: Final = 6  # the request's sampled span, or None
_SIZE: Final = 7  # its size in a merge
_HELD: Final = 8  # a flush left it waiting (the bound): it queued here, not just passed through
_Pending = tuple[pb.ModelInferRequest, "bytes | None", int, "asyncio.Future[InferResult]", "int | None", int,
                 "Span | None", int, bool]


@dataclass
class _Group:
    shape: ModelShape
    max_batch: int  # rows per merged request (the model's max_batch_size)
    batch_rows: int  # rows one full batch on every instance of a replica takes
    name: str = ""  # its model's
    pending: deque[_Pending] = field(default_factory=deque)
    inflight_rows: int = 0  # rows sent and not answered yet
    flush_scheduled: bool = False


class Coalescer:
    """Merges requests pending in the same event-loop pass per key; holds requests back only while
    ``batches_per_replica`` full batches per instance and healthy replica are in flight, and a merge
    never grows past `max_bytes` (the services' --max-request-bytes: a larger merged message would
    be refused with RESOURCE_EXHAUSTED)."""

    def __init__(self, upstream: Sender, batches_per_replica: int, max_bytes: int = _DEFAULT_MAX_BYTES):
        self._upstream = upstream
        self._replicas = upstream.replicas  # one list, updated in place
        self.batches_per_replica = batches_per_replica
        self.max_bytes = max_bytes or 2**31 - 1
        self._groups: dict[Key, _Group] = {}
        self.busy: dict[str, int] = {}  # model name -> its requests in flight or waiting here (idle: absent)
        # models whose requests came in waves: a flush merged several of them since the model was
        # last idle. The first request of the next wave waits for its pass's flush with the rest
        # of the wave (one hop message, one cohort for the service's batcher) instead of going
        # alone at once (gateway/pipeline.py:Forward.named; ``submit``'s ``first``).
        self.crowded: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # see _running_loop
        self.merged_sends = 0  # merged requests sent (/metrics)
        self.merged_requests = 0  # client requests they carried
        self.queued = 0  # client requests that joined a group's queue (/metrics)
        self.held = 0  # of them, held past their pass by the bound
        self.wait_ns = 0  # time they spent queued here, summed
        self.deadline_resends = 0  # members sent again alone after their merge missed another's deadline

    def _max_inflight_rows(self, group: _Group) -> int:
        healthy = sum(1 for r in self._replicas if r.healthy)
        return self.batches_per_replica * group.batch_rows * max(1, healthy)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        # asyncio.get_running_loop() makes a getpid system call each time on Python 3.11
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def idle(self, model: str) -> bool:
        """Nothing of ``model`` is in flight or waiting here: its next request goes at once, alone
        (``send_alone``), and skips the merge check (one client at a time pays nothing for it)."""
        return model not in self.busy

    async def send_alone(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                         affinity: str | None = None) -> pb.ModelInferResponse:
        """Send a request of an idle model now; requests arriving meanwhile see the model busy."""
        name = request.model_name
        self.busy[name] = self.busy.get(name, 0) + 1
        try:
            return await self._upstream.send(request, raw, timeout, affinity)
        finally:
            self.done(name)

    def done(self, model: str) -> None:
        """One request of ``model`` (counted in ``busy``) is over."""
        n = self.busy[model] - 1
        if n:
            self.busy[model] = n
        else:
            del self.busy[model]

    async def submit(self, key: Key, request: pb.ModelInferRequest, raw: bytes | None, rows: int,
                     shape: ModelShape, timeout: float | None, name: str | None = None,
                     outcomes: Outcomes | None = None, protocol: str = "grpc", first: bool = False) -> InferResult:
        """Send ``request`` (merge_key gave ``key`` and ``rows`` for the model's ``shape``), alone
        or merged with the requests of its key pending in this event-loop pass (``name``: its
        model's, when the caller has read it). ``outcomes`` (gateway/pipeline.py:Outcomes)
        counts the request's outcome here, for a client of ``protocol``, when given: the
        pipeline's ``Outcomes`` stage then needs no coroutine of its own. ``first``: the first
        request of a wave of a ``crowded`` model: it waits for the pass's flush even though
        nothing of its model is in flight (the rest of its wave comes in the same pass)."""
        if name is None:
            name = request.model_name
        busy = self.busy[name] = self.busy.get(name, 0) + 1
        try:  # (one coroutine: every coalesced request's path)
            group = self._groups.get(key)
            if group is None:
                max_batch = shape.max_batch_size
                group = self._groups[key] = _Group(shape, max_batch, max_batch * shape.instances, name)
            if busy == 1 and not first and not group.inflight_rows and not group.pending:
                # nothing of this model in flight or waiting: send it now, alone. (A request sent
                # alone because its model was idle, gateway/pipeline.py:Forward, is in no group:
                # the wave's next request waits for the pass's flush with the rest of the wave,
                # one message instead of two.)
                group.inflight_rows += rows
                try:
                    result = InferResult(await self._upstream.send(request, raw, timeout))  # (positional: cheaper)
                finally:
                    group.inflight_rows -= rows
                    self._settle(key, group)
            else:
                fut: asyncio.Future[InferResult] = (self._loop or self._running_loop()).create_future()
                self.queued += 1
                now = time.monotonic_ns()
                group.pending.append((request, raw, rows, fut, None if timeout is None else now + int(timeout * 1e9),
                                      now, tracing.current_var.get() if tracing.enabled else None,
                                      (len(raw) if raw is not None else request.ByteSize()) + _MEMBER_OVERHEAD,
                                      False))
                if not group.flush_scheduled:  # (_schedule, inline)
                    self._schedule(key, group)
                result = await fut
        except InferError as exc:
            if outcomes is None:
                raise
            raise outcomes.failed(name, exc, protocol) from None
        finally:
            busy = self.busy[name] - 1  # (done, inline: every request's path)
            if busy:
                self.busy[name] = busy
            else:
                del self.busy[name]
            fut = None  # type: ignore[assignment]  # (as _deliver's: it holds the error)
        if outcomes is not None:
            outcomes.counts[(name, "OK")] += 1
        return result

    def _schedule(self, key: Key, group: _Group) -> None:
        if not group.flush_scheduled:
            group.flush_scheduled = True
            self._running_loop().call_soon(self._flush, key, group)

    def _settle(self, key: Key, group: _Group) -> None:
        """Rows came back: flush what waits (at the end of this pass), or forget an idle group."""
        if group.pending:
            self._schedule(key, group)
        elif not group.inflight_rows and not group.flush_scheduled and self._groups.get(key) is group:
            del self._groups[key]

    def _flush(self, key: Key, group: _Group) -> None:
        group.flush_scheduled = False
        bound = self._max_inflight_rows(group)
        max_batch = group.max_batch
        now = time.monotonic_ns()
        while group.pending and group.inflight_rows < bound:
            chunk: list[_Pending] = []
            total = size = 0
            lead: int | None = None  # the chunk's first deadline: the others lie near it, or all are None
            while group.pending and total + group.pending[0][_ROWS] <= max_batch and (
                    not chunk or size + group.pending[0][_SIZE] <= self.max_bytes):
                if chunk and (due := group.pending[0][_DEADLINE]) is not lead and (
                        due is None or lead is None or abs(due - lead) > DEADLINE_SPREAD_NS):
                    break  # it cannot keep this chunk's deadline, nor the chunk its own: the next chunk
                item = group.pending.popleft()
                if item[_FUTURE].done():  # the client went away
                    continue
                if not chunk:
                    lead = item[_DEADLINE]
                chunk.append(item)
                total += item[_ROWS]
                size += item[_SIZE]
                self.wait_ns += now - item[_ENQUEUED]
            if not chunk:
                continue
            if len(chunk) > 1:
                self.crowded.add(group.name)
            group.inflight_rows += total
            # a context of its own: the task must not inherit the trace context of whichever
            # member's request happened to drain the queue
            asyncio.Task(self._send_chunk(key, group, chunk, total, self._start(group, chunk)),
                         loop=self._running_loop(), context=contextvars.Context(), name="chunk")  # (see meshserve/server/http1/server.py:TASK_NAME)
        if not group.pending:
            self._settle(key, group)
        else:  # the bound holds them: rows coming back flush again (marked: a new tuple each)
            fresh = sum(1 for item in group.pending if not item[_HELD])
            if fresh:
                self.held += fresh
                group.pending = deque(item if item[_HELD] else (*item[:_HELD], True) for item in group.pending)

    async def _send_chunk(self, key: Key, group: _Group, chunk: list[_Pending], total: int,
                          started: _Started | None = None) -> None:
        try:
            await self._deliver(group, chunk, started)
        finally:
            group.inflight_rows -= total
            self._settle(key, group)

    def _start(self, group: _Group, chunk: list[_Pending]) -> _Started | None:
        """Build the chunk's request and write it now, from the flush (a task would write it a
        loop pass later, and the service's forming batch would miss it more often). None when
        the task must do it: a traced member (its spans), or members that cannot merge."""
        if tracing.enabled and any(c[_SPAN] is not None for c in chunk):
            return None
        try:
            out = self._outgoing(group, chunk)
        except Unmergeable:
            return None
        return out, self._upstream.start(out[0], out[1], out[2])

    def _outgoing(self, group: _Group, chunk: list[_Pending]) -> _Outgoing:
        """(the request to send for ``chunk``, its bytes, its timeout): the member's own request
        alone, or their merge (Unmergeable: see merge)."""
        deadlines = [c[_DEADLINE] for c in chunk if c[_DEADLINE] is not None]
        held = [c[_ENQUEUED] for c in chunk if c[_HELD]]
        now = time.monotonic_ns() if deadlines or held else 0
        timeout = (min(deadlines) - now) / 1e9 if deadlines else None  # (<= 0: fails at once, as it should)
        # A member the bound held queued here: the service's max_queue_delay counts from its
        # arrival here, as Triton times it from the oldest request's arrival. Members sent in
        # the pass they came in only passed through (like a request sent at once, they carry
        # nothing: counting the pass would fire the service's batch before the rest of the
        # clients' wave, passed on one by one, arrives).
        waited_us = (now - min(held)) // 1000 if held else None
        if len(chunk) == 1:
            single, raw = chunk[0][_REQUEST], chunk[0][_RAW]
            if waited_us is not None and raw is not None:
                raw = hop.with_queued(raw, waited_us)
            elif waited_us is not None:
                hop.set_queued(single, waited_us)
            return single, raw if raw is not None else single.SerializeToString(), timeout, None
        requests, rows = [c[_REQUEST] for c in chunk], [c[_ROWS] for c in chunk]
        # from the members' bytes where they have the remembered layout and no member's spans
        # need the whole merged message (send_merged serializes it): merging.merge_laid_out
        laid = None if tracing.enabled and any(c[_SPAN] is not None for c in chunk) else \
            merge_laid_out(requests, [c[_RAW] for c in chunk], rows, group.shape)
        merged = merge(requests, rows, group.shape) if laid is None else laid[0]
        self.merged_sends += 1
        self.merged_requests += len(chunk)
        if waited_us is not None:
            hop.set_queued(merged, waited_us)
        if laid is not None:  # (the contents' fields, field 7, last: as protobuf writes them; laid[3]: the
            # merged request's bytes without them, as merge_laid_out built or kept them)
            return merged, (laid[3] if waited_us is None else merged.SerializeToString()) + laid[1], timeout, laid[2]
        return merged, merged.SerializeToString(), timeout, None

    async def _deliver(self, group: _Group, chunk: list[_Pending], started: _Started | None = None) -> None:
        """Send ``chunk`` (alone or merged; ``started``: already built, and written if its
        answer is there) and give every member its outcome."""
        requests = [c[_REQUEST] for c in chunk]
        rows = [c[_ROWS] for c in chunk]
        # (no await inside an except or finally block here: compiled, mypyc can leave the error it
        # handled behind when the coroutine is cancelled there, docs/perf/native.md; the awaits of
        # both handlers below come after them, with what they decided)
        failure: BaseException | None = None
        ids: list[bytes] | None = None  # the members' id fields, cut from their bytes (_outgoing)
        try:
            if started is not None and started[1] is not None:
                ids = started[0][3]
                response = await started[1]
            else:
                if started is not None:
                    out = started[0]
                else:
                    parts: list[list[_Pending]] | None = None
                    try:
                        out = self._outgoing(group, chunk)
                    except Unmergeable as refused:  # malformed members go alone, for their own errors
                        # (named apart from the handler's below: compiled, one name has one type)
                        bad = set(refused.members)
                        parts = [[c] for i, c in enumerate(chunk) if i in bad]
                        rest = [c for i, c in enumerate(chunk) if i not in bad]
                        if rest:
                            parts.append(rest)
                    if parts is not None:
                        await asyncio.gather(*(self._deliver(group, part) for part in parts))
                        return
                message, body, timeout, ids = out
                if len(chunk) == 1:
                    if (span := chunk[0][_SPAN]) is not None:
                        tracing.activate(span)  # this task's own context: sent as the member's request
                    response = await self._upstream.send(message, body, timeout)
                elif members := [Member(i, c[_SPAN], c[_ENQUEUED]) for i, c in enumerate(chunk) if c[_SPAN] is not None]:
                    response = await self._upstream.send_merged(message, timeout, members)
                else:
                    response = await self._upstream.send(message, body, timeout)
            if len(chunk) == 1:
                responses = [InferResult(response)]
            else:  # (positional: a call with keywords costs ~1.2k instructions more, per member)
                responses = [InferResult(None, r) for r in split(response, requests, rows, ids)]
        except BaseException as exc:  # every member gets the outcome
            again: list[_Pending] = []
            if len(chunk) > 1 and isinstance(exc, InferError) and exc.code is Code.DEADLINE_EXCEEDED:
                # the earliest member's deadline: the others are not failed with it
                now = time.monotonic_ns()
                again = [c for c in chunk if not c[_FUTURE].done() and ((due := c[_DEADLINE]) is None or due > now)]
            if not again:
                _fail(chunk, exc)
                # (the error's traceback holds this frame: no local keeps the futures that hold it, a
                # cycle only the collector frees, keeping the members: docs/security.md, "Session 11: error
                # cycles"; cleared with values of their own types: compiled, a typed local refuses None)
                chunk = []
                return
            self.deadline_resends += len(again)
            failure = exc
        if failure is not None:  # sent again alone first, then the rest failed (as above)
            await asyncio.gather(*(self._deliver(group, [c]) for c in again))
            _fail(chunk, failure)
            chunk = []
            again = []
            failure = None
            return
        for c, resp in zip(chunk, responses, strict=True):
            if not c[_FUTURE].done():
                c[_FUTURE].set_result(resp)


def _fail(chunk: list[_Pending], exc: BaseException) -> None:
    """Every member of ``chunk`` not answered yet gets ``exc`` (an InferError for one that is
    not an Exception: a cancellation)."""
    for c in chunk:
        if not c[_FUTURE].done():
            c[_FUTURE].set_exception(exc if isinstance(exc, Exception) else InferError.unavailable(str(exc)))


# Coalescer._outgoing: (the request, its bytes, its timeout, the members' id fields or None: split)
_Outgoing = tuple[pb.ModelInferRequest, bytes, float | None, "list[bytes] | None"]
_Started = tuple[_Outgoing, "Awaitable[pb.ModelInferResponse] | None"]  # Coalescer._start: built, and written?
