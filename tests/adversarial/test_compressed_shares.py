"""Every shared cap has a per-tenant share: the inflated bytes and the inflating turns too
(meshserve/server/inflate.py, with --tenants). Tenant mallory floods the gateway with compressed
bombs (test_compressed_floods.py's: ~24 KB of gzip inflating to 24 MiB, on several connections
and streams at once, over gRPC unary, gRPC ModelStreamInfer and HTTP) while tenant acme, the good
client, sends plain *and* gzip-compressed requests (`grpc-encoding` / `Content-Encoding`).

mallory holds at most its share (0.5, the tenants file's default) of the gateway's 32 MiB
--max-receive-bytes: each bomb is refused RESOURCE_EXHAUSTED / 429 once its inflated bytes pass
16 MiB, and the other 16 MiB stay for acme. The turns go round by tenant, so acme's compressed
request waits for one slice of mallory's, not for mallory's line of bombs.

Before (one process-wide budget and one line): mallory's bombs filled the budget and acme's
compressed requests were refused RESOURCE_EXHAUSTED / 429, or waited behind every bomb queued
before them. The suite's rules hold for acme: p99 under max(250 ms, 5x its baseline) with no
failure, the gateway's RSS grows < 100 MiB and comes back, no 5xx / INTERNAL for mallory."""
from __future__ import annotations

import select
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.adversarial import h2raw
from tests.adversarial.harness import KEY, OTHER_KEY, Mesh, Observation, under_attack
from tests.adversarial.test_compressed_floods import (
    STREAM,
    MiB,
    _grpc_flood,
    _http_flood,
    bomb,
    compressed_mesh,
)
from tests.support.http1 import connect, read_answer
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def shared(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """test_compressed_floods.py's mesh, its good client compressing every other request."""
    yield from compressed_mesh(model_repo, tmp_path_factory.mktemp("compressed-shares"), ("--compress",))


@pytest.mark.parametrize("door", ["grpc", "http", "grpc-stream"])
def test_one_tenants_compressed_flood_leaves_another_tenants_compressed_requests_alone(shared: Mesh,
                                                                                       door: str) -> None:
    def flood() -> Observation:
        if door == "http":
            return _http_flood(shared.gateway.http)
        return _grpc_flood(shared.gateway.grpc, stream=door == "grpc-stream")

    verdict = under_attack(shared, shared.gateway, f"compressed {door} flood, another tenant compressing",
                           flood).judge()
    print(verdict.summary())  # (the figures, shown with -s)
    verdict.check()


def test_a_compressed_stream_of_a_caller_that_is_no_tenant_is_refused_before_it_is_inflated(shared: Mesh) -> None:
    """A ModelStreamInfer call answers a missing key in band, per request, so its headers pass
    the gateway's key check; its compressed message is still not inflated for an unknown key:
    the call ends UNAUTHENTICATED at once (before: the message was inflated, 24 MiB, then each
    request refused in band, the call ending OK)."""
    conn = h2raw.RawH2(shared.gateway.grpc)
    try:
        block = h2raw.grpc_headers(shared.gateway.grpc, path=STREAM, key="no-tenants-key",
                                   extra=[("grpc-encoding", "gzip")])
        message = b"\x01" + len(bomb()).to_bytes(4, "big") + bomb()
        assert conn.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1, block)
                         + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, 1, message))
        eventually(lambda: 1 in conn.seen.statuses, 10, "the call's grpc-status")
        assert conn.seen.statuses[1] == "16", conn.seen  # UNAUTHENTICATED
    finally:
        conn.close()


def test_one_tenants_unfinished_plain_bodies_hold_only_its_share_of_the_receive_budget(shared: Mesh) -> None:
    """Plain HTTP bodies count against --max-receive-bytes (32 MiB here) from their headers until
    they are answered; with tenants, a tenant's bodies hold at most its share (0.5: 16 MiB).
    mallory opens four connections, each announcing a 6 MiB body and sending only its first
    64 KiB: two of them are refused 429 naming mallory's share, and while the other two hold
    their 12 MiB, acme's 12 MiB inference through the real tritonclient is served (before:
    mallory's four held 24 of the 32 MiB, and acme's body was refused 429 "server busy")."""
    head = (f"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: {shared.gateway.http}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: 0\r\n"
            f"x-api-key: {OTHER_KEY}\r\nContent-Length: {6 * MiB}\r\n\r\n").encode()
    held = [connect(shared.gateway.http, timeout=10) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(head + bytes(64 * 1024))
        answered: list[socket.socket] = []

        def two_answered() -> bool:
            answered[:] = select.select(held, [], [], 0.05)[0]
            return len(answered) >= 2
        eventually(two_answered, 10, "two of mallory's bodies refused")
        assert len(answered) == 2, "only two of mallory's four bodies were over its share"
        for sock in answered:
            refused = read_answer(sock.makefile("rb"))
            assert refused.status == 429, refused
            assert "tenant 'mallory' holds" in refused.body.decode() and "share (0.5" in refused.body.decode()
        values = np.arange(3 * MiB, dtype=np.float32)  # 12 MiB
        client = httpclient.InferenceServerClient(shared.gateway.http, network_timeout=30)
        tensor = httpclient.InferInput("INPUT0", [1, values.size], "FP32")
        tensor.set_data_from_numpy(values[None, :], binary_data=True)
        got = client.infer("identity_fp32", [tensor], headers={"x-api-key": KEY}).as_numpy("OUTPUT0")
        assert got is not None and np.array_equal(got[0], values)
        waiting = [sock for sock in held if sock not in answered]
        assert not select.select(waiting, [], [], 0)[0], "mallory's other two bodies were let go before acme's"
    finally:
        for sock in held:
            sock.close()
