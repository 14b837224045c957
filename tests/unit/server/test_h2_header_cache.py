"""The HTTP/2 endpoint's cache of parsed header blocks (``H2Endpoint.hcache``: a repeat call's
block, all fields indexed, parsed once per connection) keeps only small blocks (session 10
review). It held 256 blocks of any size up to the 1 MiB header limit, with their parsed copies:
a client sending blocks of never-indexed literals (which leave the HPACK table as it was) with a
large metadata value made one connection hold ~2 x 256 MiB, HEADERS frames being outside flow
control. A block over ``HCACHE_BLOCK_MAX`` is parsed each time instead."""
from __future__ import annotations

import asyncio

import hpack
from hpack import NeverIndexedHeaderTuple

from meshserve.server.h2 import Call, H2GrpcServer, unary_unary
from meshserve.server.h2.connection import HCACHE_BLOCK_MAX
from tests.adversarial import h2raw
from tests.adversarial.h2raw import RawH2

PATH = "/t.Headers/Ask"
VALUE = 64 << 10
CALLS = 40


def _block(authority: str, note: str) -> bytes:
    """h2raw.grpc_headers' block with a large ``x-note``, without Huffman coding (pure Python's is slow)."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", authority),
               ("content-type", "application/grpc"), ("te", "trailers"), ("x-note", note)]
    return bytes(hpack.Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in headers], huffman=False))


async def test_large_header_blocks_are_not_kept() -> None:
    async def handler(request: bytes, call: Call) -> bytes:
        return b"ok"

    server = H2GrpcServer()
    server.add_methods("t.Headers", {"Ask": unary_unary(handler)})
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    loop = asyncio.get_running_loop()
    peak = 0

    def send() -> RawH2:
        raw = RawH2(f"127.0.0.1:{port}")
        for i in range(CALLS):
            block = _block(raw.authority, f"{i:04d}" + "n" * VALUE)
            sid = 2 * i + 1
            raw.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, sid, block)
                     + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, h2raw.grpc_message(b"q")))
        return raw

    raw = await loop.run_in_executor(None, send)
    try:
        for _ in range(500):  # (until every call was answered, bounded)
            peak = max([peak] + [sum(len(b) for b in c.hcache) for c in server._conns])
            if len(raw.seen.statuses) == CALLS:
                break
            await asyncio.sleep(0.01)
        assert len(raw.seen.statuses) == CALLS and set(raw.seen.statuses.values()) == {"0"}, raw.seen
        assert peak <= 256 * HCACHE_BLOCK_MAX, peak
    finally:
        raw.close()
        await server.stop(0)
