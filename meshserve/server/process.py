"""Run one V2Core behind gRPC (+ optional HTTP) on one event loop, with a graceful drain.

On SIGTERM/SIGINT: health turns NOT_SERVING, the servers stop accepting new calls and
finish in-flight ones (grace period), then the core drains its queues and exits.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from meshserve.protocol import http_codec
from meshserve.server import admission, connections, observe, shm, workers
from meshserve.server.core import V2Core
from meshserve.server.grpc_frontend import start_grpc_server
from meshserve.server.h2.client import Channel, GrpcError
from meshserve.server.health import SERVING, HealthState
from meshserve.server.http_frontend import start_http_server, start_metrics_server
from meshserve.server.limits import LISTEN, STREAMS, ServerLimits
from meshserve.server.workers import Worker
from meshserve.telemetry import loop_lag, tracing
from meshserve.telemetry.otlp_loop import Transport

log = logging.getLogger("meshserve.process")

# span export to plaintext OTLP/gRPC goes over meshserve's own HTTP/2 client, from the event loop
OTLP_TRANSPORT = Transport(connect=Channel, status_error=GrpcError)


def configure_tracing(service_name: str, role: str) -> bool:
    """Tracing as the OTEL_* environment configures it (off by default), exporting over
    meshserve's HTTP/2 client (telemetry/otlp_loop.py)."""
    return tracing.configure(service_name, role, transport=OTLP_TRANSPORT)

GEN0_THRESHOLD = 20_000  # see serve(): the garbage collector's young generation, in container allocations
# The longest a thread waits for the GIL while another runs Python (CPython's default: 5 ms). A
# service's model runs in its instance's worker thread (services/base/worker.py), which takes the
# GIL back a few times a run (the queue's wake-up, around onnxruntime's run, the loop's wake-up
# pipe). With the event loop busy on every core it can get, each take waited the whole 5 ms: a
# 50 µs add_sub run took ~100 ms on the thread and its caller ~0.3-0.6 s under a flood of stream
# messages (docs/security.md, "Session 20: messages in a row"). At 0.5 ms: 23-70 ms; throughput
# the same within the runs' spread (mlp c8/c32, add_sub c32, gRPC direct, 3 alternating rounds).
GIL_SWITCH_INTERVAL_S = 0.0005
READY_MARKER = "MESHSERVE_READY"  # printed once on stdout when serving; `meshserve up` waits for it


def parse_ready_line(line: str) -> dict[str, int] | None:
    """Ports from a `MESHSERVE_READY <name> grpc=N [http=N] [metrics=N]` line, else None."""
    if not line.startswith(READY_MARKER):
        return None
    ports = {}
    for part in line.split()[2:]:
        key, _, value = part.partition("=")
        ports[key] = int(value)
    return ports


class StoppableCore(V2Core, Protocol):
    async def stop(self, drain: bool = True) -> None: ...


@dataclass
class Endpoints:
    host: str
    grpc_port: int
    http_port: int | None


