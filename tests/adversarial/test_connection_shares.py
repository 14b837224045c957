"""Every shared cap has a per-tenant share: client connections too (docs/security.md, "Session 13:
connections by tenant").

`--max-connections` is counted at accept, before a header names a tenant, and a connection with a
call in progress is never idle, so it is never closed near the cap. Before: mallory, with a valid
key, opened connections that each hold an idle ModelStreamInfer call (HTTP/2) or a slow request
body (HTTP/1.1 keep-alive) until the gateway's 16 were full, and acme's new connections were
refused at accept (503 / closed at once), its good client's evicted. Now a connection counts for
the tenant of its first request, at most max(1, 16 x 0.5) = 8 each: mallory's ninth and later
are refused naming the share (gRPC RESOURCE_EXHAUSTED + GOAWAY; HTTP 429 + Retry-After, closed),
while acme's new connections (the real tritonclient, gRPC and HTTP) and its good client are
served within the harness's bound."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.h2raw import END_HEADERS, HEADERS, RawH2, frame, grpc_headers
from tests.adversarial.harness import (
    KEY,
    LIMIT_FLAGS,
    OTHER_KEY,
    Mesh,
    Observation,
    one_service_mesh,
    under_attack,
)
from tests.adversarial.support import add_sub_inputs
from tests.support.http1 import connect
from tests.support.waiting import eventually

CAP = 16
SHARE = 8  # max(1, 16 x 0.5): the tenants file's default share
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
SHARE_TEXT = f"tenant 'mallory' has {SHARE} connections open, its share (0.5 of --max-connections {CAP}: {SHARE})"


@pytest.fixture(scope="module")
def capped(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with one_service_mesh(model_repo, tmp_path_factory.mktemp("connshare"), lambda service, tenants: [
            "gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tenants),
            "--upstream", service.grpc, "--max-connections", str(CAP), *LIMIT_FLAGS]) as mesh:
        yield mesh


def _stream(hostport: str) -> RawH2:
    """A connection holding one ModelStreamInfer call with no request in it (busy, never idle)."""
    h2 = RawH2(hostport)
    h2.send(frame(HEADERS, END_HEADERS, 1, grpc_headers(hostport, STREAM, OTHER_KEY)))
    return h2


def _slow_body(hostport: str) -> socket.socket:
    """A keep-alive connection whose infer request's body stops after its first bytes."""
    s = connect(hostport, timeout=5.0)
    s.sendall(f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: {hostport}\r\nx-api-key: {OTHER_KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: 4000\r\n\r\n{{\"inputs\": [".encode())
    return s


def _answer(s: socket.socket, timeout: float) -> bytes:
    """What the server sent before closing (b"" when it sent nothing and kept the connection)."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        return got
    except OSError:
        pass
    return got + b"<closed>"


def _acme_new_connections(proc_grpc: str, proc_http: str) -> list[str]:
    """Fresh tritonclient clients (a connection each: a local subchannel pool for gRPC), 5 requests each."""
    out = []
    headers = {"x-api-key": KEY}
    g = grpcclient.InferenceServerClient(proc_grpc, channel_args=[("grpc.use_local_subchannel_pool", 1)])
    h = httpclient.InferenceServerClient(proc_http, network_timeout=5, connection_timeout=5)
    try:
        for m, c in ((grpcclient, g), (httpclient, h)):
            for _ in range(5):
                try:
                    kw = {"client_timeout": 5} if m is grpcclient else {}
                    r = c.infer("add_sub", add_sub_inputs(m), headers=dict(headers), **kw)  # type: ignore[attr-defined]
                    out.append("ok" if r.as_numpy("OUTPUT0") is not None else "no output")
                except InferenceServerException as exc:
                    out.append(f"{exc.status()}: {exc.message()}")
    finally:
        g.close()
        h.close()
    return out


def test_one_tenants_busy_connections_hold_only_its_share(capped: Mesh) -> None:
    proc = capped.gateway
    seen: dict[str, object] = {}

    def attack() -> Observation:
        streams: list[RawH2] = []
        slow: list[socket.socket] = []
        try:
            for i in range(CAP):  # alternately: an idle stream call, a slow request body
                if i % 2 == 0:
                    streams.append(_stream(proc.grpc))
                    streams[-1].wait_answered(1, 0.1)  # (a refused one is answered at once: one at a time)
                else:
                    slow.append(_slow_body(proc.http))
                    seen.setdefault("http", []).append(_answer(slow[-1], 0.1))  # type: ignore[attr-defined]
            seen["acme"] = _acme_new_connections(proc.grpc, proc.http)
            seen["grpc"] = [(h2.seen.statuses.get(1), h2.seen.statuses.get(1) is not None and h2.wait("closed", 2.0))
                            for h2 in streams]
            # mallory with the real tritonclient on a new connection: refused naming the share
            try:
                with grpcclient.InferenceServerClient(
                        proc.grpc, channel_args=[("grpc.use_local_subchannel_pool", 1)]) as m:
                    m.infer("add_sub", add_sub_inputs(grpcclient), headers={"x-api-key": OTHER_KEY}, client_timeout=5)
                seen["mallory"] = "served"
            except InferenceServerException as exc:
                seen["mallory"] = f"{exc.status()}: {exc.message()}"
            try:
                with httpclient.InferenceServerClient(proc.http, network_timeout=5, connection_timeout=5) as m:
                    m.infer("add_sub", add_sub_inputs(httpclient), headers={"x-api-key": OTHER_KEY})
                seen["mallory_http"] = "served"
            except InferenceServerException as exc:
                seen["mallory_http"] = f"{exc.status()}: {exc.message()}"
        finally:
            for h2 in streams:
                h2.close()
            for s in slow:
                s.close()
        grpc = seen["grpc"]
        assert isinstance(grpc, list)
        refused = sum(1 for status, closed in grpc if status == "8" and closed)
        http = seen["http"]
        assert isinstance(http, list)
        refused += sum(1 for a in http if a.startswith(b"HTTP/1.1 429 ") and a.endswith(b"<closed>"))
        return Observation(f"mallory's {CAP} busy connections: {refused} refused; grpc {grpc}; "
                           f"http {[a[:60] for a in http]}; acme {seen['acme']}", refused == CAP - SHARE)

    under_attack(capped, proc, "one tenant's busy connections past its share", attack).judge().check()
    assert seen["acme"] == ["ok"] * 10, seen["acme"]
    grpc, http = seen["grpc"], seen["http"]
    assert isinstance(grpc, list) and isinstance(http, list)
    # held: no answer (a call with no request yet; a request waiting for its body), SHARE of them
    held = sum(1 for status, _ in grpc if status is None) + sum(1 for a in http if a == b"")
    assert held == SHARE, (grpc, http)
    for a in http:  # the rest refused naming the share, told when to retry, closed
        if a:
            assert a.startswith(b"HTTP/1.1 429 Too Many Requests\r\n") and b"Retry-After: 1\r\n" in a, a
            assert SHARE_TEXT.encode() in a and a.endswith(b"<closed>"), a
    assert all(closed for status, closed in grpc if status is not None), grpc
    assert {status for status, _ in grpc} <= {None, "8"}, grpc
    assert str(seen["mallory"]).startswith("StatusCode.RESOURCE_EXHAUSTED: " + SHARE_TEXT), seen["mallory"]
    assert str(seen["mallory_http"]).startswith("429: " + SHARE_TEXT), seen["mallory_http"]


def _held(hostport: str, timeout: float = 0.3) -> tuple[RawH2, bool]:
    """A new stream-call connection of mallory's, and whether it is held (not refused)."""
    h2 = _stream(hostport)
    h2.wait_answered(1, timeout)
    return h2, h2.seen.statuses.get(1) is None and not h2.seen.eof


def _full_share_then_refused(hostport: str) -> list[RawH2]:
    """Mallory's share taken anew by stream calls (each held), and the next one refused naming it."""
    conns: list[RawH2] = []

    def one_more() -> RawH2 | None:  # (the closes before may still be on their way to the server)
        h2, held = _held(hostport)
        if held:
            return h2
        h2.close()
        return None

    for _ in range(SHARE):
        conns.append(eventually(one_more, 10.0, f"mallory's connection {len(conns) + 1} held"))
    extra, held = _held(hostport, 5.0)
    extra.close()
    assert not held and extra.seen.statuses.get(1) == "8", extra.seen
    return conns


def test_a_tenants_connections_are_given_back_on_every_close(capped: Mesh) -> None:
    """Its share comes back whichever way its connections end: the server's body timeout, a
    protocol error it closes for, the client's close (each time all SHARE held again, the next refused)."""
    proc = capped.gateway
    slow = [_slow_body(proc.http) for _ in range(SHARE)]
    try:
        assert [_answer(s, 0.1) for s in slow] == [b""] * SHARE  # held
        extra, held = _held(proc.grpc, 5.0)
        extra.close()
        assert not held, extra.seen
        # --body-timeout-s (3 s) ends each: the server closes them
        assert all(_answer(s, 10.0).endswith(b"<closed>") for s in slow)
    finally:
        for s in slow:
            s.close()
    conns = _full_share_then_refused(proc.grpc)
    try:
        for h2 in conns:  # DATA on stream 0: a connection error, GOAWAY(PROTOCOL_ERROR), closed by the server
            h2.send(frame(0, 0, 0, b"x"))
        assert all(h2.wait("closed", 5.0) for h2 in conns)
    finally:
        for h2 in conns:
            h2.close()
    conns = _full_share_then_refused(proc.grpc)
    for h2 in conns:  # the client's own close
        h2.close()
    for h2 in _full_share_then_refused(proc.grpc):
        h2.close()


def test_calls_without_a_key_that_stay_open_hold_only_the_anonymous_share(capped: Mesh) -> None:
    """A ModelStreamInfer call answers a missing key in band and stays open: measured before, a
    client without any key held every connection this way. Now such calls count as anonymous
    callers' (one share between them): the ninth is refused, acme's new connections are served."""
    proc = capped.gateway
    conns: list[RawH2] = []
    try:
        for _ in range(CAP):
            h2 = RawH2(proc.grpc)
            h2.send(frame(HEADERS, END_HEADERS, 1, grpc_headers(proc.grpc, STREAM, None)))
            h2.wait_answered(1, 0.1)
            conns.append(h2)
        acme = _acme_new_connections(proc.grpc, proc.http)
        statuses = [h2.seen.statuses.get(1) for h2 in conns]
    finally:
        for h2 in conns:
            h2.close()
    assert acme == ["ok"] * 10, acme
    assert statuses.count(None) == SHARE and statuses.count("8") == CAP - SHARE, statuses
