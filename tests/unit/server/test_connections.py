"""meshserve/server/connections.py: the connection table's cap, oldest-idle eviction and the
derived default (the servers' use of it: tests/adversarial/test_connections.py)."""
from __future__ import annotations

import resource

from meshserve.server import connections
from meshserve.server.connections import ConnectionTable


class Conn:
    def __init__(self, busy: bool = False) -> None:
        self.busy = busy
        self.evicted = False
        self.dropped = False

    def evict(self) -> bool:
        if self.busy:
            return False
        self.evicted = True
        return True

    def drop(self) -> None:
        self.dropped = True


def test_near_the_cap_the_oldest_idle_connection_is_closed_and_at_it_new_ones_are_refused() -> None:
    table = ConnectionTable(64)  # headroom 2: evictions start at 62 connections
    conns = [Conn() for _ in range(62)]
    assert all(table.opened(c) for c in conns) and table.count == 62
    table.busy(conns[0])  # a request runs on the oldest: it is not idle
    table.idle_now(conns[1])  # the second is used again: now the newest idle one
    newcomer = Conn()
    assert table.opened(newcomer)
    assert [i for i, c in enumerate(conns) if c.evicted] == [2]  # the longest idle
    table.closed(conns[2])  # (its server reports the close)
    assert table.evicted == 1 and table.count == 62


def test_a_connection_that_turns_out_busy_is_skipped_and_a_full_table_refuses() -> None:
    table = ConnectionTable(16)  # headroom 1
    conns = [Conn(busy=True) for _ in range(16)]
    for c in conns:
        table.opened(c)
    assert table.count == 16 and not any(c.evicted for c in conns)  # (busy: nothing evicted at 15)
    assert not table.opened(Conn()) and table.refused == 1 and table.count == 16
    conns[5].busy = False
    assert table.opened(Conn()) and conns[5].evicted
    table.closed(conns[5])
    assert table.count == 16


def test_unbounded_table_and_derived_cap() -> None:
    table = ConnectionTable(0)
    assert all(table.opened(Conn()) for _ in range(1000))
    assert connections.derived_cap(1024, 256) == 640
    assert connections.derived_cap(100, 256) == 16


def test_raise_nofile_lifts_the_soft_limit_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowered = min(soft, 512)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
        got = connections.raise_nofile()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert now == (hard if hard != resource.RLIM_INFINITY else 1 << 20) and got == min(now, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