async def serve(core: StoppableCore, *, name: str, host: str, grpc_port: int, http_port: int | None,
                metrics_port: int | None = None, grace_s: float = 10.0,
                on_ready: Callable[[Endpoints], Awaitable[None]] | None = None,
                limits: ServerLimits | None = None, worker: Worker | None = None) -> None:
    """``worker``: this process is one of a gateway's workers (meshserve/server/workers.py): it
    shares the ports, the shared-memory registrations and the trace and log settings with its
    siblings and serves its own metrics to them on a private loopback port."""
    limits = limits if limits is not None else ServerLimits()
    admission.configure(limits)
    # descriptors: the soft NOFILE raised to the hard limit, client connections capped below it
    cap = connections.configure(limits.max_connections, limits.max_shm_regions)
    log.debug("at most %d client connections (--max-connections)", cap)
    STREAMS.backlog_bytes = limits.max_stream_backlog_bytes or sys.maxsize
    shm.configure(limits, worker.state if worker is not None else None)
    http_codec.DECODED_MAX = limits.max_request_bytes or sys.maxsize  # (and the body worker's: its environment)
    private = None
    if worker is not None:
        private = await _join_siblings(worker, limits)  # before LISTEN.reuse_port: that port is its own
        LISTEN.reuse_port = True
    health = HealthState()
    grpc_server, gport = await start_grpc_server(core, host, grpc_port, health, limits=limits)
    runner = None
    hport = None
    if http_port is not None:
        runner, hport = await start_http_server(core, host, http_port, limits)
    metrics_runner = None
    if metrics_port is not None:
        metrics_runner, mport = await start_metrics_server(core, host, metrics_port, limits)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the ready line: a SIGTERM right after it drains
        loop.add_signal_handler(sig, stop.set)
    health.set("", SERVING)
    endpoints = Endpoints(host, gport, hport)
    if worker is not None and private is not None:
        worker.metrics.announce(private[1])  # before the ready line: a scrape then finds every worker
    print(f"{READY_MARKER} {name} grpc={gport}" + (f" http={hport}" if hport is not None else "")
          + (f" metrics={mport}" if metrics_runner is not None else ""), flush=True)
    who = name if worker is None else f"{name} worker {worker.index} (pid {os.getpid()})"  # in the log lines
    log.info("%s serving: gRPC %s:%d%s", who, host, gport, f", HTTP {host}:{hport}" if hport else "")
    if on_ready is not None:
        await on_ready(endpoints)
    # The garbage collector, tuned for a server (docs/perf/gc-tuning.md):
    # - what was built at start (modules, protobuf descriptors, loaded models) lives as long as
    #   the process: frozen, no collection walks it again;
    # - a young collection runs after GEN0_THRESHOLD container allocations not yet freed, not
    #   Python's 700: 32 requests in flight hold more than 700 between them, so at the default a
    #   young collection ran every few dozen requests, though no request leaves a cycle behind
    #   (checked with gc.DEBUG_SAVEALL: 0 garbage after 1,000 requests). callgrind counted
    #   7k-28k instructions per gateway request in gc_collect_main (add_sub, c32), 0 after.
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    loop_lag.WATCH.start(loop)  # meshserve_event_loop_lag_seconds (telemetry/loop_lag.py)
    await stop.wait()
    log.info("%s draining", who)
    health.close()  # (NOT_SERVING; open watches end once they have said it)
    stops: list[Awaitable[Any]] = [grpc_server.stop(grace_s)]
    if worker is not None and private is not None:
        worker.metrics.withdraw()
        stops.append(private[0].cleanup())
    if runner is not None:
        stops.append(runner.shutdown())
    if metrics_runner is not None:
        stops.append(metrics_runner.cleanup())
    await asyncio.gather(*stops, return_exceptions=True)
    await core.stop(drain=True)
    if runner is not None:
        await runner.cleanup()
    shm.registry.close()  # unmap the clients' shared-memory regions (never unlinked: they are theirs)
    loop_lag.WATCH.stop()
    log.info("%s stopped", who)


async def _join_siblings(worker: Worker, limits: ServerLimits) -> tuple[Any, int]:
    """Trace and log settings shared with the sibling workers (pulled now, and again on every
    SIGUSR1 from the supervisor), and the private endpoint the siblings read this worker's own
    metrics on (loopback, a port of its own, the directory's token required)."""
    from meshserve.telemetry import log_settings

    kinds: dict[int, tuple[Callable[[], Any], Callable[[Any], object]]] = {
        workers.TRACE: (tracing.trace_settings_state, tracing.restore_trace_settings)}
    logs = log_settings.active
    if logs is not None:
        kinds[workers.LOG] = (logs.current, logs.update)
    share = workers.SettingsShare(worker.state, kinds)
    share.pull()
    observe.shared_settings = share
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, share.pull)
    return await start_metrics_server(worker.metrics, "127.0.0.1", 0, limits)  # type: ignore[arg-type]


# glibc's malloc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap, given back to
# the OS when freed, but raises that threshold to the size of each such block freed (up to 32 MiB).
# After one large answer, the slices of a large refused body (a gzip bomb inflated to the 64 MiB
# limit in 1 MiB pieces, http_codec.DECODE_SLICE) then come from the heap and stay in the RSS once
# freed. Measured with tests/adversarial: the service 59 MiB above its baseline 20 s after the
# bomb; with the threshold held at glibc's own starting value, 128 KiB, back to the baseline.
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def hold_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at MMAP_THRESHOLD (False where libc is not glibc)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run the process's main coroutine on uvloop (MESHSERVE_LOOP=asyncio for the stdlib loop)."""
    hold_mmap_threshold()
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if os.environ.get("MESHSERVE_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
            factory = uvloop.new_event_loop
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            factory = None
    interval = os.environ.get("MESHSERVE_SWITCH_INTERVAL")
    if interval:
        sys.setswitchinterval(float(interval))
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """stderr logging at `level`; fmt "text" (default) or "json" (one object per line)."""
    from meshserve.telemetry import log_settings
    from meshserve.telemetry.logs import formatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    numeric = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=numeric, handlers=[handler])
    log_settings.install(handler, numeric, fmt)  # what /v2/logging (Triton's logging extension) changes
