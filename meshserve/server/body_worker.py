"""Decode large HTTP request bodies (and gRPC messages whose parse would be slow) in a worker
process, so the event loop never waits on them.

A 64 MiB JSON body takes seconds to decode (json, then numpy on the `data` lists), in C calls
that hold the GIL throughout: in a thread it would stall the event loop just the same. So a
body whose JSON part exceeds OFFLOAD_BYTES goes to one worker process (started on first use)
that runs the same `http_codec` function and sends back its result; the event loop only waits
on a pipe. Smaller bodies, the common case, are decoded in place as before. A gRPC ModelInferRequest over
1 MiB made of other fields than raw tensors (meshserve/protocol/infer_checks.py:heavy) is parsed
here too (http_codec.parse_grpc_infer_request): protobuf's parse costs up to ~40 ms per MiB of
small fields. Large answers to write as JSON are rendered here too (an infer answer with much to
write as JSON, a generate answer: meshserve/server/http_frontend.py), in the same lines.

Measured on a 63.7 MiB JSON infer body (3.3 M FP32 values; docs/security.md): inline, the
loop stalled ~700 ms; offloaded, concurrent small requests saw at worst 8-12 ms (baseline 4 ms).
The body goes to the worker as the chunks it arrived in (the pipe writes release the GIL); what
remains on this side is one protobuf parse of the decoded request (memcpy speed).

There are WORKERS such processes (started together at the first large body), each decoding one
body at a time; each restarts itself when its resident memory exceeds WORKER_RSS_LIMIT after a
job, so the memory a huge JSON document needed is given back. The bodies waiting for one wait in a line
per tenant (with a gateway's --tenants; one line without), the lines served round-robin, and a
tenant holds at most its share of the workers at once (``Slots``; max(1, WORKERS x share): one
of the two at the default share of 0.5): one tenant's flood of large bodies never makes another
tenant's body wait for one of the flood's decodes, while a worker the flood may not take is
free (docs/security.md, "Session 13: every shared cap and its tenant share" and "Session 18: the
body workers"). Without tenants the bodies take any free worker, in order.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol import generate_codec, http_codec
from meshserve.protocol.errors import Code, InferError, internal_error
from meshserve.server.admission import tenant_cap
from meshserve.server.slots import Slots

log = logging.getLogger("meshserve.http")

OFFLOAD_BYTES = 64 * 1024  # JSON larger than this is decoded in the worker
# Worker processes: two, so that a tenant at its share (0.5: one) leaves the other to the rest. Both
# start at the first large body (~49 MiB resident each, idle); a third would add memory and, on 2
# cores, only contention.
WORKERS = 2
WORKER_RSS_LIMIT = 256 << 20  # the worker exits after a job that left it larger than this

# What a worker may run: pure functions of (body, *args), each with how its result crosses the
# pipe (protobuf messages travel serialized: generated classes do not pickle).
def _same(value: Any) -> Any:
    return value


def _params_out(params: dict[str, pb.ModelRepositoryParameter]) -> dict[str, bytes]:
    return {k: v.SerializeToString() for k, v in params.items()}


def _params_in(params: dict[str, bytes]) -> dict[str, pb.ModelRepositoryParameter]:
    return {k: pb.ModelRepositoryParameter.FromString(v) for k, v in params.items()}


def _stream_out(result: pb.ModelInferRequest | http_codec.Refused) -> bytes | tuple[str, ...]:
    return result.SerializeToString() if isinstance(result, pb.ModelInferRequest) else tuple(result)


def _stream_in(value: bytes | bytearray | tuple[str, ...]) -> pb.ModelInferRequest | http_codec.Refused:
    return http_codec.Refused(*value) if isinstance(value, tuple) else pb.ModelInferRequest.FromString(value)


FUNCTIONS: dict[str, tuple[Callable[..., Any], Callable[[Any], Any], Callable[[Any], Any]]] = {
    fn.__name__: (fn, out, back)
    for fn, out, back in (
        (http_codec.parse_infer_request, pb.ModelInferRequest.SerializeToString, pb.ModelInferRequest.FromString),
        (http_codec.parse_grpc_infer_request, pb.ModelInferRequest.SerializeToString,
         pb.ModelInferRequest.FromString),
        (http_codec.parse_grpc_stream_request, _stream_out, _stream_in),
        (http_codec.parse_grpc_message, _same, _same),
        (http_codec.parse_json_object, _same, _same),
        (http_codec.parse_trace_settings, _same, _same),
        (http_codec.parse_load_request, _params_out, _params_in),
        (http_codec.parse_unload_request, _params_out, _params_in),
        (http_codec.parse_index_request, _same, _same),
        (http_codec.parse_system_shm_register, _same, _same),
        (http_codec.parse_cuda_shm_register, _same, _same),
        (generate_codec.parse_generate_request, pb.ModelInferRequest.SerializeToString,
         pb.ModelInferRequest.FromString),
        # (answers, not bodies: meshserve/server/http_frontend.py renders large ones here)
        (http_codec.render_answer, _same, http_codec.rendered_answer),
        (generate_codec.render_generate_answer, _same, bytes),
    )
}
_FRAME = struct.Struct("<QQ")  # request: header length, body length; reply: length, flags
_RAW = 1  # reply flag: the payload is the "ok" result's bytes as they are (no pickle)
_EXIT = 2  # reply flag: the worker leaves after this reply (to give its memory back)


def _read_exact(stream: IO[bytes], n: int) -> bytearray | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            return None
        got += k
    return buf


Body = bytes | bytearray | list[bytes]


def _write_all(stream: IO[bytes], data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[stream.write(view) or 0:]


class BodyWorker:
    """The parent's side: WORKERS worker processes, one job at a time each, started together on first use."""

    def __init__(self, workers: int = WORKERS) -> None:
        self.workers = workers
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * workers
        self._slots = Slots(workers)  # who decodes now; who waits, in a line per tenant
        self._io = ThreadPoolExecutor(workers, thread_name_prefix="meshserve-body-worker")
        self._guards = [threading.Lock() for _ in range(workers)]

    async def call(self, fn_name: str, body: Body, *args: Any, tenant: Hashable = None, share: float = 1.0) -> Any:
        """FUNCTIONS[fn_name](body, *args) in a worker; its InferError is raised here.
        `body` may be a list of chunks (sent one after the other: never joined here). ``tenant``:
        the body's (None without tenants), whose line it waits in for a worker; ``share``: the
        tenant's share of the workers (the tenants file's)."""
        slots = self._slots
        cap = self.workers if tenant is None else tenant_cap(self.workers, share)
        index = await slots.take(tenant, cap)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._io, self._call_sync, index, fn_name, body, args)
        finally:
            slots.give(index, tenant)

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])  # the tree this meshserve runs from
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               http_codec.DECODED_MAX_ENV: str(http_codec.DECODED_MAX)}
        return subprocess.Popen([sys.executable, "-m", "meshserve.server.body_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=root, bufsize=0)

    def _warm(self, started: int) -> None:
        """Start every other worker that is not running (and not in use), beside worker ``started``:
        a worker's first job would otherwise wait for its interpreter to start (~0.3 s, over 1 s on
        a busy machine), and the one a tenant at its share leaves free is needed exactly when the
        machine is busy with that tenant's flood."""
        for other, guard in enumerate(self._guards):
            if other != started and guard.acquire(blocking=False):
                try:
                    proc = self._procs[other]
                    if proc is None or proc.poll() is not None:
                        self._procs[other] = self._start()
                finally:
                    guard.release()

    def _call_sync(self, index: int, fn_name: str, body: Body, args: tuple[Any, ...]) -> Any:
        chunks = body if isinstance(body, list) else [body]
        with self._guards[index]:
            proc = self._procs[index]
            if proc is None or proc.poll() is not None:
                proc = self._procs[index] = self._start()
                self._warm(index)
            assert proc.stdin is not None and proc.stdout is not None
            head = pickle.dumps((fn_name, args))
            reply: bytearray | None = None
            flags = 0
            try:
                _write_all(proc.stdin, _FRAME.pack(len(head), sum(map(len, chunks))) + head)
                for chunk in chunks:  # unbuffered pipe: straight from the chunks, GIL released
                    _write_all(proc.stdin, chunk)
                frame = _read_exact(proc.stdout, _FRAME.size)
                if frame:
                    length, flags = _FRAME.unpack(frame)
                    reply = _read_exact(proc.stdout, length)
            except OSError:
                reply = None
            if reply is None:
                proc.kill()
                proc.wait()
                self._procs[index] = None
                raise InferError.unavailable("the HTTP body decoder process exited; retry the request")
            if flags & _EXIT:  # (its replacement starts now, while it is not needed)
                proc.wait()
                self._procs[index] = self._start()
        # A parsed infer request comes back as its serialized bytes, parsed once here (the
        # only part of a big body's decode that holds this process's GIL: a memcpy-speed parse).
        if flags & _RAW:
            return FUNCTIONS[fn_name][2](reply)
        status, value = pickle.loads(reply)
        if status == "ok":
            return FUNCTIONS[fn_name][2](value)
        code, message = value
        raise InferError(Code(code), message)

    def close(self) -> None:
        procs, self._procs = self._procs, [None] * self.workers
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self._io.shutdown(wait=False)


_worker: BodyWorker | None = None
TRIM_AFTER_BYTES = 8 << 20  # a request body this large returns its memory to the OS afterwards
_malloc_trim: Callable[[int], int] | None = None


def release_memory() -> None:
    """glibc keeps freed heap memory for reuse (the buffers of a large body: RSS measured
    +50-140 MiB after a 64 MiB body); malloc_trim gives it back. Called in a thread (ctypes
    releases the GIL), after a large body is done with."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = lambda pad: 0  # noqa: E731 - not glibc: nothing to do
    _malloc_trim(0)


_trim_due: asyncio.TimerHandle | None = None


def release_memory_soon(loop: asyncio.AbstractEventLoop, delay_s: float = 0.2) -> None:
    """`release_memory` in a thread `delay_s` from now (once the buffers of what just ended are
    freed), at most one pending at a time: a connection that received or held much (a pipelining
    flood, a stream whose client did not read) ends, and its memory returns to the OS."""
    global _trim_due
    if _trim_due is not None:
        return

    def trim() -> None:
        global _trim_due
        _trim_due = None
        loop.run_in_executor(None, release_memory)

    _trim_due = loop.call_later(delay_s, trim)


def worker() -> BodyWorker:
    """The process's worker (shared by every HTTP front end of the process)."""
    global _worker
    if _worker is None:
        _worker = BodyWorker()
    return _worker


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    while True:
        frame = _read_exact(stdin, _FRAME.size)
        if frame is None:
            return  # the parent closed the pipe (or exited)
        head_len, body_len = _FRAME.unpack(frame)
        head = _read_exact(stdin, head_len)
        body = _read_exact(stdin, body_len)
        if head is None or body is None:
            return
        fn_name, args = pickle.loads(head)
        fn, out, _ = FUNCTIONS[fn_name]
        try:
            result: tuple[str, Any] = ("ok", out(fn(body, *args)))
        except InferError as exc:
            result = ("err", (exc.code.value, exc.message))
        except Exception as exc:  # a decoder bug: report it like the in-process path would
            log.exception("internal error decoding a request body in the worker")
            result = ("err", (Code.INTERNAL.value, internal_error(exc).message))
        del body
        leave = _rss_bytes() > WORKER_RSS_LIMIT
        flags = _EXIT if leave else 0
        if result[0] == "ok" and isinstance(result[1], bytes):
            reply, flags = result[1], flags | _RAW
        else:
            reply = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        del result
        stdout.write(_FRAME.pack(len(reply), flags))
        stdout.write(reply)
        stdout.flush()
        if leave:
            return


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    logging.basicConfig(level=logging.WARNING)
    _serve(stdin, stdout)


if __name__ == "__main__":
    main()
