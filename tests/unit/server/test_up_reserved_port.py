"""`meshserve up`'s gateway gRPC port of 0: picked before the services start, held until the
gateway listens (meshserve/cli.py:_reserve_port)."""
from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from meshserve.cli import _reserve_port


@pytest.mark.parametrize("reuse_port", [False, True], ids=["one-worker", "workers-share-the-port"])
async def test_the_gateway_can_listen_on_the_held_port_and_nothing_else_can_take_it(reuse_port: bool) -> None:
    held = _reserve_port("127.0.0.1")
    try:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))  # any bind without SO_REUSEADDR: the port is taken
        assert refused.value.errno == errno.EADDRINUSE
        # the gateway's own bind (meshserve/server/h2/server.py:H2GrpcServer.bind)
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", port,
                                                                 reuse_address=True, reuse_port=reuse_port)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)  # it accepts
            writer.close()
        finally:
            server.close()
    finally:
        held.close()
