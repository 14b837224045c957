"""A failed connect (a replica that is down: refused) leaves no frame of ours in a reference
cycle: asyncio.wait_for's frame holds the future that failed with the error its traceback
holds, so without care every failed reconnect kept the connect's frame and its protocol alive
until the next collection (tests/support/cycles.py; docs/security.md, "Session 11: error cycles")."""
from __future__ import annotations

from meshserve.server.h2.client import connect
from tests.support.cycles import collector_off, cyclic_frames
from tests.support.net import refused_address


async def _fails(endpoint: str) -> str:
    try:
        await connect(endpoint, timeout=2)
    except OSError as exc:
        return type(exc).__name__
    raise AssertionError("connected")


async def test_a_refused_connect_leaves_no_cycle() -> None:
    endpoint = refused_address()
    with collector_off():
        for _ in range(3):
            assert await _fails(endpoint) == "ConnectionRefusedError"
        assert cyclic_frames() == []
