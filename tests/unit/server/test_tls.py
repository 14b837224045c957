"""meshserve/server/tls.py's pure parts: the flags, the reload rule, the handshake cap."""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import ssl
from pathlib import Path

import pytest

from meshserve.server import certs, limits, tls


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, certs.Authority]:
    ca = certs.authority(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True)
    return server.cert, server.key, ca


def _parse(argv: list[str]) -> limits.ServerLimits:
    ap = argparse.ArgumentParser()
    limits.add_arguments(ap)
    return limits.from_args(ap.parse_args(argv))


def test_flags_triton_forms(files: tuple[Path, Path, certs.Authority]) -> None:
    cert, key, ca = files
    assert _parse([]).tls == tls.TlsSettings()  # plaintext by default
    got = _parse(["--grpc-use-ssl=true", "--grpc-server-cert", str(cert), "--grpc-server-key", str(key),
                  "--http-use-ssl-mutual", "--http-server-cert", str(cert), "--http-server-key", str(key),
                  "--http-root-cert", str(ca.cert)]).tls
    assert got.grpc == tls.PortTls(str(cert), str(key), None, False)
    assert got.http == tls.PortTls(str(cert), str(key), str(ca.cert), True)
    assert _parse(["--grpc-use-ssl=false"]).tls.grpc is None
    with pytest.raises(SystemExit, match="--http-server-cert"):
        _parse(["--http-use-ssl"])
    with pytest.raises(SystemExit, match="--grpc-root-cert"):
        _parse(["--grpc-use-ssl-mutual", "--grpc-server-cert", str(cert), "--grpc-server-key", str(key)])
    with pytest.raises(SystemExit, match="cannot load"):
        _parse(["--grpc-use-ssl", "--grpc-server-cert", str(key), "--grpc-server-key", str(key)])


def test_reload_keeps_the_old_context_while_the_new_files_do_not_load(
        files: tuple[Path, Path, certs.Authority], tmp_path: Path) -> None:
    cert, key, ca = files
    acceptor = tls.Acceptor(tls.PortTls(str(cert), str(key)), "http", 10.0, 4)
    first = acceptor.current()
    acceptor.checked = -1e9  # (the next call looks at the files)
    assert acceptor.current() is first  # unchanged files: the same context
    cert.write_text("half a certificate")
    acceptor.checked = -1e9
    assert acceptor.current() is first  # does not load: the previous one stays
    renewed = ca.issue(tmp_path, "renewed", server=True)
    shutil.copy(renewed.key, key)
    shutil.copy(renewed.cert, cert)
    os.utime(cert, ns=(1, 1))  # (a different stamp even within the filesystem's mtime granularity)
    acceptor.checked = -1e9
    assert acceptor.current() is not first


def test_at_the_cap_the_oldest_silent_connection_is_closed_first(files: tuple[Path, Path, certs.Authority]) -> None:
    """A connection that sent its first bytes (its handshake began) is closed to make room only
    when no silent one is left; among each kind the oldest goes first."""
    cert, key, _ = files
    acceptor = tls.Acceptor(tls.PortTls(str(cert), str(key)), "grpc", 10.0, 3)

    class Fake:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    good, a, b, c, d, e = (Fake() for _ in range(6))
    acceptor.admit(good)  # type: ignore[arg-type]
    acceptor.spoke(good)  # type: ignore[arg-type]  # its ClientHello came
    for hs in (a, b, c):  # silent ones: the oldest silent goes, never the one that spoke
        acceptor.admit(hs)  # type: ignore[arg-type]
    assert a.aborted and not (good.aborted or b.aborted or c.aborted)
    assert list(acceptor.silent) == [b, c] and list(acceptor.pending) == [good] and acceptor.evicted == 1
    acceptor.spoke(b)  # type: ignore[arg-type]
    acceptor.spoke(c)  # type: ignore[arg-type]
    acceptor.admit(d)  # type: ignore[arg-type]  # no silent one left: the oldest of all
    assert good.aborted and list(acceptor.pending) == [b, c] and list(acceptor.silent) == [d]
    acceptor.done(b)  # type: ignore[arg-type]  # b's handshake ended: room without closing anyone
    acceptor.admit(e)  # type: ignore[arg-type]
    assert not (b.aborted or c.aborted or d.aborted) and acceptor.evicted == 2
    assert list(acceptor.pending) == [c] and list(acceptor.silent) == [d, e]


