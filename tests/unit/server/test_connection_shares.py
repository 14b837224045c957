"""meshserve/server/connections.py: a connection counted for the tenant of its first request
(`ConnectionTable.claim`), at most max(1, cap x share) per tenant, given back once on every close
path (the servers through a real gateway: tests/adversarial/test_connection_shares.py)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from meshserve.protocol.errors import Code, InferError
from meshserve.server import inflate
from meshserve.server.connections import ConnectionTable
from tests.unit.server.test_connections import Conn

SHARES = {"acme": 0.5, "mallory": 0.25, "": 0.5}


def _tenant_of(headers: Mapping[str, Any]) -> tuple[str, float]:
    key = headers.get("x-api-key")
    if key is None:
        return "", SHARES[""]
    if key not in SHARES:
        raise InferError(Code.UNAUTHENTICATED, "unknown API key")
    return key, SHARES[key]


@pytest.fixture(autouse=True)
def tenants() -> Iterator[None]:
    before = inflate.tenant_of
    inflate.tenant_of = _tenant_of
    try:
        yield
    finally:
        inflate.tenant_of = before




def _claim(table: ConnectionTable, conn: Conn, key: str | None) -> str | None:
    return table.claim(conn, {} if key is None else {"x-api-key": key}, None, False)


def test_a_tenant_holds_at_most_its_share_and_the_refused_connection_is_not_counted() -> None:
    table = ConnectionTable(16)  # mallory: max(1, 16 x 0.25) = 4
    conns = [Conn(busy=True) for _ in range(6)]
    for c in conns:
        assert table.opened(c)
    assert [_claim(table, c, "mallory") for c in conns[:4]] == ["", "", "", ""]
    refusal = _claim(table, conns[4], "mallory")
    assert refusal == ("tenant 'mallory' has 4 connections open, its share (0.25 of --max-connections 16: 4); "
                       "this connection is closed, retry later on one already open")
    assert table.by_tenant == {"mallory": 4} and conns[4] not in table.owner and table.refused_share == 1
    assert _claim(table, conns[5], "acme") == ""  # another tenant's share is its own
    assert table.by_tenant == {"mallory": 4, "acme": 1}
    table.closed(conns[4])  # the refused one closes: nothing of mallory's given back
    assert table.by_tenant == {"mallory": 4, "acme": 1} and table.count == 5
    table.closed(conns[0])
    assert table.by_tenant == {"mallory": 3, "acme": 1}
    assert _claim(table, Conn(), "mallory") == ""  # room again


def test_a_connection_is_counted_once_and_given_back_once_on_every_close_path() -> None:
    table = ConnectionTable(64)  # headroom 2
    named = [Conn() for _ in range(3)]
    for c in named:
        table.opened(c)
        assert _claim(table, c, "acme") == ""
    assert _claim(table, named[0], "acme") == ""  # (asked again: not counted twice)
    assert _claim(table, named[0], "mallory") == ""  # another tenant's request later: the first attribution stays
    assert table.by_tenant == {"acme": 3} and table.owner[named[0]] == "acme"
    # eviction: given back when it is closed to make room, not again when its server reports the close
    fill = [Conn(busy=True) for _ in range(60)]  # the 60th opens at 62: the oldest idle is closed
    for c in fill:  # (each named at once, anonymous callers' or refused: unnamed ones hold only their share)
        table.opened(c)
        _claim(table, c, None)
    assert named[0].evicted and table.by_tenant == {"acme": 2, "": 32}  # (the fill: 32 named, 28 refused)
    table.closed(named[0])
    assert table.by_tenant == {"acme": 2, "": 32}
    # a normal close, an error or a timeout: each a close its server reports once
    table.closed(named[1])
    table.closed(named[2])
    assert table.by_tenant == {"": 32} and set(table.owner) == set(fill[:32])
    assert table.count == 60 and not table.unnamed and table.dropped == 0


def test_no_tenant_named_asks_again_and_anonymous_callers_share_one_share() -> None:
    table = ConnectionTable(4)  # anonymous callers: max(1, 4 x 0.5) = 2
    conns = [Conn(busy=True) for _ in range(4)]
    for c in conns:
        table.opened(c)
    assert _claim(table, conns[0], "no-such-key") is None  # its own check refuses it; nothing counted
    assert table.by_tenant == {}
    assert _claim(table, conns[0], None) == "" and _claim(table, conns[1], None) == ""
    assert (_claim(table, conns[2], None) or "").startswith("anonymous callers have 2 connections open, its share")
    assert table.by_tenant == {"": 2}


def test_without_tenants_nothing_is_named_or_counted() -> None:
    inflate.tenant_of = None
    table = ConnectionTable(4)
    c = Conn()
    table.opened(c)
    assert _claim(table, c, "acme") is None and table.owner == {}
    table.closed(c)
    assert table.count == 0


def test_an_unbounded_table_names_without_counting() -> None:
    table = ConnectionTable(0)
    c = Conn()
    table.opened(c)
    assert _claim(table, c, "acme") == "" and table.by_tenant == {}


def test_a_call_that_stays_open_without_a_tenants_key_counts_as_anonymous_callers() -> None:
    from meshserve.server import shm

    before = shm.share_of
    shm.share_of = SHARES.__getitem__
    try:
        table = ConnectionTable(4)  # anonymous callers: 2
        conns = [Conn(busy=True) for _ in range(4)]
        for c in conns:
            table.opened(c)
        assert _claim(table, conns[0], "no-such-key") is None  # a unary call: its own check answers it
        headers = {"x-api-key": "no-such-key"}
        assert [table.claim(c, headers, None, False, holds=True) for c in conns[:2]] == ["", ""]
        assert (table.claim(conns[2], headers, None, False, holds=True) or "").startswith(
            "anonymous callers have 2 connections open")
        assert table.by_tenant == {"": 2}
        table.closed(conns[0])
        assert table.by_tenant == {"": 1}
    finally:
        shm.share_of = before


def test_connections_not_named_yet_hold_at_most_their_share_oldest_closed_first() -> None:
    """Connections that name no tenant yet (no finished head, or only requests without a tenant's
    key) are one share between them, max(1, cap x the file's share): one accepted past it closes
    the oldest of them, whatever it is doing (docs/security.md, "Session 14: shares, round 2")."""
    table = ConnectionTable(16)  # unnamed: max(1, 16 x 0.5) = 8 (no tenants file read: 0.5)
    conns = [Conn(busy=True) for _ in range(12)]
    for c in conns:
        assert table.opened(c)
    assert [c.dropped for c in conns] == [True] * 4 + [False] * 8 and table.dropped == 4
    assert list(table.unnamed) == conns[4:] and table.count == 8
    for c in conns[:4]:  # their servers report the close: not counted again
        table.closed(c)
    assert table.count == 8 and table.closing == set()
    assert _claim(table, conns[4], "acme") == "" and conns[4] not in table.unnamed  # named: out of the line
    assert _claim(table, conns[5], "no-such-key") is None and conns[5] in table.unnamed  # nothing named: stays
    table.closed(conns[6])
    assert conns[6] not in table.unnamed and table.count == 7
    newer = [Conn() for _ in range(3)]
    for c in newer:
        assert table.opened(c)
    assert conns[5].dropped and not any(c.dropped for c in conns[6:] + newer)  # the oldest unnamed one
    assert list(table.unnamed) == conns[7:] + newer and table.count == 9 and table.dropped == 5


def test_near_the_cap_many_unnamed_connections_yield_before_a_tenants_idle_one() -> None:
    """Near the cap, while the unnamed hold half their share or more, a new connection closes the
    oldest unnamed one (at once: they are busy), not a tenant's idle keep-alive connection."""
    table = ConnectionTable(16)  # headroom 1, unnamed 8
    named = [Conn() for _ in range(8)]  # acme's, idle between requests
    for c in named:
        assert table.opened(c) and _claim(table, c, "acme") == ""
    unnamed = [Conn(busy=True) for _ in range(7)]
    for c in unnamed:
        assert table.opened(c)
    assert table.count == 15
    newcomer = Conn(busy=True)
    assert table.opened(newcomer) and unnamed[0].dropped and table.count == 15 and table.dropped == 1
    assert not any(c.evicted for c in named) and table.evicted == 0
    assert list(table.unnamed) == unnamed[1:] + [newcomer]


def test_at_the_cap_a_new_connection_takes_the_place_of_the_oldest_unnamed_one() -> None:
    """Every connection busy, few unnamed (the oldest idle one would go first, but none is idle):
    a new one closes the oldest unnamed one instead of being refused; with none unnamed it is
    refused as before."""
    table = ConnectionTable(16)  # headroom 1; acme 8, mallory 4, anonymous callers 8; unnamed 8
    for i in range(14):
        c = Conn(busy=True)
        assert table.opened(c) and _claim(table, c, "acme" if i < 8 else "mallory" if i < 12 else None) == ""
    unnamed = [Conn(busy=True) for _ in range(2)]
    for c in unnamed:
        assert table.opened(c)
    assert table.count == 16 and not any(c.dropped for c in unnamed)
    newcomer = Conn(busy=True)
    assert table.opened(newcomer) and unnamed[0].dropped and table.count == 16 and table.refused == 0
    assert list(table.unnamed) == [unnamed[1], newcomer] and table.evicted == 0
    for c in list(table.unnamed):
        assert _claim(table, c, None) is not None  # (named: anonymous callers', or refused at their share)
    assert not table.unnamed
    assert not table.opened(Conn()) and table.refused == 1  # nothing idle, nothing unnamed: refused


def test_without_tenants_no_connection_is_unnamed() -> None:
    inflate.tenant_of = None
    table = ConnectionTable(16)
    conns = [Conn(busy=True) for _ in range(16)]
    assert all(table.opened(c) for c in conns) and not table.unnamed and table.dropped == 0
    assert not table.opened(Conn()) and table.refused == 1
