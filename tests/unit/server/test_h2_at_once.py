"""The h2 server's at-once hook (meshserve/server/h2/server.py: H2GrpcServer.at_once, called in
ServerConnection._start_unary): a unary call it answers ends there, without a Task (the gateway's
cache hits); its error status, its exception, a compressed request, an answer larger than the
peer's window and a call it declines (the method's handler, in a Task) — through the real grpcio
client over loopback."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from meshserve.server.h2 import Call, H2GrpcServer, Status, unary_unary

SERVICE = "t.AtOnce"
PATH = f"/{SERVICE}/Ask"
PLAIN = f"/{SERVICE}/Plain"  # a hook that wants no call: OK answers without trailing metadata
LARGE = 3 << 20  # more than the client's flow-control windows at the start


class Seen:
    def __init__(self) -> None:
        self.hook_tasks: list[Any] = []
        self.handled: list[bytes] = []


def _server(seen: Seen) -> H2GrpcServer:
    async def handler(request: bytes, call: Call) -> bytes:
        seen.handled.append(request)
        assert asyncio.current_task() is not None
        return b"task:" + request

    def hook(message: bytes, call: Call) -> bytes | None:
        seen.hook_tasks.append(asyncio.current_task())
        if message.startswith(b"now"):
            call.set_trailing_metadata((("x-hit", "1"),))
            return b"at-once:" + message
        if message == b"large":
            return b"L" * LARGE
        if message == b"deny":
            call.set_status(Status.PERMISSION_DENIED, "not this one")
            return b""
        if message == b"boom":
            raise ValueError("/secret/path exploded")
        return None  # the handler, in a Task

    def plain(message: bytes, call: Call | None) -> bytes | None:
        assert call is None
        seen.hook_tasks.append(asyncio.current_task())
        return b"plain:" + message if message else None

    server = H2GrpcServer()
    server.add_methods(SERVICE, {"Ask": unary_unary(handler), "Plain": unary_unary(handler)})
    server.at_once[PATH] = (hook, True)
    server.at_once[PLAIN] = (plain, False)
    return server


@pytest.fixture
async def served() -> Any:
    seen = Seen()
    server = _server(seen)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        yield server, seen, port
    finally:
        await server.stop(0)


async def test_a_call_the_hook_answers_ends_without_a_task(served: Any) -> None:
    server, seen, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        ask = ch.unary_unary(PATH)
        call = ask(b"now-1", timeout=10)
        assert await call == b"at-once:now-1"
        assert ("x-hit", "1") in tuple(await call.trailing_metadata())
        assert seen.hook_tasks == [None]  # (run in the read's frame loop: no Task)
        assert await ask(b"other", timeout=10) == b"task:other"  # declined: the method's handler
        assert seen.handled == [b"other"]
        # many calls on one connection, answered and declined mixed: each ends exactly once
        answers = await asyncio.gather(*(ask(b"now-%d" % i if i % 2 else b"t%d" % i, timeout=10)
                                         for i in range(64)))
        assert answers == [b"at-once:now-%d" % i if i % 2 else b"task:t%d" % i for i in range(64)]
        plain = ch.unary_unary(PLAIN)
        call = plain(b"p", timeout=10)
        assert await call == b"plain:p" and not tuple(await call.trailing_metadata() or ())
        assert await plain(b"", timeout=10) == b"task:"  # declined: the handler
        assert seen.hook_tasks.count(None) == len(seen.hook_tasks)
    assert server._active == 0


async def test_the_hooks_status_exception_compression_and_a_large_answer(served: Any) -> None:
    _, seen, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        ask = ch.unary_unary(PATH)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ask(b"deny", timeout=10)
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "not this one")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ask(b"boom", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNKNOWN
        assert "secret" not in (info.value.details() or "")  # an exception's text stays in the log
        # a gzip request: the hook sees the message decompressed
        assert await ask(b"now-gzip" * 100, timeout=10, compression=grpc.Compression.Gzip) == \
            b"at-once:" + b"now-gzip" * 100
        # larger than the windows: HEADERS and DATA as the peer's WINDOW_UPDATEs allow, then trailers
        large = await ask(b"large", timeout=30)
        assert len(large) == LARGE and large == b"L" * LARGE
    assert seen.handled == []
