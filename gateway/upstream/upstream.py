"""Upstream: the one way the gateway reaches its services.

It owns the replica pool and discovery, and makes every call to a service: ``call`` (a typed
control call or an infer: replica choice, retries on another replica when the request never
reached a model), ``send`` (an infer request forwarded as bytes on a replica's streams) and
``send_merged`` (a request the coalescer merged), with their traced variants (traced.py) for
sampled requests; ``each`` asks several replicas at once (statistics, the repository index,
load/unload, metrics federation: gateway/statistics.py, control.py, federation.py). GatewayCore's
pipeline, the coalescer, A/B routes, ensembles, model control, statistics and federation hold this
object (the core hands the pipeline, the A/B router and the ensembles a few look-ups of its own:
docs/architecture.md). ``start`` and ``stream`` write a merged request or a streamed one on a
replica's streams.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from gateway.routing.table import ModelRoutes, pick, pick_pinned
from gateway.upstream import streamed, traced
from gateway.upstream.discovery import Discovery
from gateway.upstream.pool import ReplicaPool
from gateway.upstream.replica import CALL_ERRORS, Replica
from gateway.upstream.stream import UNSENT, NotSent, Sent
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.native import mypyc_attr
from meshserve.protocol.errors import Code, InferError
from meshserve.telemetry import tracing

T = TypeVar("T")


@mypyc_attr(native_class=False)  # (compiled: a Python class, its methods patchable; docs/perf/native.md)
class Upstream:
    def __init__(self, pool: ReplicaPool, discovery_interval_s: float = 2.0):
        self.pool = pool
        self.replicas = pool.replicas  # one list, updated in place as replicas come and go
        self.discovery = Discovery(pool, discovery_interval_s)

    def healthy(self) -> list[Replica]:
        """The replicas in the pool now."""
        return [r for r in self.replicas if r.healthy]

    async def each(self, replicas: Sequence[Replica], fn: Callable[[Replica], Awaitable[T]]
                   ) -> list[T | BaseException]:
        """``fn`` on every one of ``replicas`` at once (a control call that every replica answers
        for itself: no replica choice, no retry elsewhere): each one's answer or exception, in
        the order of ``replicas``."""
        return await asyncio.gather(*(fn(r) for r in replicas), return_exceptions=True)

    async def routes(self, name: str) -> ModelRoutes[Replica]:
        """The replicas hosting ``name`` by version (refreshed once when it is not known yet)."""
        table = self.discovery.table
        if name not in table:
            await self.discovery.refresh()  # a model loaded since the last probe
            table = self.discovery.table
        return table.lookup(name)

    async def call(self, name: str, version: str, fn: Callable[[Replica], Awaitable[T]],
                   affinity: str | None = None) -> T:
        """Call one replica hosting (name, version); on a connection failure try the others
        (Replica.failure). With ``affinity`` (a sequence's correlation key) the replica is chosen
        by rendezvous hashing, so every request of the sequence lands on the same healthy replica."""
        table = self.discovery.table  # (a known model: no coroutine of routes() per request)
        routes = table.lookup(name) if name in table else await self.routes(name)
        replicas = list(routes.replicas_for(version))
        while True:
            replica = pick(replicas) if affinity is None else pick_pinned(replicas, affinity)
            replica.outstanding += 1
            generation = replica.generation
            try:
                return await fn(replica)
            except CALL_ERRORS as exc:
                if (err := self._another(replicas, replica, exc, generation)) is not None:
                    raise err from None
            finally:
                replica.outstanding -= 1
                err = None  # (no frame -> error -> traceback -> frame cycle: docs/security.md, "Session 11: error cycles")

    def _another(self, replicas: list[Replica], replica: Replica, exc: Exception, generation: int
                 ) -> InferError | None:
        """``_failed``, in ``call``'s loop: None when another of ``replicas`` may be tried (this
        one is taken out of the list), else the client's error."""
        err, retry = self._failed(replica, exc, generation)
        if retry:
            replicas.remove(replica)
            if replicas:
                return None
        return err

    def _failed(self, replica: Replica, exc: Exception, generation: int) -> tuple[InferError, bool]:
        """A call to ``replica``, begun in its ``generation``, raised ``exc``: (the client's error,
        whether another replica may be tried: then this one leaves the pool until discovery sees
        it healthy, unless it rejoined since the call began: that failure was the old one's)."""
        err, retry = replica.failure(exc)
        if err.code in (Code.UNAVAILABLE, Code.INTERNAL, Code.UNKNOWN):
            replica.errors += 1
        if retry and generation == replica.generation:
            self.discovery.mark_unhealthy(replica, err)
        return err, retry

    def send(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
             affinity: str | None = None, client_stream: str | None = None
             ) -> Coroutine[Any, Any, pb.ModelInferResponse]:
        """Forward one infer request (``raw``: its bytes as the client sent them, if they still
        name its model); ``affinity``: its sequence's key (routing.table.sequence_affinity);
        ``client_stream``: the client's call it came on (RequestContext.stream; see ``infer``). The
        returned awaitable is ``call``'s (or the traced variant's) coroutine: no frame of its own."""
        body = raw if raw is not None else request.SerializeToString()
        if tracing.enabled and (span := tracing.current_var.get()) is not None:
            return traced.send(self, request, body, timeout, affinity, span, client_stream)
        return self.infer(request.model_name, request.model_version, request.id, body, timeout, affinity, client_stream)

    async def infer(self, name: str, version: str, client_id: str, body: bytes, timeout: float | None,
                    affinity: str | None = None, client_stream: str | None = None) -> pb.ModelInferResponse:
        """An untraced infer request's bytes to a replica of (name, version): ``call`` with
        ``StreamPool.infer`` as its ``fn``, written out as one coroutine (every request's path:
        no closure, no frame of ``call``'s and ``finish``'s each); the same replica choice,
        retries and counts. ``client_stream``: the client's call the request came on (None for a
        unary call): a stream's requests share the replica's hop stream, so they reach a batch in the
        order sent (streamed.py says why); the replica is chosen as for any request."""
        table = self.discovery.table  # (as call)
        replicas = list((table.lookup(name) if name in table else await self.routes(name)).replicas_for(version))
        while True:
            replica = pick(replicas) if affinity is None else pick_pinned(replicas, affinity)
            replica.outstanding += 1
            generation = replica.generation
            try:
                pool = replica.streams
                stream, fut, t0 = pool.start(body, timeout, affinity if affinity is not None else client_stream,
                                             client_id)  # (NotSent: another replica)
                try:
                    msg = await fut
                except asyncio.CancelledError:  # (as StreamPool.finish)
                    stream.forget(fut)
                    raise
                finally:
                    pool.latency.observe((time.perf_counter_ns() - t0) / 1000)
                return pool.answer(msg, client_id)
            except CALL_ERRORS as exc:
                if (err := self._another(replicas, replica, exc, generation)) is not None:
                    raise err from None
            finally:
                replica.outstanding -= 1
                # (the failed future holds its error, whose traceback holds this frame and its
                # request bytes: neither the error nor the future stays in a local)
                err = fut = None  # type: ignore[assignment]

    def start(self, request: pb.ModelInferRequest, body: bytes, timeout: float | None
              ) -> Awaitable[pb.ModelInferResponse] | None:
        """Write an untraced infer request (``body``: its bytes) now, without a task: its answer
        comes from the returned awaitable. None when it cannot be written at once (its model's
        replicas are not known yet, no stream takes it): ``send`` it instead. The coalescer's
        flush writes its merged requests in its own loop pass this way; a task would write them
        in the next one."""
        table = self.discovery.table
        name = request.model_name
        if name not in table:
            return None
        try:
            replicas = table.lookup(name).replicas_for(request.model_version)
        except InferError:
            return None  # (send raises it)
        if not replicas:
            return None
        replica = pick(replicas)
        try:
            sent = replica.streams.start(body, timeout, client_id=request.id)
        except NotSent:
            return None
        replica.outstanding += 1
        return self._finish(request, body, timeout, replica, sent, replica.generation)

    async def _finish(self, request: pb.ModelInferRequest, body: bytes, timeout: float | None, replica: Replica,
                      sent: Sent, generation: int) -> pb.ModelInferResponse:
        try:
            return await replica.streams.finish(sent, request.id)
        except CALL_ERRORS as exc:
            err, retry = self._failed(replica, exc, generation)
            if not retry or not any(r.healthy for r in self.replicas):
                raise err from None
        finally:
            replica.outstanding -= 1
            err = None  # type: ignore[assignment]  # (as infer: its future holds the error)
            sent = UNSENT
        # it never reached the service: on another replica, as send would have
        return await self.call(request.model_name, request.model_version,
                               lambda r: r.streams.infer(body, request.id, timeout))

    def stream(self, request: pb.ModelInferRequest, raw: bytes | None, timeout: float | None,
               affinity: str | None = None, client_stream: str | None = None
               ) -> AsyncGenerator[tuple[pb.ModelInferResponse | None, bool], None]:
        """Forward a request of a client's streaming call (never merged): every answer of the
        service as it arrives, (response or None for an empty final one, final). Leaving early
        (the client went away) tells the service to stop the request. ``client_stream``: the
        client's call it came on (RequestContext.stream), whose requests share a hop stream.
        (An async generator: interpreted, in streamed.py, so that this module compiles:
        docs/perf/native.md.)"""
        return streamed.answers(self, request, raw, timeout, affinity, client_stream)

    async def send_merged(self, request: pb.ModelInferRequest, timeout: float | None,
                          members: Sequence[traced.Member]) -> pb.ModelInferResponse:
        """Forward a merged request (coalesce.py) whose ``members`` are sampled client requests."""
        return await traced.send_merged(self, request, request.SerializeToString(), timeout, members)
