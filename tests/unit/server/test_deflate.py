"""meshserve/server/deflate.py: small answers compressed in place, large ones on the threads, a
tenant at most its share of them, and a thread's slot held until the thread is done (a caller
that stops waiting does not free it early)."""
from __future__ import annotations

import asyncio
import threading
import zlib

import pytest

from meshserve.protocol import http_codec
from meshserve.server import deflate

BIG = b"x" * (deflate.INLINE_BYTES + 1)


def test_answers_small_and_large_come_compressed_as_asked() -> None:
    async def main() -> None:
        d = deflate.Deflater()
        small, coding = await d.encode(b"y" * 100, "gzip")
        assert coding == "gzip" and zlib.decompress(small, 31) == b"y" * 100
        large, coding = await d.encode(BIG, "deflate")
        assert coding == "deflate" and zlib.decompress(large) == BIG
        assert await d.encode(BIG, "identity") == (BIG, None)

    asyncio.run(main())


def test_a_tenant_holds_its_share_of_the_threads_until_they_are_done(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    started: list[str] = []

    def slow(body: bytes, accept: str) -> tuple[bytes, str | None]:
        started.append(accept)
        release.wait(10)
        return body, None

    monkeypatch.setattr(http_codec, "encode_body", slow)

    async def main() -> None:
        d = deflate.Deflater(threads=2)
        a1 = asyncio.ensure_future(d.encode(BIG, "a1", "a", 0.5))  # cap max(1, 2 x 0.5) = 1
        a2 = asyncio.ensure_future(d.encode(BIG, "a2", "a", 0.5))
        b1 = asyncio.ensure_future(d.encode(BIG, "b1", "b", 0.5))
        for _ in range(50):
            await asyncio.sleep(0.01)
            if len(started) == 2:
                break
        assert sorted(started) == ["a1", "b1"]  # a's second waits for a's first; b is not held back
        a1.cancel()  # its client left: its thread still runs, and holds its slot
        await asyncio.sleep(0.05)
        assert sorted(started) == ["a1", "b1"]
        release.set()
        assert await a2 == (BIG, None) and await b1 == (BIG, None)
        assert sorted(started) == ["a1", "a2", "b1"]

    asyncio.run(main())
