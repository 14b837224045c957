"""Every shared cap has a per-tenant share: connections that name no tenant yet too
(docs/security.md, "Session 14: shares, round 2").

A connection names its tenant with its first request's key, so one that has not finished its
first head (HTTP/1.1) or its first HEADERS block (HTTP/2) names nobody and counted only against
--max-connections. Before: a peer without any key opened HTTP/2 connections whose first HEADERS
block never ends (no END_HEADERS: the server holds the stream, so the connection is busy and
never closed to make room) until the gateway's 16 were full, and held them for
--header-timeout-s, opening new ones as those were closed: acme's new connections (the real
tritonclient) were refused at accept and its good client's idle ones closed to make room.

Now the connections not named yet hold at most max(1, 16 x 0.5) = 8 between them
(meshserve/server/connections.py:ConnectionTable.unnamed): one accepted past that closes the
oldest of them, and one accepted at the cap with nothing idle to close takes the place of the
oldest of them. The attacker opens connections at a steady pace (one per CONNECT_GAP_S) for
ATTACK_S, HTTP/2 and HTTP/1.1 heads that never end, while acme's fresh tritonclient
connections are all served and the harness's good client keeps its bound."""
from __future__ import annotations

import socket
import threading
import time

import tritonclient.grpc as grpcclient

from tests.adversarial.h2raw import HEADERS, INFER, RawH2, frame, grpc_headers
from tests.adversarial.harness import OTHER_KEY, Mesh, Observation, under_attack
from tests.adversarial.test_connection_shares import (
    CAP,
    SHARE,
    _acme_new_connections,
    _full_share_then_refused,
    capped,
)
from tests.support.http1 import connect
from tests.support.metrics import sample, scrape
from tests.support.waiting import eventually

__all__ = ["capped"]  # (the module-scoped gateway of --max-connections CAP, reused)

UNNAMED = CAP // 2  # max(1, 16 x 0.5): the tenants file's default share
ATTACK_S = 4.0  # longer than --header-timeout-s (2): the attacker replaces what the timeout closes
CONNECT_GAP_S = 0.02


def _unnamed_h2(hostport: str) -> RawH2:
    """An HTTP/2 connection whose first HEADERS block never ends (no END_HEADERS, no CONTINUATION):
    the server holds the stream, and the key inside the block is never read."""
    h2 = RawH2(hostport)
    block = grpc_headers(hostport, INFER, OTHER_KEY)
    h2.send(frame(HEADERS, 0, 1, block[: len(block) // 2]))
    return h2


def _unnamed_h1(hostport: str) -> socket.socket:
    """An HTTP/1.1 connection whose first head never ends."""
    s = connect(hostport, timeout=5.0)
    s.sendall(f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: {hostport}\r\nContent-".encode())
    return s


def _open(sock: socket.socket) -> bool:
    """Still open (nothing read: the server has sent nothing to an unfinished head)."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_connections_that_never_name_a_tenant_hold_only_their_share(capped: Mesh) -> None:
    proc = capped.gateway
    seen: dict[str, object] = {}

    def attack() -> Observation:
        h2s: list[RawH2] = []
        h1s: list[socket.socket] = []
        most = [0]
        held_at_end = [0]
        stop = threading.Event()

        def held() -> int:
            return sum(not (h.seen.eof or h.seen.goaway is not None) for h in h2s) + sum(map(_open, h1s))

        def flood() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    if i % 2:
                        h2s.append(_unnamed_h2(proc.grpc))
                    else:
                        h1s.append(_unnamed_h1(proc.http))
                except OSError:
                    pass
                most[0] = max(most[0], held())  # (as this side sees it: a close reaches it a little later)
                time.sleep(CONNECT_GAP_S)

        start = time.monotonic()
        t = threading.Thread(target=flood, daemon=True)
        t.start()
        try:
            time.sleep(1.0)  # the flood past the cap
            acme = []
            while time.monotonic() - start < ATTACK_S:  # acme's fresh connections, gRPC and HTTP, again and again
                try:
                    acme += _acme_new_connections(proc.grpc, proc.http)
                except Exception as exc:  # (a connection closed under the client: geventhttpclient raises)
                    acme.append(f"{type(exc).__name__}: {exc}")
            seen["acme"] = acme
        finally:
            stop.set()
            t.join(10)
            # the last ones are younger than --header-timeout-s: still open only within their share
            try:  # (in the clean-up: a miss is the observation's verdict, not an exception here)
                within = eventually(lambda: held() <= UNNAMED, 1.0, "the unnamed connections back within their share")
            except AssertionError:
                within = False
            opened = len(h2s) + len(h1s)
            held_at_end[0] = held()
            for h in h2s:
                h.close()
            for s in h1s:
                s.close()
        seen["opened"] = opened
        return Observation(f"{opened} connections opened, at most {most[0]} of them seen open at once, "
                           f"{held_at_end[0]} at the end; "
                           f"acme {len(seen['acme'])} requests, "  # type: ignore[arg-type]
                           f"{[a for a in seen['acme'] if a != 'ok'][:3]} failed",  # type: ignore[attr-defined]
                           within)

    verdict = under_attack(capped, proc, "connections that never finish their first head", attack)
    print(verdict.summary())
    acme = seen["acme"]
    assert isinstance(acme, list) and len(acme) >= 10 and acme == ["ok"] * len(acme), acme
    assert isinstance(seen["opened"], int) and seen["opened"] > 3 * CAP, seen["opened"]
    verdict.judge().check()
    with grpcclient.InferenceServerClient(proc.grpc) as c:  # (the gateway is fine after)
        assert c.is_server_live()


def test_the_connection_tables_refusals_are_in_metrics(capped: Mesh) -> None:
    """/metrics (docs/observability.md): a request refused past its tenant's share of
    --max-connections counts in meshserve_connections_refused_share_total, an unnamed connection
    closed past their share in meshserve_connections_unnamed_dropped_total; the open ones show."""
    proc = capped.gateway
    before = scrape(proc.http)
    mallory = _full_share_then_refused(proc.grpc)  # its share held, the next call refused naming it
    unnamed = []
    try:
        after = scrape(proc.http)
        assert sample(after, "meshserve_connections_refused_share_total") >= \
            sample(before, "meshserve_connections_refused_share_total") + 1
        assert sample(after, "meshserve_connections_open") >= SHARE + 1  # (+1: the scrape's own)
        unnamed = [_unnamed_h2(proc.grpc) for _ in range(UNNAMED + 3)]
        eventually(lambda: sum(h.wait("closed", 0.05) for h in unnamed) >= 3, 10, "the oldest unnamed ones closed")
        after = scrape(proc.http)
        assert sample(after, "meshserve_connections_unnamed_dropped_total") >= \
            sample(before, "meshserve_connections_unnamed_dropped_total") + 3
        assert sample(after, "meshserve_connections_refused_total") == sample(before, "meshserve_connections_refused_total")
    finally:
        for h in mallory + unnamed:
            h.close()
