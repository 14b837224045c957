"""Server CPU per unary gRPC call of meshserve's HTTP/2 server (meshserve.server.h2), for
before/after comparisons of the frame layer: a bare H2GrpcServer with an echo handler in a
child process, a closed loop of unary calls from our own client at a fixed concurrency, and the
child's CPU time (utime+stime from /proc) divided by the calls.

    python -m load.h2cpu [--calls 20000] [--concurrency 32] [--size 1024] [--repeat 3] [--stream]

--stream: each worker keeps one bidirectional call open and sends its messages on it (the
gateway -> service hop's shape) instead of one unary call per message.

Run it back to back against two trees (PYTHONPATH=tree) on the same quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

from load.bench.procs import cpu_seconds

SERVER = r"""
import asyncio, sys
from meshserve.server.h2 import H2GrpcServer, stream_stream, unary_unary
async def main():
    async def echo(req, ctx):
        return req
    async def bidi(reqs, ctx):
        async for m in reqs:
            yield m
    s = H2GrpcServer()
    s.add_methods("b.Bench", {"Echo": unary_unary(echo), "Bidi": stream_stream(bidi)})
    port = await s.bind("127.0.0.1", 0)
    await s.start()
    print(port, flush=True)
    await asyncio.Event().wait()
try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""


async def drive(port: int, calls: int, concurrency: int, size: int, stream: bool = False) -> None:
    from meshserve.server.h2 import Channel
    ch = Channel(f"127.0.0.1:{port}")
    conn = await ch.get()
    payload = b"x" * size
    left = calls
    loop = asyncio.get_running_loop()

    async def worker() -> None:
        nonlocal left
        if not stream:
            while left > 0:
                left -= 1
                await conn.unary("/b.Bench/Echo", payload, timeout=30)
            return
        waiting: list[asyncio.Future[bytes]] = []

        def on_message(msg: bytes) -> None:
            waiting.pop(0).set_result(msg)

        def on_close(code: int, details: str) -> None:
            for f in waiting:
                f.set_exception(ConnectionError(details))

        call = conn.open_stream("/b.Bench/Bidi", (), on_message, on_close)
        while left > 0:
            left -= 1
            fut = loop.create_future()
            waiting.append(fut)
            call.send(payload)
            await fut
        call.cancel()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    ch.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        asyncio.run(drive(port, 2000, args.concurrency, args.size, args.stream))  # warm up
        for _ in range(args.repeat):
            c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
            asyncio.run(drive(port, args.calls, args.concurrency, args.size, args.stream))
            c1, t1 = cpu_seconds(proc.pid), time.perf_counter()
            print(f"server CPU {1e6 * (c1 - c0) / args.calls:.1f} us/call, {args.calls / (t1 - t0):.0f} calls/s")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
