"""OTLP/gRPC span export from the event loop, over meshserve's own HTTP/2 client.

The SDK's OTLP/gRPC exporter runs in a thread and goes through grpcio's synchronous channel:
per export it re-parses our bytes into a protobuf message, serializes it again and runs
grpcio's C core, all while taking the GIL from the event loop in bursts (measured: the loop
thread paid ~40 µs more per request in socket writes alone at 100% sampling, the classic
convoy of an I/O thread and a busy thread). Here export is one more HTTP/2 call on the loop
that serves requests: spans are encoded when they end, a batch is their bytes joined, sent
as one unary ``TraceService/Export`` call; nothing else runs in another thread.

The HTTP/2 client is the server layer's (``meshserve.server.h2``): it comes in as a ``Transport``
(``meshserve.server.process.OTLP_TRANSPORT``), so telemetry imports no server module.

Used for plaintext endpoints (``http://…``, or a bare ``host:port`` with
``OTEL_EXPORTER_OTLP[_TRACES]_INSECURE=true``) without client certificates or compression;
anything else (TLS, ``gzip``, OTLP/HTTP, console) goes through the SDK's exporters.
Honours ``OTEL_EXPORTER_OTLP[_TRACES]_HEADERS`` and ``_TIMEOUT`` (seconds, as the Python SDK
reads it) and the ``OTEL_BSP_*`` batching variables; retries transient failures (UNAVAILABLE,
DEADLINE_EXCEEDED, ... and connection errors) with backoff, then drops the batch with a
warning (at most one a minute). Spans still queued at exit are sent from a short-lived loop
of their own.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from meshserve.telemetry.spans import DEFER_S, Record, Scope, Span, env_int

log = logging.getLogger("meshserve.tracing")

EXPORT_PATH = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
RETRYABLE = frozenset({1, 4, 8, 10, 11, 14, 15})  # the OTLP spec's transient gRPC codes
BACKOFF_S = (1.0, 2.0, 4.0)


class Connection(Protocol):
    async def unary(self, path: str, payload: bytes, metadata: Sequence[tuple[str, str]] = (),
                    timeout: float | None = None) -> bytes: ...


class Channel(Protocol):
    """A lazily connected, reconnected-when-broken client connection to one endpoint."""

    async def get(self) -> Connection: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Transport:
    """The gRPC client export goes over, given by the server layer: ``connect(host:port,
    connect_timeout_s)`` makes a channel; a call that ends with a non-OK status raises
    ``status_error``, whose ``code`` and ``details`` say which."""

    connect: Callable[[str, float], Channel]
    status_error: type[Exception]


@dataclass(frozen=True)
class Target:
    """Where and how to send: ``host:port``, request metadata, per-call timeout."""

    endpoint: str
    headers: tuple[tuple[str, str], ...]
    timeout_s: float


def target_from_env(env: Mapping[str, str]) -> Target | None:
    """The plaintext OTLP/gRPC target the environment configures, or None when it asks for
    something only the SDK's exporter does (TLS, client certificates, compression)."""
    def get(name: str, default: str = "") -> str:
        return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}") or default

    endpoint = get("ENDPOINT", "http://localhost:4317").strip()
    if get("COMPRESSION").strip().lower() not in ("", "none") or get("CERTIFICATE") or get("CLIENT_KEY") \
            or get("CLIENT_CERTIFICATE"):
        return None
    url = urllib.parse.urlsplit(endpoint)
    if url.scheme == "https":
        return None
    if url.scheme == "http":
        hostport = url.netloc
    elif "://" not in endpoint and get("INSECURE").strip().lower() == "true":
        hostport = endpoint.split("/", 1)[0]
    else:
        return None  # a bare host:port is TLS unless INSECURE says otherwise (the SDK's rule)
    if not hostport:
        return None
    if ":" not in hostport.rsplit("]", 1)[-1]:
        hostport += ":4317"
    headers = []
    for item in get("HEADERS").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            headers.append((urllib.parse.unquote(key.strip()).lower(), urllib.parse.unquote(value.strip())))
    try:
        timeout = float(get("TIMEOUT", "10"))
    except ValueError:
        timeout = 10.0
    return Target(hostport, tuple(headers), timeout if timeout > 0 else 10.0)


