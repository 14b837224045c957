"""A request-streaming call's unread messages are bounded by what they hold inflated, not by their
wire bytes (session 10 review, the h2 server's ``Inbox``).

The stream's backlog (STREAM_BACKLOG, its window and STREAM_MAX_QUEUED) counted a compressed
message by its wire size: 60 gzip messages of 4 KiB each, inflating to 4 MiB, sat in the queue of
a handler that did not read them as 240 MiB (and a window's worth, 16 MiB of such messages, as
16 GiB: any gRPC port, ModelStreamInfer behind a slow model). Now a compressed message is charged
its inflated size and past ``STREAM_MAX_HELD`` the rest waits raw (compressed) in the stream's
buffer until the handler reads on; every message still arrives, once and in order."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc

from meshserve.server.h2 import H2GrpcServer, stream_unary
from meshserve.server.h2.server import STREAM_MAX_HELD

SERVICE = "t.Inflate"
PATH = f"/{SERVICE}/Up"
INFLATED = 4 << 20
COUNT = 60


async def test_compressed_messages_wait_raw_past_the_held_bound() -> None:
    gate = asyncio.Event()
    seen: dict[str, Any] = {"firsts": [], "peak": 0}
    server = H2GrpcServer()

    async def handler(requests: Any, call: Any) -> bytes:
        await gate.wait()
        async for msg in requests:
            seen["firsts"].append(msg[0])
            assert len(msg) == INFLATED
        return b"done"

    server.add_methods(SERVICE, {"Up": stream_unary(handler)})
    port = await server.bind("127.0.0.1", 0)
    await server.start()

    def held() -> int:
        return sum(len(item[0]) for c in server._conns for st in c.streams.values() if st.queue is not None
                   for item in st.queue.items if item.__class__ is tuple)

    async def watch() -> None:
        while not gate.is_set():
            seen["peak"] = max(seen["peak"], held())
            await asyncio.sleep(0.01)

    async def messages() -> Any:
        for i in range(COUNT):
            yield bytes([i % 251]) + bytes(INFLATED - 1)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            up = ch.stream_unary(PATH)
            call = up(messages(), timeout=60, compression=grpc.Compression.Gzip)
            watcher = asyncio.ensure_future(watch())
            # the client sends what the windows let it; the handler reads nothing meanwhile
            for _ in range(100):
                await asyncio.sleep(0.02)
            gate.set()
            await watcher
            assert await call == b"done"
    finally:
        await server.stop(0)
    assert seen["peak"] <= STREAM_MAX_HELD + INFLATED, seen["peak"]
    assert seen["firsts"] == [i % 251 for i in range(COUNT)]  # every message, once, in order
    assert server._active == 0


async def test_a_streamed_message_is_inflated_when_taken_within_the_limit_and_the_budget() -> None:
    """Session 11: a stream's compressed messages wait compressed and are inflated in the handler's
    task as it takes each (meshserve/server/inflate.py: slices, one message at a time, the
    process's budget); the messages before one that inflates past the limit arrive, in order, and
    the call ends RESOURCE_EXHAUSTED naming the limit, with every byte of the budget given back."""
    from meshserve.server import inflate

    got: list[int] = []
    server = H2GrpcServer(max_receive_message_length=1 << 20)

    async def handler(requests: Any, call: Any) -> bytes:
        async for msg in requests:
            got.append(len(msg))
            assert inflate.INFLATING.used >= len(msg)  # held while the handler has it
        return b"done"

    server.add_methods(SERVICE, {"Up": stream_unary(handler)})
    port = await server.bind("127.0.0.1", 0)
    await server.start()

    async def messages() -> Any:
        for size in (1000, 500_000, 2 << 20, 7):  # the third inflates past the 1 MiB limit
            yield bytes(size)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.stream_unary(PATH)(messages(), timeout=30, compression=grpc.Compression.Gzip)
            try:
                await call
                raise AssertionError("the call should have failed")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "Received message larger than max" in (exc.details() or ""), exc.details()
    finally:
        await server.stop(0)
    assert got == [1000, 500_000]
    assert inflate.INFLATING.used == 0 and inflate.INFLATING_NOW.busy == 0