class _Sink(asyncio.Protocol):
    """Keeps what its connection received; answers each 1 MiB with its length."""

    def __init__(self, got: list[bytearray]) -> None:
        self.data = bytearray()
        got.append(self.data)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert type(data) is bytes  # a copy: the shared buffer is not handed out
        self.data += data
        if len(self.data) % (1 << 20) == 0 and self.transport is not None:
            self.transport.write(str(len(self.data)).encode())


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_connections_share_the_read_buffer_without_mixing(files: tuple[Path, Path, certs.Authority],
                                                            loop_kind: str) -> None:
    """tls.Reader: every connection decrypts into one buffer; two clients that send 3 MiB each at
    once (reads larger than the buffer among them) each arrive whole, in order, unmixed."""
    cert, key, ca = files
    acceptor = tls.Acceptor(tls.PortTls(str(cert), str(key)), "http", 10.0, 8)
    got: list[bytearray] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(acceptor.factory(lambda: _Sink(got)), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ctx = ssl.create_default_context(cafile=str(ca.cert))

        async def client(fill: int) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
            payload = bytes(range(fill, fill + 251)) * ((3 << 20) // 251 + 1)
            for i in range(0, 3 << 20, 1 << 20):
                writer.write(payload[i:i + (1 << 20)])
                await writer.drain()
            answers = b""
            while not answers.endswith(str(3 << 20).encode()):
                answers += await asyncio.wait_for(reader.read(64), 20)
            writer.close()
            return payload[:3 << 20]

        sent = await asyncio.gather(client(0), client(3))
        server.close()
        assert sorted(bytes(g) for g in got) == sorted(sent)

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(run())
    else:
        asyncio.run(run())


def test_ssl_objects_call_the_ssl_module_directly(files: tuple[Path, Path, certs.Authority]) -> None:
    """tls._SSLObject: the server's and the hop client's contexts wrap connections in SSLObjects
    whose read, write and pending are the C methods (no Python frame per record), and they do
    what SSLObject's own do: a handshake, records both ways, read into a buffer or not."""
    cert, key, ca = files
    server_ctx = tls.context(tls.PortTls(str(cert), str(key)), "http")
    upstream = tls.UpstreamTls(on=True, root=str(ca.cert))
    client_ctx = upstream.context()
    assert client_ctx is not None
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server = server_ctx.wrap_bio(bios[0], bios[1], server_side=True)
    client = client_ctx.wrap_bio(bios[2], bios[3], server_hostname="localhost")
    for obj in (server, client):
        assert type(obj) is tls._SSLObject
        raw = obj._sslobj  # type: ignore[attr-defined]
        assert (obj.read, obj.write, obj.pending) == (raw.read, raw.write, raw.pending)
    for _ in range(10):  # the handshake, over the memory BIOs
        for obj in (client, server):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
        bios[0].write(bios[3].read())
        bios[2].write(bios[1].read())
    assert server.version() == client.version() and server.cipher() is not None
    assert client.write(b"request") == 7
    bios[0].write(bios[3].read())
    buf = bytearray(64)
    assert server.read(64, buf) == 7 and buf[:7] == b"request"
    assert server.pending() == 0
    with pytest.raises(ssl.SSLWantReadError):
        server.read(64)
    server.write(b"answer")
    bios[2].write(bios[1].read())
    got = b""
    while len(got) < 6:  # (the server's session tickets come first, in records of their own)
        try:
            got += client.read(64)
        except ssl.SSLWantReadError:
            break
    assert got == b"answer"