class LoopExportQueue:
    """The batching span processor for the event loop (same interface as spans.ExportQueue).

    ``on_end`` encodes the span and queues it; a full batch is sent at once, a partial one
    after ``OTEL_BSP_SCHEDULE_DELAY``; one export is in flight at a time, and a full queue
    drops spans and counts them (never blocks or grows without bound)."""

    def __init__(self, target: Target, env: Mapping[str, str], encode: Callable[[Span], bytes],
                 encode_batch: Callable[[Sequence[tuple[Scope, bytes]]], bytes],
                 encode_record: Callable[[Record], bytes], transport: Transport):
        self.target = target
        self.transport = transport
        self.encode = encode
        self.encode_record = encode_record
        self.encode_batch = encode_batch
        self.delay_s = env_int(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.max_batch = min(env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self.max_queue)
        self.exit_timeout_s = min(env_int(env, "OTEL_BSP_EXPORT_TIMEOUT", 30000) / 1000, 10.0)
        self.dropped = 0  # queue full, or a batch given up after retries
        self.exported = 0
        # only the encoded bytes wait for export: the span and its attribute dict are freed when it
        # ends (measured: holding 512 span objects per batch cost the request path cache misses)
        self._spans: list[tuple[Scope, bytes]] = []
        self._ended: list[Span | Record] = []  # ended, not yet encoded (see on_end)
        self._jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = []  # deferred span recording (defer)
        self._encode_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._timer: asyncio.TimerHandle | None = None
        self._sending = False
        self._channel: Channel | None = None
        self._stopped = False
        self._warned_at = 0.0

    # ---- on the loop ------------------------------------------------------------------------
    def on_end(self, span: Span | Record) -> None:
        """Queue an ended span (or a Record: a span recorded without a Span object). It is
        encoded ``DEFER_S`` later, with the others that ended meanwhile: not while the request
        that ended it still has its response to write (and, in a merged request, the other
        members theirs)."""
        ended = self._ended
        if self._stopped or len(self._spans) + len(ended) >= self.max_queue:
            self.dropped += 1
            return
        if self._encode_pending and threading.get_ident() == self._loop_thread \
                and not self._loop.is_closed():  # type: ignore[union-attr]  # pending: the loop is set
            ended.append(span)  # the usual case: an encode is already scheduled on this loop
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (yet): sent by a later flush, or at exit
                self._spans.append(self._encoded(span))
                return
            self._adopt(loop)
        if threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._queue_ended, span)
        else:
            self._queue_ended(span)

    on_record = on_end

    def _adopt(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from ``loop`` (this thread's) from now on. What belonged to the loop before it,
        now closed, is forgotten: its timers never fire (an encode or a schedule-delay timer still
        marked as armed held every later span back), and its connection is that loop's (an export
        on it from this one never completes). A process may run loops in turn: tests, a CLI."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._encode_pending = False
        self._timer = None
        self._sending = False  # (a send in flight was cancelled with its loop: counted as dropped)
        channel, self._channel = self._channel, None
        if channel is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: the socket is closed here
                channel.close()

    # ---- what is waiting (tests and diagnostics read these instead of the lists) ------------
    def queued(self) -> list[bytes]:
        """The encoded spans waiting for export, oldest first."""
        return [blob for _, blob in self._spans]

    def deferred_jobs(self) -> int:
        """How many ``defer`` jobs wait for the next encoding pass."""
        return len(self._jobs)

    def discard(self) -> None:
        """Drop the spans waiting for export (nothing is sent for them)."""
        self._spans.clear()

    def defer(self, job: Callable[..., None], *args: Any) -> None:
        """Run ``job(*args)`` (on this loop: it records spans) just before the spans that ended
        meanwhile are encoded, ``DEFER_S`` from now at the latest: one timer and one pass for
        all the tracing work that clients do not wait for."""
        loop = self._loop
        if loop is None or loop.is_closed() or threading.get_ident() != self._loop_thread:
            asyncio.get_running_loop().call_later(DEFER_S, job, *args)  # no span has ended on this loop yet
            return
        self._jobs.append((job, args))
        if not self._encode_pending:
            self._encode_pending = True
            loop.call_later(DEFER_S, self._encode_and_poke)

    def _encoded(self, span: Span | Record) -> tuple[Scope, bytes]:
        return (span._scope, self.encode(span)) if isinstance(span, Span) else (span[0], self.encode_record(span))

    def _queue_ended(self, span: Span | Record) -> None:
        self._ended.append(span)
        if not self._encode_pending and self._loop is not None:
            self._encode_pending = True
            self._loop.call_later(DEFER_S, self._encode_and_poke)

    def _encode_ended(self) -> None:
        if self._jobs:
            jobs, self._jobs = self._jobs, []
            for job, args in jobs:
                try:
                    job(*args)
                except Exception:  # a tracing bug must not stop the other spans
                    log.exception("recording spans failed")
        ended, self._ended = self._ended, []
        self._encode_pending = False
        encoded = self._encoded
        self._spans += [encoded(span) for span in ended]

    def _encode_and_poke(self) -> None:
        self._encode_ended()
        self._poke()

    def _poke(self) -> None:
        if self._sending or not self._spans or self._loop is None or self._loop.is_closed():
            return
        if len(self._spans) >= self.max_batch:
            self._start_send()
        elif self._timer is None:
            self._timer = self._loop.call_later(self.delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._spans and not self._sending:
            self._start_send()

    def _start_send(self) -> None:
        assert self._loop is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._spans = self._spans[:self.max_batch], self._spans[self.max_batch:]
        self._sending = True
        # a context of its own: the export must not run as part of whichever request ended the span
        self._loop.create_task(self._send(batch), context=contextvars.Context())

    async def _send(self, batch: list[tuple[Scope, bytes]]) -> None:
        try:
            await self._export(batch)
        except asyncio.CancelledError:  # its loop is closing (asyncio.run ends): counted, not sent
            self.dropped += len(batch)
            raise
        finally:
            self._sending = False
            self._poke()

    async def _export(self, batch: Sequence[tuple[Scope, bytes]], channel: Channel | None = None) -> bool:
        body = self.encode_batch(batch)
        if channel is None:
            if self._channel is None:
                self._channel = self.transport.connect(self.target.endpoint, min(5.0, self.target.timeout_s))
            channel = self._channel
        error = ""
        for delay in (*BACKOFF_S, None):
            try:
                conn = await channel.get()
                await conn.unary(EXPORT_PATH, body, self.target.headers, timeout=self.target.timeout_s)
                self.exported += len(batch)
                return True
            except self.transport.status_error as exc:
                code = getattr(exc, "code", None)
                error = f"gRPC status {code}: {getattr(exc, 'details', exc)}"
                if code not in RETRYABLE:
                    break
            except (TimeoutError, OSError, ConnectionError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if delay is None or self._stopped:
                break
            await asyncio.sleep(delay)
        self.dropped += len(batch)
        now = time.monotonic()
        if now - self._warned_at > 60:
            self._warned_at = now
            log.warning("dropped %d spans: OTLP export to %s failed (%s); %d dropped so far",
                        len(batch), self.target.endpoint, error, self.dropped)
        return False

    # ---- from anywhere ----------------------------------------------------------------------
    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Start sending what is queued (on the loop); True when nothing was queued."""
        if self._loop is not None and not self._loop.is_closed() and (self._spans or self._ended):
            self._loop.call_soon_threadsafe(self._flush_now)
            return False
        return not self._spans and not self._ended

    def _flush_now(self) -> None:
        self._encode_ended()
        if self._spans and not self._sending:
            self._start_send()

    def shutdown(self) -> None:
        """Send what is still queued from a loop of its own (the serving loop is gone at exit)."""
        if self._stopped:
            return
        if self._timer is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._timer.cancel)
        self._encode_ended()  # deferred jobs first: the spans they record are sent too
        self._stopped = True
        left, self._spans = self._spans, []
        if not left:
            return

        async def final() -> None:
            channel = self.transport.connect(self.target.endpoint, min(2.0, self.target.timeout_s))
            try:
                for i in range(0, len(left), self.max_batch):
                    if not await self._export(left[i:i + self.max_batch], channel):
                        break
            finally:
                channel.close()

        done = threading.Event()

        def run() -> None:
            try:
                asyncio.run(asyncio.wait_for(final(), self.exit_timeout_s))
            except Exception as exc:  # at exit: report and go
                log.warning("%d spans not exported at exit: %s", len(left), exc)
            finally:
                done.set()

        threading.Thread(target=run, name="meshserve-span-export-exit", daemon=True).start()
        done.wait(self.exit_timeout_s + 1)
