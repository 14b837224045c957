"""HTTP answers compressed for their client (``Accept-Encoding: gzip`` / ``deflate``), large ones
off the event loop: ``Deflater``.

zlib compresses ~10 MB a second at level 6 on this project's 2-core machine (a 38 MB JSON answer
took 4.3 s). Compressed on the event loop, a client that asked gzip for one large answer (an
identity model's 16 MB output, say) held every other client of that front door for as long:
measured, a good client's worst latency 4.3-4.9 s at a service and at a gateway
(docs/security.md, "Session 23: answers compressed for their client"). An answer over
``INLINE_BYTES`` is compressed on one of ``THREADS`` threads instead: zlib lets go of the GIL
while it deflates, so the loop goes on; the answers waiting for a thread wait in a line per
tenant, and a tenant holds at most its share of the threads (``Slots``, as the body workers:
one of the two at the default share of 0.5), so one tenant's large answers never make another
tenant's wait for all of theirs. Small answers, the common case, are compressed in place
(64 KiB: ~7 ms at most here).
"""
from __future__ import annotations

import asyncio
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor

from meshserve.protocol import http_codec
from meshserve.server.admission import tenant_cap
from meshserve.server.slots import Slots

INLINE_BYTES = 64 * 1024  # an answer this small is compressed on the event loop
THREADS = 2  # (two cores here: a third thread would only contend)


class Deflater:
    """Compresses answers for their client: large ones on ``threads`` threads, shared fairly."""

    def __init__(self, threads: int = THREADS) -> None:
        self.threads = threads
        self._slots = Slots(threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="meshserve-deflate")

    async def encode(self, body: bytes, accept: str, tenant: Hashable = None, share: float = 1.0
                     ) -> tuple[bytes, str | None]:
        """http_codec.encode_body(body, accept): in place for a small answer, else on a thread in
        the line of ``tenant`` (None without tenants), which holds at most ``share`` of the threads."""
        if len(body) <= INLINE_BYTES:
            return http_codec.encode_body(body, accept)
        slots = self._slots
        cap = self.threads if tenant is None else tenant_cap(self.threads, share)
        index = await slots.take(tenant, cap)
        try:
            work = asyncio.get_running_loop().run_in_executor(self._pool, http_codec.encode_body, body, accept)
        except BaseException:
            slots.give(index, tenant)
            raise
        # the slot comes back when the thread is done, not when a caller that left stops waiting
        work.add_done_callback(lambda _: slots.give(index, tenant))
        return await asyncio.shield(work)


_deflater: Deflater | None = None


def deflater() -> Deflater:
    """The process's Deflater (made on first use)."""
    global _deflater
    if _deflater is None:
        _deflater = Deflater()
    return _deflater
