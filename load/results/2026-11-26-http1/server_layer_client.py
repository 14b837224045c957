"""Keep-alive load for server_layer.py: C connections, N requests in all (a 200-byte binary
infer-shaped POST each). Usage: server_layer_client.py PORT N C."""
from __future__ import annotations

import asyncio
import sys
import time

import uvloop

BODY = b"\x00" * 200
REQUEST = (b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: 100\r\n"
           b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % len(BODY)) + BODY


async def one(port: int, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(count):
        writer.write(REQUEST)
        head = await reader.readuntil(b"\r\n\r\n")
        i = head.lower().index(b"content-length:")
        await reader.readexactly(int(head[i + 15:head.index(b"\r\n", i)]))
    writer.close()


async def main() -> None:
    port, n, c = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    t = time.perf_counter()
    await asyncio.gather(*(one(port, n // c) for _ in range(c)))
    print(f"{n / (time.perf_counter() - t):.0f} requests/s")


if __name__ == "__main__":
    uvloop.run(main())
