"""Instructions per unary call of meshserve's HTTP/2 gRPC server alone (meshserve/server/h2/server.py):
a ServerConnection in this process, fed 8 calls per read (HEADERS + DATA frames as our client
sends them) through a transport that only counts writes, under callgrind.

    python -m load.bench.h2_calls [--handler answer|wait] [--calls 8000]

`answer`: the handler returns at once (a cached answer); `wait`: it awaits a future resolved in
the next loop pass (a model run). The process runs twice under callgrind (800 calls, then 800 +
--calls), with PYTHONHASHSEED=0, and the difference divided by --calls is printed: the server's
per-call path (frames, stream, the handler's start, the reply) without sockets or a client.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from load.bench import callgrind

PER_READ = 8


class _Transport:
    def __init__(self) -> None:
        self.writes = 0

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if key == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.writes += 1

    def writelines(self, data: list[bytes]) -> None:
        self.writes += 1

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass


async def _calls(n: int, handler: str) -> None:
    from meshserve.server.h2 import H2GrpcServer, unary_unary
    from meshserve.server.h2.frames import (
        DATA,
        END_HEADERS,
        END_STREAM,
        HEADERS,
        MESSAGE_PREFIX,
        PREFACE,
        SETTINGS,
        U32,
        WINDOW_UPDATE,
        frame,
        literal,
    )
    from meshserve.server.h2.server import ServerConnection

    loop = asyncio.get_running_loop()

    async def answer(req: bytes, ctx: Any) -> bytes:
        return req

    async def wait(req: bytes, ctx: Any) -> bytes:
        fut = loop.create_future()
        loop.call_soon(fut.set_result, req)
        return await fut

    server = H2GrpcServer()
    server.add_methods("b.Bench", {"Call": unary_unary(answer if handler == "answer" else wait)})
    conn = ServerConnection(server)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    conn.data_received(PREFACE + frame(SETTINGS, 0, 0))
    block = (literal(b":method", b"POST") + literal(b":scheme", b"http") + literal(b":path", b"/b.Bench/Call")
             + literal(b":authority", b"127.0.0.1:8001") + literal(b"content-type", b"application/grpc")
             + literal(b"te", b"trailers"))
    payload = b"x" * 100
    message = MESSAGE_PREFIX.pack(0, len(payload)) + payload
    sid = 1
    for _ in range(n // PER_READ):
        frames = []
        for _ in range(PER_READ):
            frames.append(frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, END_STREAM, sid, message))
            sid += 2
        frames.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(PER_READ * len(message))))  # the client read them
        conn.data_received(b"".join(frames))
        while conn.streams:
            await asyncio.sleep(0)


def _child(n: int, handler: str) -> None:
    import uvloop

    gc.freeze()
    gc.set_threshold(20_000, *gc.get_threshold()[1:])  # as meshserve/server/process.py
    uvloop.run(_calls(n, handler))


def _count(n: int, handler: str, out: Path) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.getcwd())
    cmd = [*callgrind.command(out), sys.executable, "-m", "load.bench.h2_calls", "--child", str(n),
           "--handler", handler]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return callgrind.totals(out)[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.h2_calls", description=__doc__.splitlines()[0])
    ap.add_argument("--handler", choices=("answer", "wait"), default="answer")
    ap.add_argument("--calls", type=int, default=8000)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.handler)
        return
    if not callgrind.available():
        sys.exit("needs valgrind (callgrind_annotate, callgrind_control)")
    with tempfile.TemporaryDirectory() as tmp:
        base = _count(800, args.handler, Path(tmp) / "base.out")
        more = _count(800 + args.calls, args.handler, Path(tmp) / "more.out")
    print(f"h2 server, handler {args.handler}: {(more - base) // args.calls} instructions per call")


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
