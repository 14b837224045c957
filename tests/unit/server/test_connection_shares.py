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
    for c in fill:
        table.opened(c)
    assert named[0].evicted and table.by_tenant == {"acme": 2}
    table.closed(named[0])
    assert table.by_tenant == {"acme": 2}
    # a normal close, an error or a timeout: each a close its server reports once
    table.closed(named[1])
    table.closed(named[2])
    assert table.by_tenant == {} and table.owner == {}
    assert table.count == 60


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
