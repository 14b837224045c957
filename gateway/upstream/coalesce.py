"""Request coalescing on the gateway -> service hop.

Requests for the same batchable model that are pending at the same moment are merged into one
v2 request (batch dimension concatenated, bytes only) and the response is split back by rows.
The internal hop then carries fewer, larger messages: per-message cost, not compute, is what a
Python hop pays most for (see load/README.md). No delay is added, and the service must see what
it would see without the gateway (its dynamic batcher forms the batches):

* a request for a model with nothing pending or in flight is sent at once;
* otherwise it joins its group, and the group is flushed at the end of the current event-loop
  pass: what arrived in the same pass travels as one request, no later than the hop's own write
  (the HTTP/2 connection also writes at the end of the pass);
* the gateway holds requests back only while the rows in flight for the model reach
  ``batches_per_replica`` full batches (``max_batch_size`` rows) per instance and healthy replica:
  then the service already holds more than its instances can take into their next batches, so a
  request held here could not run any sooner; the rows that come back free room, and what waited
  meanwhile leaves as one request. (A bound on *messages* in flight, as before, held requests
  the service's forming batch would have taken, and halved its batches at concurrency 8.)

Only requests validated here against the model config are merged (names, datatypes,
shapes, byte sizes, no parameters that change semantics), so a malformed request is sent
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
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.upstream.traced import Member
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import datatypes, hop, wire
from meshserve.protocol.errors import Code, InferError
from meshserve.server.core import InferResult
from meshserve.server.limits import ServerLimits
from meshserve.telemetry import tracing
from meshserve.telemetry.spans import Span

if TYPE_CHECKING:
    from gateway.upstream.upstream import Upstream

# Request parameters that do not change how a request is scheduled or computed. The binary_data
# ones only say how the gateway's HTTP front end renders the answer (from the client's own
# request, after the split): every HTTP client sends them, so they must not stop a merge.
_NEUTRAL_PARAMETERS = frozenset({"triton_enable_empty_final_response", "binary_data_output"})
_NEUTRAL_OUTPUT_PARAMETERS = frozenset({"binary_data"})

Key = tuple  # (model, version, inner shapes, requested outputs)


@dataclass(frozen=True)
class ModelShape:
    """What the merge check needs from a config, precomputed once per config."""

    max_batch_size: int
    inputs: dict[str, tuple[str, tuple[int, ...], int]]  # name -> (datatype, dims, element size)
    outputs: frozenset[str]
    instances: int = 1  # batches the service runs at once (instance_group counts)
    # merge_key's answers by the request bytes it reads (see _metadata); bounded by _KEYS_MAX
    keys: dict[bytes, tuple[Key, int] | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, config: mc.ModelConfig) -> ModelShape | None:
        """None when merging could change what the model's own scheduler does: no dynamic
        batching (Triton runs each request alone), nothing to merge (max_batch_size < 2), or
        priorities / queue limits / queue timeouts (the service's queue must see every request),
        an input the model sees as a scalar (``reshape { shape: [] }``: it may run alone), or a
        python model (its execute() gets one request per client request, as in Triton)."""
        if config.backend == "python":
            return None
        if config.max_batch_size < 2 or config.WhichOneof("scheduling_choice") != "dynamic_batching":
            return None
        dyn = config.dynamic_batching
        if dyn.priority_levels or dyn.priority_queue_policy:
            return None
        if dyn.HasField("default_queue_policy") and (
                dyn.default_queue_policy.max_queue_size or dyn.default_queue_policy.default_timeout_microseconds):
            return None
        inputs = {}
        for t in config.input:
            dt = datatypes.config_to_wire(t.data_type)
            size = datatypes.element_size(dt)
            if not size or t.optional or t.allow_ragged_batch or (t.HasField("reshape") and not t.reshape.shape):
                return None  # (reshape to []: a scalar per request, which runs alone)
            inputs[t.name] = (dt, tuple(t.dims), size)
        for o in config.output:
            if not datatypes.element_size(datatypes.config_to_wire(o.data_type)):
                return None
        instances = max(1, sum(max(1, g.count) for g in config.instance_group))
        return cls(config.max_batch_size, inputs, frozenset(o.name for o in config.output), instances)


# merge_key answers remembered per model config (distinct request layouts: clients send few), and
# the largest request metadata remembered (bytes; a larger one is read from the message each time)
_KEYS_MAX = 256
_METADATA_MAX = 2048


def merge_key(request: pb.ModelInferRequest, shape: ModelShape, raw: bytes | None = None
              ) -> tuple[Key, int] | None:
    """(group key, rows) if the request is well formed and safe to merge, else None.

    It runs for every request of a busy model. With ``raw``, the request's bytes as the client
    sent them, the answer is remembered by the bytes it depends on (all but the request id and
    the tensors' contents: ``_metadata``): a client's requests differ in those alone, and each
    upb field read costs about as much as walking the bytes (measured: 33.5k instructions per mlp
    request read from the message). The tensors' byte sizes are checked by ``merge``, which reads
    the bytes anyway (``unmergeable``)."""
    if raw is not None and (meta := _metadata(raw)) is not None:
        keys = shape.keys
        found = keys.get(meta, _UNKNOWN)
        if found is _UNKNOWN:
            found = _merge_key(request, shape)
            if len(keys) >= _KEYS_MAX:
                keys.clear()
            keys[meta] = found
        return found  # type: ignore[return-value]
    return _merge_key(request, shape)


_UNKNOWN = object()
_ID_TAG, _RAW_TAG = 0x1A, 0x3A  # ModelInferRequest.id (3), raw_input_contents (7), length-delimited


def _metadata(raw: bytes) -> bytes | None:
    """A serialized ModelInferRequest without its id and raw_input_contents fields: the bytes
    merge_key's answer depends on. None where the bytes are not the usual top-level layout
    (every field length-delimited with a one-byte tag, as fields 1-7 are) or what is left is
    larger than _METADATA_MAX: then the message is read."""
    n = len(raw)
    pos = start = 0
    parts: list[bytes] = []
    while pos < n:
        tag = raw[pos]
        if tag & 0x87 != 2 or pos + 1 >= n:  # wire type 2 (length-delimited), field number < 16
            return None
        length = raw[pos + 1]
        p = pos + 2
        if length >= 0x80:  # a varint of more than one byte
            length &= 0x7F
            shift = 7
            while True:
                if p >= n or shift > 28:
                    return None
                b = raw[p]
                p += 1
                length |= (b & 0x7F) << shift
                if b < 0x80:
                    break
                shift += 7
        if tag == _ID_TAG or tag == _RAW_TAG:
            if pos > start:
                parts.append(raw[start:pos])
            start = p + length
        pos = p + length
    if pos != n:
        return None
    if start < n:
        parts.append(raw[start:])
    meta = b"".join(parts)
    return meta if len(meta) <= _METADATA_MAX else None


def _merge_key(request: pb.ModelInferRequest, shape: ModelShape) -> tuple[Key, int] | None:
    """merge_key read from the message: each protobuf field once."""
    inputs = request.inputs
    if len(inputs) != len(shape.inputs):
        return None
    params = request.parameters
    if params and not _NEUTRAL_PARAMETERS.issuperset(params):
        return None
    batch = -1
    inner_shapes = []
    specs = shape.inputs
    max_batch = shape.max_batch_size
    for t in inputs:
        name = t.name
        spec = specs.get(name)
        if spec is None or t.datatype != spec[0] or t.parameters:
            return None
        if t.HasField("contents"):  # refused by the service (infer_checks); a merge would drop it
            return None
        dims = spec[1]
        s = t.shape
        if len(s) != len(dims) + 1:
            return None
        b = s[0]
        if b < 1 or b > max_batch or (batch != -1 and b != batch):
            return None
        batch = b
        if -1 in dims:
            inner = tuple(s[1:])
            for got, want in zip(inner, dims, strict=True):
                if got < 0 or (want != -1 and got != want):
                    return None
        else:  # fixed dims: compare in place (no copy of the shape)
            for i, want in enumerate(dims, 1):
                if s[i] != want:
                    return None
            inner = dims
        inner_shapes.append((name, inner))
    outputs = ()
    if request.outputs:
        names = []
        for o in request.outputs:
            if o.name not in shape.outputs:
                return None
            if (op := o.parameters) and not _NEUTRAL_OUTPUT_PARAMETERS.issuperset(op):
                return None
            names.append(o.name)
        if len(set(names)) != len(names):
            return None
        outputs = tuple(sorted(names))
    if len(inner_shapes) > 1:
        inner_shapes.sort()
        if len({n for n, _ in inner_shapes}) != len(inner_shapes):  # an input named twice
            return None
    key = (request.model_name, request.model_version, tuple(inner_shapes), outputs)
    return key, batch


def merge(requests: list[pb.ModelInferRequest], rows: list[int], shape: ModelShape | None = None
          ) -> pb.ModelInferRequest:
    """One request whose batch is the concatenation of `requests` (same key). With ``shape``,
    raises ``Unmergeable`` naming the members whose tensors do not have the byte size their
    shapes say, or not one per input (merge_key does not read the bytes): they travel alone."""
    first = requests[0]
    total = sum(rows)
    merged = pb.ModelInferRequest(model_name=first.model_name, model_version=first.model_version)
    hop.set_merged(merged, len(requests))
    specs = []  # (name, datatype, inner dims, bytes per row or -1 unchecked)
    for t in first.inputs:
        inner = list(t.shape[1:])
        row_bytes = -1
        if shape is not None:
            row_bytes = shape.inputs[t.name][2]
            for d in inner:
                row_bytes *= d
        specs.append((t.name, t.datatype, inner, row_bytes))
    order = [spec[0] for spec in specs]
    parts: list[list[bytes]] = [[] for _ in specs]
    bad = []
    if shape is not None and len(specs) == 1:
        # one input, whose name merge_key matched in every member: nothing to read or reorder
        chunks, row_bytes = parts[0], specs[0][3]
        for m, (r, n) in enumerate(zip(requests, rows, strict=True)):
            raws = r.raw_input_contents
            if len(raws) != 1 or len(raw := raws[0]) != n * row_bytes:
                bad.append(m)
            else:
                chunks.append(raw)
    else:
        for m, (r, n) in enumerate(zip(requests, rows, strict=True)):
            raws = list(r.raw_input_contents)
            names = order if m == 0 else [t.name for t in r.inputs]
            if len(raws) != len(names):
                bad.append(m)
                continue
            if names != order:  # the same inputs in another order
                raws = [raws[names.index(name)] for name in order]
            for i, raw in enumerate(raws):
                row_bytes = specs[i][3]
                if row_bytes >= 0 and len(raw) != n * row_bytes:
                    bad.append(m)
                    break
                parts[i].append(raw)
    if bad:
        raise Unmergeable(bad)
    for (name, datatype, inner, _), chunks in zip(specs, parts, strict=True):
        merged.inputs.add(name=name, datatype=datatype, shape=[total, *inner])
        merged.raw_input_contents.append(b"".join(chunks))
    for o in first.outputs:
        merged.outputs.add(name=o.name)
    return merged


class Unmergeable(Exception):
    """Members of a merge whose tensor bytes do not match their shapes (indexes in the chunk)."""

    def __init__(self, members: list[int]):
        super().__init__(f"members {members} have tensors of the wrong byte size")
        self.members = members


def split(response: pb.ModelInferResponse, requests: list[pb.ModelInferRequest], rows: list[int]) -> list[bytes]:
    """Cut a merged response back into one response per original request, each serialized (a
    ModelInferResponse's bytes, written here field by field: building a message per member and
    serializing it again cost more than the rest of the split). The rows of an output are
    sliced without a copy until the member's bytes are joined."""
    total = sum(rows)
    raws = response.raw_output_contents
    outputs = response.outputs
    if len(raws) != len(outputs):
        raise InferError.internal(f"model '{response.model_name}': merged response lacks raw output contents")
    per_row = []
    specs = []  # (name and datatype fields, inner dims) per output
    views = []
    for o, raw in zip(outputs, raws, strict=True):
        shape = o.shape
        if not shape or shape[0] != total or len(raw) % total:
            raise InferError.internal(
                f"model '{response.model_name}': output '{o.name}' of shape {list(shape)} cannot be split "
                f"into {len(requests)} requests of {rows} rows")
        per_row.append(len(raw) // total)
        specs.append((_field(b"\x0a", o.name.encode()) + _field(b"\x12", o.datatype.encode()), shape[1:]))
        views.append(memoryview(raw))
    head = _field(b"\x0a", response.model_name.encode()) + _field(b"\x12", response.model_version.encode())
    # by member rows: the output tensors' fields (without data), and each raw_output_contents
    # (field 6) entry's tag and length
    heads: dict[int, tuple[bytes, list[bytes]]] = {}
    out = []
    start = 0
    for req, n in zip(requests, rows, strict=True):
        cached = heads.get(n)
        if cached is None:
            cached = heads[n] = (b"".join(
                _field(b"\x2a", names + _field(b"\x1a", b"".join(wire.varint(d) for d in (n, *inner))))
                for names, inner in specs), [b"\x32" + wire.varint(n * size) for size in per_row])
        tensors, lengths = cached
        rid = req.id
        parts: list[bytes | memoryview] = [head, _field(b"\x1a", rid.encode()) if rid else b"", tensors]
        for view, size, length in zip(views, per_row, lengths, strict=True):
            parts.append(length)
            parts.append(view[start * size:(start + n) * size])
        out.append(b"".join(parts))
        start += n
    return out


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited protobuf field; nothing for an empty one (as protobuf writes proto3)."""
    return tag + wire.varint(len(payload)) + payload if payload else b""


# A member's share of a merged message: its own message's size (the bytes the client sent, or
# ByteSize when there are none: never its tensors summed, which would copy each out of upb) plus a
# generous bound for what the merge adds per member, so the merge stays under the byte limit.
_MEMBER_OVERHEAD = 4096
# Members with deadlines merge only when their deadlines lie within this of the chunk's first:
# none of them then waits long on a merge that fails at an earlier member's deadline (and if
# one does, it is sent again alone: see _deliver).
DEADLINE_SPREAD_NS = 2_000_000
_DEFAULT_MAX_BYTES = ServerLimits().max_request_bytes


@dataclass(slots=True)
class _Pending:
    """A request waiting in its group's queue."""

    request: pb.ModelInferRequest
    raw: bytes | None  # its bytes as the client sent them (forwarded as they are if it travels alone)
    rows: int
    future: asyncio.Future[InferResult]
    deadline_ns: int | None  # monotonic: when its client's deadline passes (None: no deadline)
    enqueued_ns: int  # monotonic
    span: Span | None  # the request's sampled span
    size: int  # its size in a merge
    held: bool = False  # a flush left it waiting (the bound): it queued here, not just passed through


@dataclass
class _Group:
    shape: ModelShape
    max_batch: int  # rows per merged request (the model's max_batch_size)
    batch_rows: int  # rows one full batch on every instance of a replica takes
    pending: deque[_Pending] = field(default_factory=deque)
    inflight_rows: int = 0  # rows sent and not answered yet
    flush_scheduled: bool = False


class Coalescer:
    """Merges requests pending in the same event-loop pass per key; holds requests back only while
    ``batches_per_replica`` full batches per instance and healthy replica are in flight, and a merge
    never grows past `max_bytes` (the services' --max-request-bytes: a larger merged message would
    be refused with RESOURCE_EXHAUSTED)."""

    def __init__(self, upstream: Upstream, batches_per_replica: int, max_bytes: int = _DEFAULT_MAX_BYTES):
        self._upstream = upstream
        self._replicas = upstream.replicas  # one list, updated in place
        self.batches_per_replica = batches_per_replica
        self.max_bytes = max_bytes or 2**31 - 1
        self._groups: dict[Key, _Group] = {}
        self._busy: dict[str, int] = {}  # model name -> its requests in flight or waiting here
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
        return model not in self._busy

    async def send_alone(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
                         affinity: str | None = None) -> pb.ModelInferResponse:
        """Send a request of an idle model now; requests arriving meanwhile see the model busy."""
        name = request.model_name
        self._busy[name] = self._busy.get(name, 0) + 1
        try:
            return await self._upstream.send(request, raw, timeout, affinity)
        finally:
            self._done(name)

    def _done(self, model: str) -> None:
        n = self._busy[model] - 1
        if n:
            self._busy[model] = n
        else:
            del self._busy[model]

    async def submit(self, key: Key, request: pb.ModelInferRequest, raw: bytes | None, rows: int,
                     shape: ModelShape, timeout: float | None) -> InferResult:
        """Send ``request`` (merge_key gave ``key`` and ``rows`` for the model's ``shape``), alone
        or merged with the requests of its key pending in this event-loop pass."""
        name = request.model_name
        self._busy[name] = self._busy.get(name, 0) + 1
        try:
            return await self._submit(key, request, raw, rows, shape, timeout)
        finally:
            self._done(name)

    async def _submit(self, key: Key, request: pb.ModelInferRequest, raw: bytes | None, rows: int,
                      shape: ModelShape, timeout: float | None) -> InferResult:
        group = self._groups.get(key)
        if group is None:
            max_batch = shape.max_batch_size
            group = self._groups[key] = _Group(shape, max_batch, max_batch * shape.instances)
        if not group.inflight_rows and not group.pending:
            # nothing of this group in flight or waiting: send it now, alone
            group.inflight_rows += rows
            try:
                return InferResult(message=await self._upstream.send(request, raw, timeout))
            finally:
                group.inflight_rows -= rows
                self._settle(key, group)
        fut: asyncio.Future[InferResult] = self._running_loop().create_future()
        self.queued += 1
        now = time.monotonic_ns()
        group.pending.append(_Pending(request, raw, rows, fut, None if timeout is None else now + int(timeout * 1e9), now,
                                      tracing.current_var.get() if tracing.enabled else None,
                                      (len(raw) if raw is not None else request.ByteSize()) + _MEMBER_OVERHEAD))
        self._schedule(key, group)
        return await fut

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
            while group.pending and total + group.pending[0].rows <= max_batch and (
                    not chunk or size + group.pending[0].size <= self.max_bytes):
                if chunk and (due := group.pending[0].deadline_ns) is not lead and (
                        due is None or lead is None or abs(due - lead) > DEADLINE_SPREAD_NS):
                    break  # it cannot keep this chunk's deadline, nor the chunk its own: the next chunk
                item = group.pending.popleft()
                if item.future.done():  # the client went away
                    continue
                if not chunk:
                    lead = item.deadline_ns
                chunk.append(item)
                total += item.rows
                size += item.size
                self.wait_ns += now - item.enqueued_ns
            if not chunk:
                continue
            group.inflight_rows += total
            # a context of its own: the task must not inherit the trace context of whichever
            # member's request happened to drain the queue
            self._running_loop().create_task(self._send_chunk(key, group, chunk, total, self._start(group, chunk)),
                                             context=contextvars.Context())
        if not group.pending:
            self._settle(key, group)
        else:  # the bound holds them: rows coming back flush again
            for item in group.pending:
                if not item.held:
                    item.held = True
                    self.held += 1

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
        if tracing.enabled and any(c.span is not None for c in chunk):
            return None
        try:
            out = self._outgoing(group, chunk)
        except Unmergeable:
            return None
        return out, self._upstream.start(out[0], out[1], out[2])

    def _outgoing(self, group: _Group, chunk: list[_Pending]) -> _Outgoing:
        """(the request to send for ``chunk``, its bytes, its timeout): the member's own request
        alone, or their merge (Unmergeable: see merge)."""
        deadlines = [c.deadline_ns for c in chunk if c.deadline_ns is not None]
        held = [c.enqueued_ns for c in chunk if c.held]
        now = time.monotonic_ns() if deadlines or held else 0
        timeout = (min(deadlines) - now) / 1e9 if deadlines else None  # (<= 0: fails at once, as it should)
        # A member the bound held queued here: the service's max_queue_delay counts from its
        # arrival here, as Triton times it from the oldest request's arrival. Members sent in
        # the pass they came in only passed through (like a request sent at once, they carry
        # nothing: counting the pass would fire the service's batch before the rest of the
        # clients' wave, passed on one by one, arrives).
        waited_us = (now - min(held)) // 1000 if held else None
        if len(chunk) == 1:
            single, raw = chunk[0].request, chunk[0].raw
            if waited_us is not None and raw is not None:
                raw = hop.with_queued(raw, waited_us)
            elif waited_us is not None:
                hop.set_queued(single, waited_us)
            return single, raw if raw is not None else single.SerializeToString(), timeout
        merged = merge([c.request for c in chunk], [c.rows for c in chunk], group.shape)
        self.merged_sends += 1
        self.merged_requests += len(chunk)
        if waited_us is not None:
            hop.set_queued(merged, waited_us)
        return merged, merged.SerializeToString(), timeout

    async def _deliver(self, group: _Group, chunk: list[_Pending], started: _Started | None = None) -> None:
        """Send ``chunk`` (alone or merged; ``started``: already built, and written if its
        answer is there) and give every member its outcome."""
        requests = [c.request for c in chunk]
        rows = [c.rows for c in chunk]
        try:
            if started is not None and started[1] is not None:
                response = await started[1]
            else:
                if started is not None:
                    out = started[0]
                else:
                    try:
                        out = self._outgoing(group, chunk)
                    except Unmergeable as exc:  # malformed members go alone, for their own errors
                        bad = set(exc.members)
                        parts = [[c] for i, c in enumerate(chunk) if i in bad]
                        rest = [c for i, c in enumerate(chunk) if i not in bad]
                        if rest:
                            parts.append(rest)
                        await asyncio.gather(*(self._deliver(group, part) for part in parts))
                        return
                message, body, timeout = out
                if len(chunk) == 1:
                    if (span := chunk[0].span) is not None:
                        tracing.activate(span)  # this task's own context: sent as the member's request
                    response = await self._upstream.send(message, body, timeout)
                elif members := [Member(i, c.span, c.enqueued_ns) for i, c in enumerate(chunk) if c.span is not None]:
                    response = await self._upstream.send_merged(message, timeout, members)
                else:
                    response = await self._upstream.send(message, body, timeout)
            if len(chunk) == 1:
                responses = [InferResult(message=response)]
            else:
                responses = [InferResult(raw=r) for r in split(response, requests, rows)]
        except BaseException as exc:  # every member gets the outcome
            if len(chunk) > 1 and isinstance(exc, InferError) and exc.code is Code.DEADLINE_EXCEEDED:
                # the earliest member's deadline: the others are not failed with it
                now = time.monotonic_ns()
                again = [c for c in chunk if not c.future.done() and (c.deadline_ns is None or c.deadline_ns > now)]
                if again:
                    self.deadline_resends += len(again)
                    await asyncio.gather(*(self._deliver(group, [c]) for c in again))
            for c in chunk:
                if not c.future.done():
                    c.future.set_exception(exc if isinstance(exc, Exception) else InferError.unavailable(str(exc)))
            return
        for c, resp in zip(chunk, responses, strict=True):
            if not c.future.done():
                c.future.set_result(resp)


_Outgoing = tuple[pb.ModelInferRequest, bytes, float | None]  # Coalescer._outgoing
_Started = tuple[_Outgoing, "Awaitable[pb.ModelInferResponse] | None"]  # Coalescer._start: built, and written?
