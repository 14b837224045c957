"""The call protocol (meshserve/server/h2/call.py) on the h2 server: what a handler learns of its
peer's TLS (plaintext, TLS, mutual TLS with the client's verified certificate), its deadline and
its status, through the real grpcio client over loopback."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshserve.server import tls
from meshserve.server.h2 import Call, H2GrpcServer, Status, unary_unary
from meshserve.server.limits import ServerLimits
from tests.support import certs

SERVICE = "t.Call"


async def who(request: bytes, call: Call) -> bytes:
    cert = call.peer_certificate()
    der = call.peer_certificate_der()
    subject = dict(item for rdn in cert["subject"] for item in rdn) if cert else None
    remaining = call.time_remaining()
    deadline = call.deadline
    return json.dumps({
        "secure": call.secure(), "subject": subject, "der": len(der) if der else None,
        "peer": call.peer(), "metadata": [list(kv) for kv in call.invocation_metadata() if isinstance(kv[1], str)],
        "remaining": remaining, "deadline_ahead": None if deadline is None else deadline - time.monotonic(),
        "cancelled": call.cancelled(), "done": call.done(),
    }).encode()


async def refuse(request: bytes, call: Call) -> None:
    call.set_status(Status.PERMISSION_DENIED, "not this one")
    assert call.status() == (Status.PERMISSION_DENIED, "not this one")
    return None


async def serve(port_tls: tls.PortTls | None) -> tuple[H2GrpcServer, int]:
    limits = ServerLimits(tls=tls.TlsSettings(grpc=port_tls))
    server = H2GrpcServer(limits=limits)
    server.add_methods(SERVICE, {"Who": unary_unary(who), "Refuse": unary_unary(refuse)})
    server.tls = tls.acceptor(limits, "grpc")
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    return server, port


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d: Path = tmp_path_factory.mktemp("pki")
    ca = certs.authority(d, "call-ca")
    return {"ca": ca, "server": ca.issue(d, "server", server=True), "client": ca.issue(d, "client", server=False)}


async def _ask(channel: grpc.aio.Channel, timeout: float | None = 10) -> dict[str, Any]:
    answer = await channel.unary_unary(f"/{SERVICE}/Who")(b"", timeout=timeout, metadata=(("x-tag", "t1"),))
    return json.loads(answer)  # type: ignore[no-any-return]


async def test_plaintext_call_has_no_certificate_and_a_deadline() -> None:
    server, port = await serve(None)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            seen = await _ask(ch, timeout=30)
            assert seen["secure"] is False and seen["subject"] is None and seen["der"] is None
            assert seen["peer"].startswith("ipv4:127.0.0.1:")
            assert ["x-tag", "t1"] in seen["metadata"]
            # grpc core writes grpc-timeout from the time left when it sends, rounded up (its
            # timeout_encoding: "encoding may round up"; above 1 s to 100 ms units): at most 30.1 s
            assert 20 < seen["remaining"] <= 30.1 and 20 < seen["deadline_ahead"] <= 30.1
            assert seen["cancelled"] is False and seen["done"] is False
            no_deadline = await _ask(ch, timeout=None)
            assert no_deadline["remaining"] is None and no_deadline["deadline_ahead"] is None
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await ch.unary_unary(f"/{SERVICE}/Refuse")(b"", timeout=10)
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "not this one")
    finally:
        await server.stop(None)


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_tls_peer_certificate_only_when_verified(pki: dict[str, Any], mutual: bool) -> None:
    ca, srv, client = pki["ca"], pki["server"], pki["client"]
    server, port = await serve(tls.PortTls(str(srv.cert), str(srv.key), str(ca.cert), mutual=mutual))
    root = Path(ca.cert).read_bytes()
    try:
        if mutual:
            creds = grpc.ssl_channel_credentials(root, Path(client.key).read_bytes(), Path(client.cert).read_bytes())
        else:  # (a client certificate the server does not ask for is not sent)
            creds = grpc.ssl_channel_credentials(root)
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
            seen = await _ask(ch)
        assert seen["secure"] is True
        if mutual:
            assert seen["subject"] == {"commonName": "client"} and seen["der"] > 100, seen
        else:
            assert seen["subject"] is None and seen["der"] is None, seen
    finally:
        await server.stop(None)
