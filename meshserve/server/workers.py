"""Several processes serving the same ports (``meshserve gateway --workers N``).

The supervisor (``supervise``) binds each port once with SO_REUSEPORT and keeps that socket,
bound but not listening, for as long as it runs: a port of 0 becomes one port, chosen once, that
no other program can take while workers restart. It then starts N worker processes; each binds
the same ports with SO_REUSEPORT (``meshserve/server/limits.py:LISTEN``) and the kernel spreads
new connections over the listening workers (a connection stays with the worker that accepted
it). The supervisor prints one ``MESHSERVE_READY`` line when every worker serves, restarts a
worker that exits (with backoff), forwards SIGUSR1 (a worker's "shared settings changed") to
every worker and drains them all on SIGTERM / SIGINT.

What must look like one process lives in a directory the supervisor makes for its workers
(``SharedState``): a lock file (flock), a few generation counters in a small mmap (one 8-byte
read tells a worker whether its copy is current), the shared-memory registrations
(``meshserve/server/shm.py:SharedRegistry``), the trace and log settings (``SettingsShare``)
and, per worker, the private loopback port its own metrics are read on (``WorkerMetrics``).
One worker (``--workers 1``, the default) has none of this: it is the plain process.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import json
import logging
import mmap
import os
import secrets
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any

from meshserve.protocol.errors import Code, InferError
from meshserve.server.access import Grant, Op
from meshserve.server.core import RequestContext

log = logging.getLogger("meshserve.workers")

# The default of `meshserve gateway --workers` (and `meshserve up --gateway-workers`): one
# process, no supervisor. Measured: docs/perf/gateway-workers.md (quiet machine,
# 2 workers median 1.05x of 1 over 18 cells, 0.84x in add_sub HTTP c32; and on a loaded one).
DEFAULT_WORKERS = 1

SHM, TRACE, LOG = 0, 1, 2  # generation counters in SharedState's mmap
_SLOTS = 8
TOKEN_HEADER = "x-meshserve-worker-token"  # a sibling's metrics request carries the directory's token
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay after a worker exits, the most it grows to (doubling)
STEADY_S = 60.0  # a worker that served this long before exiting restarts after the first delay again
SIBLING_TIMEOUT_S = 2.0


class SharedState:
    """The workers' shared directory: lock, generation counters, token, JSON documents."""

    def __init__(self, directory: str, index: int):
        self.directory = directory
        self.index = index
        self._lock_fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CLOEXEC)
        with open(os.path.join(directory, "generations"), "r+b") as f:
            self._generations = mmap.mmap(f.fileno(), _SLOTS * 8)
        with open(os.path.join(directory, "token")) as f:
            self.token = f.read().strip()

    @staticmethod
    def create(directory: str) -> None:
        """Lay out a fresh directory (the supervisor, before it starts a worker)."""
        with open(os.path.join(directory, "lock"), "wb"):
            pass
        with open(os.path.join(directory, "generations"), "wb") as f:
            f.write(bytes(_SLOTS * 8))
        fd = os.open(os.path.join(directory, "token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
        os.mkdir(os.path.join(directory, "workers"))

    def generation(self, slot: int) -> int:
        value: int = struct.unpack_from("<Q", self._generations, slot * 8)[0]
        return value

    def bump(self, slot: int) -> int:
        """The next generation of ``slot`` (call it holding the lock)."""
        value = self.generation(slot) + 1
        struct.pack_into("<Q", self._generations, slot * 8, value)
        return value

    @contextlib.contextmanager
    def locked(self, exclusive: bool = True) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def path(self, *parts: str) -> str:
        return os.path.join(self.directory, *parts)

    def read_json(self, name: str) -> Any:
        try:
            with open(self.path(name), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def write_json(self, name: str, value: Any) -> None:
        """Replace ``name`` at once (a reader sees the old document or the new one)."""
        path = self.path(name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)

    def close(self) -> None:
        self._generations.close()
        os.close(self._lock_fd)


# ---- trace and log settings -------------------------------------------------------------------

class SettingsShare:
    """Triton's trace and log settings, the same in every worker: an update (under the lock)
    starts from the newest shared settings, is written to the directory, bumps its counter and
    signals the supervisor, which sends SIGUSR1 to every worker; each then applies what changed
    (``pull``). A read pulls first, so it sees an update made through any worker."""

    def __init__(self, state: SharedState, kinds: dict[int, tuple[Callable[[], Any], Callable[[Any], object]]]):
        """``kinds``: slot -> (this process's settings as JSON, apply such settings here)."""
        self.state = state
        self.kinds = kinds
        self._seen = dict.fromkeys(kinds, 0)

    def pull(self) -> None:
        for slot, (_, apply) in self.kinds.items():
            gen = self.state.generation(slot)
            if gen != self._seen[slot]:
                value = self.state.read_json(f"settings-{slot}.json")
                if value is not None:
                    apply(value)
                self._seen[slot] = gen

    def run(self, slot: int, action: Callable[[], Any], update: bool) -> Any:
        """``action`` (a read, or an update when ``update``) on the newest shared settings."""
        if not update:
            self.pull()
            return action()
        with self.state.locked():
            self.pull()
            result = action()
            self.state.write_json(f"settings-{slot}.json", self.kinds[slot][0]())
            self._seen[slot] = self.state.bump(slot)
        with contextlib.suppress(OSError):
            os.kill(os.getppid(), signal.SIGUSR1)  # the supervisor tells every worker
        return result


# ---- metrics: the answering worker reads its siblings' ------------------------------------

class WorkerMetrics:
    """A worker's private metrics endpoint (loopback, port announced in the directory, the
    directory's token required) and the reading of its siblings' for a /metrics scrape."""

    def __init__(self, state: SharedState):
        self.state = state
        self.port = 0
        self.local: Callable[[], Awaitable[tuple[bytes, str]]] | None = None  # this worker's own exposition

    async def metrics_text(self) -> tuple[bytes, str]:
        """What the private endpoint serves: this worker's own counts (the siblings label them)."""
        assert self.local is not None, "WorkerMetrics.local was not set"
        return await self.local()

    def announce(self, port: int) -> None:
        self.port = port
        self.state.write_json(os.path.join("workers", f"{self.state.index}.json"),
                              {"pid": os.getpid(), "port": port})

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.state.path("workers", f"{self.state.index}.json"))

    def authorize(self, op: Op, model: str, ctx: RequestContext) -> Grant:
        """The private endpoint answers only a sibling (who knows the directory's token)."""
        if not hmac.compare_digest(ctx.headers.get(TOKEN_HEADER, ""), self.state.token):
            raise InferError(Code.PERMISSION_DENIED, "this port serves the gateway's sibling workers only")
        return Grant()

    def siblings(self) -> list[tuple[int, int]]:
        """(index, private metrics port) of every other worker that announced one."""
        out = []
        for name in sorted(os.listdir(self.state.path("workers"))):
            index = name.removesuffix(".json")
            if not index.isdigit() or int(index) == self.state.index:
                continue
            entry = self.state.read_json(os.path.join("workers", name))
            if isinstance(entry, dict):
                out.append((int(index), int(entry["port"])))
        return out

    async def sibling_texts(self) -> list[tuple[int, str]]:
        """Each live sibling's own exposition (a sibling that does not answer is left out)."""
        siblings = self.siblings()
        texts = await asyncio.gather(*(self._fetch(port) for _, port in siblings), return_exceptions=True)
        out = []
        for (index, port), text in zip(siblings, texts, strict=True):
            if isinstance(text, BaseException):
                log.debug("metrics of worker %d (port %d) not read: %s", index, port, text)
            else:
                out.append((index, text))
        return out

    async def _fetch(self, port: int) -> str:
        async def fetch() -> str:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n{TOKEN_HEADER}: {self.state.token}\r\n"
                             "Connection: close\r\n\r\n".encode())
                data = await reader.read()
            finally:
                writer.close()
            head, _, body = data.partition(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0]
            if not status.startswith(b"HTTP/1.1 200"):
                raise OSError(f"answered {status!r}")
            return body.decode()

        return await asyncio.wait_for(fetch(), SIBLING_TIMEOUT_S)


class Worker:
    """What a worker process is given: its index and the supervisor's directory."""

    def __init__(self, directory: str, index: int):
        self.state = SharedState(directory, index)
        self.index = index
        self.metrics = WorkerMetrics(self.state)


# ---- the supervisor ---------------------------------------------------------------------------

def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port) with SO_REUSEPORT, not listening: the port
    stays the workers' while it is open, and the kernel gives it no connection."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def die_with_parent() -> None:
    """A child process (a worker, a process of `meshserve up`) gets SIGTERM when its parent dies."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Process:
    def __init__(self, index: int):
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.started = 0.0
        self.delay = RESTART_BACKOFF_S[0]


@dataclass(eq=False)
class Supervisor:
    """Starts ``count`` workers (``argv(index, ports, directory)``), keeps them running, drains them."""

    name: str
    count: InitVar[int]
    ports: dict[str, int]
    argv: Callable[[int, dict[str, int], str], list[str]]
    directory: str
    start_timeout_s: float = 120.0
    grace_s: float = 30.0
    workers: list[_Process] = field(init=False)
    stopping: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    serving: bool = field(init=False, default=False)  # every worker was ready once: from then on an exit means a restart

    def __post_init__(self, count: int) -> None:
        self.workers = [_Process(i) for i in range(count)]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        loop.add_signal_handler(signal.SIGUSR1, self._forward_settings)
        for w in self.workers:
            await self._start(w)
        watchers = [asyncio.ensure_future(self._watch(w)) for w in self.workers]
        try:
            if not await self._all_ready():
                return 1
            self.serving = True
            from meshserve.server.process import READY_MARKER

            print(f"{READY_MARKER} {self.name} "
                  + " ".join(f"{k}={v}" for k, v in self.ports.items()), flush=True)
            log.info("%s: %d workers serving (pids %s)", self.name, len(self.workers),
                     ", ".join(str(w.proc.pid) for w in self.workers if w.proc is not None))
            await self.stopping.wait()
            log.info("%s: draining %d workers", self.name, len(self.workers))
            return await self._drain()
        finally:
            for t in watchers:
                t.cancel()

    async def _start(self, w: _Process) -> None:
        w.ready.clear()
        w.started = time.monotonic()
        w.proc = await asyncio.create_subprocess_exec(*self.argv(w.index, self.ports, self.directory),
                                                      stdout=asyncio.subprocess.PIPE,
                                                      preexec_fn=die_with_parent)
        asyncio.ensure_future(self._pump(w, w.proc))
        log.info("%s: worker %d started (pid %d)", self.name, w.index, w.proc.pid)
        log.debug("%s: worker %d: %s", self.name, w.index, " ".join(self.argv(w.index, self.ports, self.directory)))

    async def _pump(self, w: _Process, proc: asyncio.subprocess.Process) -> None:
        from meshserve.server.process import READY_MARKER

        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith(READY_MARKER):
                w.ready.set()
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    async def _all_ready(self) -> bool:
        """Every worker serving; False (and every worker stopped) when one exits first or
        the start takes longer than start_timeout_s."""
        deadline = time.monotonic() + self.start_timeout_s
        while not all(w.ready.is_set() for w in self.workers):
            failed = [w for w in self.workers if w.proc is not None and w.proc.returncode is not None]
            why = None
            if failed:
                w = failed[0]
                why = (f"worker {w.index} exited with code {w.proc.returncode if w.proc else '?'} before every "
                       "worker was ready")
            elif time.monotonic() > deadline:
                why = f"the workers did not become ready within {self.start_timeout_s:.0f}s"
            elif self.stopping.is_set():
                why = "stopped while starting"
            if why is not None:
                print(f"meshserve {self.name}: {why}; stopping", file=sys.stderr, flush=True)
                await self._drain()
                return False
            await asyncio.sleep(0.05)
        return True

    async def _watch(self, w: _Process) -> None:
        """Restart ``w`` when it exits once every worker has served."""
        while True:
            assert w.proc is not None
            code = await w.proc.wait()
            if self.stopping.is_set() or not self.serving:
                return  # draining, or a worker failed to start (_all_ready stops them all)
            if time.monotonic() - w.started > STEADY_S:
                w.delay = RESTART_BACKOFF_S[0]
            log.warning("%s: worker %d (pid %d) exited with code %d; restarting it in %.1fs",
                        self.name, w.index, w.proc.pid, code, w.delay)
            try:
                await asyncio.wait_for(self.stopping.wait(), w.delay)
                return
            except TimeoutError:
                pass
            w.delay = min(w.delay * 2, RESTART_BACKOFF_S[1])
            await self._start(w)

    def _forward_settings(self) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None and w.ready.is_set():
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGUSR1)

    async def _drain(self) -> int:
        """SIGTERM to every worker (each drains as a single process does), SIGKILL after grace_s."""
        live = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), self.grace_s)
        except TimeoutError:
            for p in live:
                if p.returncode is None:
                    log.warning("%s: worker pid %d did not stop within %.0fs: killed", self.name, p.pid, self.grace_s)
                    p.kill()
            await asyncio.gather(*(p.wait() for p in live))
        codes = [p.returncode for p in live]
        log.info("%s: workers stopped (exit codes %s)", self.name, codes)
        return 0


def supervise(name: str, count: int, host: str, ports: dict[str, int],
              argv: Callable[[int, dict[str, int], str], list[str]]) -> int:
    """Run ``count`` workers of ``name`` on ``ports`` (name -> port, 0 = free); the exit code."""
    directory = tempfile.mkdtemp(prefix=f"meshserve-{name}-")
    reserved: list[socket.socket] = []
    try:
        SharedState.create(directory)
        chosen = {}
        for key, port in ports.items():
            try:
                sock = reserve_port(host, port)
            except OSError as exc:
                print(f"meshserve {name}: cannot bind the {key} port {host}:{port}: {exc}", file=sys.stderr)
                return 1
            reserved.append(sock)
            chosen[key] = int(sock.getsockname()[1])
        return asyncio.run(Supervisor(name, count, chosen, argv, directory).run())
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(directory, ignore_errors=True)
