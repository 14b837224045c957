"""The HTTP/1.1 server layer alone, for callgrind: one process serving a trivial infer-shaped
handler (reads the body, answers 166 bytes) on aiohttp's server, the httptools one, or `raw`
(llhttp and a fixed answer: the floor). Usage: server_layer.py {aiohttp,httptools,raw} PORT;
driven by server_layer_client.py (see NOTES.md)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the tree this file is in

import httptools
import uvloop
from aiohttp import web

from meshserve.server import http1, http_frontend
from meshserve.server.limits import ServerLimits

BODY = b'{"model_name":"add_sub","outputs":[]}' + b"x" * 128


async def handle(request: Any) -> web.StreamResponse:
    await request.content.read()
    request.headers.get("Inference-Header-Content-Length")
    return web.Response(body=BODY, headers={"Inference-Header-Content-Length": "40",
                                            "Content-Type": "application/octet-stream"})


class Raw(asyncio.Protocol):
    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(self.ANSWER)


async def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    limits = ServerLimits(http_server=mode if mode != "raw" else "httptools")
    if mode == "raw":
        await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", port)
    elif mode == "httptools":
        await http1.start(handle, "127.0.0.1", port, limits)
    else:
        await http_frontend._start(http_frontend._Server(handle, limits), "127.0.0.1", port)
    print("ready", port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    uvloop.run(main())
