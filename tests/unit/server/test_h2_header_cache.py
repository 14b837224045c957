"""The HTTP/2 endpoint's cache of parsed header blocks (``H2Endpoint.hcache``: a repeat call's
block, all fields indexed, parsed once per connection) keeps only small blocks (session 10
review). It held 256 blocks of any size up to the 1 MiB header limit, with their parsed copies:
a client sending blocks of never-indexed literals (which leave the HPACK table as it was) with a
large metadata value made one connection hold ~2 x 256 MiB, HEADERS frames being outside flow
control. A block over ``HCACHE_BLOCK_MAX`` is parsed each time instead, and so is one of more
than ``HCACHE_FIELDS_MAX`` fields (session 21: a small block of 1-byte references decodes to
thousands of fields)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import hpack
from hpack import NeverIndexedHeaderTuple

from meshserve.server.h2 import Call, H2GrpcServer, unary_unary
from meshserve.server.h2.connection import HCACHE_BLOCK_MAX, HCACHE_FIELDS_MAX
from tests.adversarial import h2raw
from tests.adversarial.h2raw import RawH2

PATH = "/t.Headers/Ask"
VALUE = 60 << 10  # (under the server's MAX_HEADER_LIST, 64 KiB since session 21)
CALLS = 40


def _block(authority: str, note: str) -> bytes:
    """h2raw.grpc_headers' block with a large ``x-note``, without Huffman coding (pure Python's is slow)."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", authority),
               ("content-type", "application/grpc"), ("te", "trailers"), ("x-note", note)]
    return bytes(hpack.Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in headers], huffman=False))


async def _answered(blocks: Callable[[str], list[bytes]], watch: Callable[[H2GrpcServer], None]) -> H2GrpcServer:
    """A server answering "t.Headers/Ask"; one connection sends a call per block of
    ``blocks(authority)`` and each is answered OK (``watch(server)`` at each wait). The server is
    returned running (its connection closed): the caller stops it."""
    async def handler(request: bytes, call: Call) -> bytes:
        return b"ok"

    server = H2GrpcServer()
    server.add_methods("t.Headers", {"Ask": unary_unary(handler)})
    port = await server.bind("127.0.0.1", 0)
    await server.start()

    def send() -> tuple[RawH2, int]:
        raw = RawH2(f"127.0.0.1:{port}")
        sent = blocks(raw.authority)
        for i, block in enumerate(sent):
            sid = 2 * i + 1
            raw.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, sid, block)
                     + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, h2raw.grpc_message(b"q")))
        return raw, len(sent)

    raw, calls = await asyncio.get_running_loop().run_in_executor(None, send)
    try:
        for _ in range(500):  # (until every call was answered, bounded)
            watch(server)
            if len(raw.seen.statuses) == calls:
                break
            await asyncio.sleep(0.01)
        assert len(raw.seen.statuses) == calls and set(raw.seen.statuses.values()) == {"0"}, raw.seen
    finally:
        raw.close()
    return server


async def test_large_header_blocks_are_not_kept() -> None:
    peak = [0]

    def watch(server: H2GrpcServer) -> None:
        peak[0] = max([peak[0]] + [sum(len(b) for b in c.hcache) for c in server._conns])

    server = await _answered(lambda authority: [_block(authority, f"{i:04d}" + "n" * VALUE) for i in range(CALLS)],
                             watch)
    await server.stop(0)
    assert peak[0] <= 256 * HCACHE_BLOCK_MAX, peak


async def test_blocks_of_many_fields_are_not_kept() -> None:
    """A 2 KB block of 1-byte references to one table entry decodes to ~1,900 fields (~250 KB
    of Python objects): 256 of them kept were ~64 MiB a connection. Such a block is parsed each
    time; a call's usual block (its few fields) is still kept."""
    def blocks(authority: str) -> list[bytes]:
        enc = hpack.Encoder()
        base = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", authority),
                ("content-type", "application/grpc"), ("te", "trailers")]
        return [enc.encode(base + ([("x-a", "b")] * (HCACHE_FIELDS_MAX + 1) if i % 2 else [])
                           + [NeverIndexedHeaderTuple("x-n", str(i % 4))]) for i in range(CALLS)]

    kept: list[int] = []

    def watch(server: H2GrpcServer) -> None:
        kept[:] = [len(c.hcache) for c in server._conns] or kept

    server = await _answered(blocks, watch)
    await server.stop(0)
    assert kept == [2], kept  # (the short blocks alone: two, once the table holds their fields)

