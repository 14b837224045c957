"""The table-neutral HPACK fast path (h2.frames.plain_decode) must agree with the hpack package.

It decodes only blocks that leave the dynamic table alone and need no Huffman table (what
meshserve sends: trailers with a traceparent, for one); for anything else it must say None so
that the connection's hpack decoder, and with it the dynamic table, sees the block.
"""
from __future__ import annotations

import asyncio
import random

import hpack
import pytest

from meshserve.server.h2.connection import H2Endpoint
from meshserve.server.h2.frames import RESPONSE_HEADERS, TRAILERS_OK, literal, plain_decode

TRACEPARENT = b"00-" + b"ab" * 16 + b"-" + b"cd" * 8 + b"-01"


def test_our_own_blocks_take_the_fast_path() -> None:
    for block in (RESPONSE_HEADERS, TRAILERS_OK, TRAILERS_OK + literal(b"traceparent", TRACEPARENT),
                  TRAILERS_OK + literal(b"x-long", b"v" * 300)):  # a multi-byte length
        plain = plain_decode(block)
        assert plain is not None
        assert plain == hpack.Decoder().decode(block, raw=True)


def test_never_indexed_and_static_name_literals() -> None:
    block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple("authorization", "secret"), (":status", "200"),
                                    hpack.NeverIndexedHeaderTuple(":path", "/a/b")], huffman=False)
    assert plain_decode(block) == hpack.Decoder().decode(block, raw=True) == [
        (b"authorization", b"secret"), (b":status", b"200"), (b":path", b"/a/b")]


@pytest.mark.parametrize("huffman", [True, False])
def test_blocks_that_touch_the_table_or_use_huffman_are_left_to_hpack(huffman: bool) -> None:
    # hpack's encoder indexes new fields incrementally: that changes the dynamic table
    block = hpack.Encoder().encode([("x-new", "value")], huffman=huffman)
    assert plain_decode(block) is None
    huffman_value = b"\x00" + bytes((len(b"x-a"),)) + b"x-a" + b"\x81" + b"\x1f"  # H bit set on the value
    assert plain_decode(huffman_value) is None
    assert plain_decode(b"\x3f\xe1\x1f") is None  # a dynamic table size update
    assert plain_decode(b"\xbe") is None  # index 62: the dynamic table


def test_truncated_and_random_blocks_never_raise_and_never_disagree() -> None:
    rng = random.Random(5)
    good = TRAILERS_OK + literal(b"traceparent", TRACEPARENT) + b"\x88"
    blocks = [good[:n] for n in range(len(good))]
    blocks += [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    for block in blocks:
        plain = plain_decode(block)
        if plain is None:
            continue
        assert plain == hpack.Decoder().decode(block, raw=True), block


def test_a_connection_keeps_its_dynamic_table_in_step() -> None:
    """Blocks decoded on the fast path sit between blocks that add to and then use the dynamic
    table: every block decodes as one continuous hpack decoder decodes it."""
    encoder = hpack.Encoder()
    blocks = [encoder.encode([(":status", "200"), ("x-session", "s1")]),  # adds x-session to the table
              TRAILERS_OK + literal(b"traceparent", TRACEPARENT),  # fast path
              encoder.encode([("x-session", "s1")]),  # now an index into the dynamic table
              TRAILERS_OK + literal(b"traceparent", TRACEPARENT[:-1] + b"0"),
              encoder.encode([("x-session", "s1"), ("x-other", "o")])]
    reference = hpack.Decoder()
    expected = [reference.decode(b, raw=True) for b in blocks]

    async def decode_all() -> list[object]:
        endpoint = H2Endpoint()
        return [endpoint._decode(b, tuple) for b in blocks]  # (the parse the server's own callers give)

    assert asyncio.run(decode_all()) == [tuple(e) for e in expected]


def test_blocks_with_a_trace_id_are_not_cached() -> None:
    """A sampled response's trailers carry a new trace id each time: caching them would only
    push out the blocks that do repeat (and force a clear every 256 of them)."""
    traced = TRAILERS_OK + literal(b"traceparent", TRACEPARENT)

    async def decode() -> dict[bytes, object]:
        endpoint = H2Endpoint()
        for block in (TRAILERS_OK, traced, RESPONSE_HEADERS):
            assert endpoint._decode(block, tuple) == tuple(hpack.Decoder().decode(block, raw=True))
        return endpoint.hcache

    assert set(asyncio.run(decode())) == {TRAILERS_OK, RESPONSE_HEADERS}
