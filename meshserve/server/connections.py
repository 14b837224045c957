"""Descriptors and client connections, process-wide (docs/security.md, "Descriptors and connections").

At start `raise_nofile` lifts the soft RLIMIT_NOFILE to the hard limit. Every client connection
of the process's own servers (HTTP/1.1: meshserve/server/http1; HTTP/2:
meshserve/server/h2) is counted in one `ConnectionTable` against `--max-connections` (default:
the soft NOFILE minus a reserve for the hop, shared-memory regions, logs and model files):

- a connection that opens while the table is nearly full (within `headroom` of the cap) closes
  the connection idle the longest (no request in progress: a keep-alive connection between
  requests, or one that has not sent a complete request head yet), oldest first;
- a connection that opens at the cap with nothing idle to close is accepted and closed at once
  (HTTP/1.1: a 503 with Retry-After first), so the listening socket never runs out of
  descriptors (asyncio then stops accepting for a second, and every client waits).

`idle` is insertion-ordered, the oldest first: the HTTP/1.1 server takes a connection out while
a request runs (`busy`) and puts it back at the end after (`idle_now`); the HTTP/2 server moves
a connection to the end when a stream starts, and `evict` skips one with streams open. Two dict
operations per request.

With tenants (a gateway's --tenants: `meshserve/server/inflate.py:tenant_of`), a connection is
also its tenant's (docs/security.md, "Session 13: connections by tenant"): `claim` counts it
against the tenant its first request names (its API key, or its client certificate on a
mutual-TLS port; anonymous callers, where allowed, share one share), and a tenant holds at most
max(1, cap x its share) connections (`meshserve/server/admission.py:tenant_cap`); the request
that would make a connection its tenant's next one past that is refused (HTTP 429 and the
connection closed after the answer; gRPC RESOURCE_EXHAUSTED and GOAWAY) and the connection is
not counted for it. A request whose key is no tenant's names nothing (its own check refuses it);
the next request of the connection is asked again, except a call that stays open (a
ModelStreamInfer call answers a missing key in band): it counts as anonymous callers'. The first
attribution stays for the
connection's life: a later request naming another tenant is served and counted as usual
(`meshserve/server/admission.py`), the connection is not counted twice. A counted connection is
given back exactly once: when it is evicted (`_evict_oldest`) or when it closes (`closed`),
whichever comes first. Each server asks only until the connection is named (one attribute test
per request after that); without tenants nothing is asked.

With tenants, connections not yet named (accepted, no request naming a tenant yet: a first head
or HEADERS block not finished, or only requests without a tenant's key) are one share between
them, as anonymous callers are (docs/security.md, "Session 14: shares, round 2"): `unnamed`,
oldest first, holds at most max(1, cap x the tenants file's share); a connection accepted past
that closes the oldest unnamed one (`evict` when it is idle, else `drop`: at once, a request in
progress or not); a connection accepted near the cap closes the oldest unnamed one rather than
the oldest idle one while the unnamed hold half their share or more (else, as before, the oldest
idle one), and one accepted at the cap with nothing idle to close closes the oldest unnamed one
rather than be refused. So connections that never name a tenant cannot hold the cap against a tenant's
new connection, which takes the place of the oldest of them. A connection leaves `unnamed` when
it is named (`claim`), evicted, dropped or closed: one dict operation per connection, none per
request.
"""
from __future__ import annotations

import logging
import resource
from collections.abc import Mapping
from typing import Any, Protocol

from meshserve.protocol.errors import InferError
from meshserve.server import inflate
from meshserve.server.admission import tenant_cap
from meshserve.telemetry import metrics

log = logging.getLogger("meshserve.connections")

BASE_RESERVE = 128  # descriptors kept for the hop's connections, logs, the body worker, model files, listeners


EVICT_SCAN = 64  # connections looked at per eviction


class Closable(Protocol):
    def evict(self) -> bool:
        """Close now if no request is in progress; whether it did."""

    def drop(self) -> None:
        """Close now, a request in progress or not (an unnamed connection past its share)."""


def raise_nofile() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    unlimited = 1 << 20  # (RLIM_INFINITY: a cap this large is no cap on this machine)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else unlimited
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the soft NOFILE limit from %d to %d: %s", soft, target, exc)
    return int(min(soft, unlimited) if soft != resource.RLIM_INFINITY else unlimited)


def derived_cap(nofile: int, shm_regions: int) -> int:
    """--max-connections' default: NOFILE minus BASE_RESERVE and one descriptor per shared-memory
    region a client may register (each holds its descriptor open), at least 16."""
    return max(16, nofile - BASE_RESERVE - shm_regions)


class ConnectionTable:
    """The process's client connections (see the module docstring)."""

    __slots__ = ("limit", "headroom", "count", "idle", "closing", "refused", "evicted", "owner", "by_tenant",
                 "refused_share", "unnamed", "dropped")

    def __init__(self, limit: int = 0) -> None:
        self.count = 0
        self.idle: dict[Closable, None] = {}  # no request in progress, oldest first
        self.closing: set[Closable] = set()  # evicted, not yet closed: no longer counted
        self.refused = 0  # connections accepted and closed at the cap
        self.evicted = 0  # idle connections closed to make room
        self.owner: dict[Closable, str] = {}  # with tenants: each connection counted for a tenant ("" anonymous)
        self.by_tenant: dict[str, int] = {}  # ... and how many each tenant holds
        self.refused_share = 0  # requests refused because their connection was past its tenant's share
        self.unnamed: dict[Closable, None] = {}  # with tenants: connections not named yet, oldest first
        self.dropped = 0  # unnamed connections closed past their share (or at the cap, for a new one)
        self.limit = self.headroom = 0
        self.configure(limit)

    def configure(self, limit: int) -> None:
        self.limit = limit
        self.headroom = max(1, limit // 32) if limit else 0

    def opened(self, conn: Closable) -> bool:
        """A connection was accepted: False when it must be closed at once (at the cap, nothing
        idle to close). An accepted connection starts idle (no request yet)."""
        limit = self.limit
        if limit:
            if self.count >= limit - self.headroom:
                unnamed = self.unnamed
                if unnamed and 2 * len(unnamed) >= self.unnamed_cap(limit):
                    self._drop_oldest_unnamed()  # many that name nobody: the oldest of them, not a tenant's idle one
                else:
                    self._evict_oldest()
                    if self.count >= limit and unnamed:  # nothing idle: the oldest unnamed one makes room
                        self._drop_oldest_unnamed()
            if self.count >= limit:
                self.refused += 1
                return False
        self.count += 1
        self.idle[conn] = None
        if inflate.tenant_of is not None:  # with tenants: unnamed until a request names its tenant
            unnamed = self.unnamed
            unnamed[conn] = None
            if len(unnamed) > 1 and limit and len(unnamed) > self.unnamed_cap(limit):
                self._drop_oldest_unnamed()
        return True

    @staticmethod
    def unnamed_cap(limit: int) -> int:
        """The connections not named yet may hold max(1, cap x the tenants file's share), the share
        anonymous callers have (``meshserve/server/shm.py:share_of``: the gateway's tenants file)."""
        from meshserve.server import shm  # (as `claim` reads it)
        share_of = shm.share_of
        return tenant_cap(limit, share_of("") if share_of is not None else 0.5)

    def _drop_oldest_unnamed(self) -> None:
        """Close the oldest connection not named yet (as an idle one is closed when it is idle,
        at once whatever it is doing otherwise); uncounted at once."""
        unnamed = self.unnamed
        conn = next(iter(unnamed))
        del unnamed[conn]
        self.idle.pop(conn, None)
        self.dropped += 1
        self.count -= 1
        self.closing.add(conn)
        if not conn.evict():
            conn.drop()

    def closed(self, conn: Closable) -> None:
        self.idle.pop(conn, None)
        if self.unnamed:
            self.unnamed.pop(conn, None)
        if self.owner:
            self._disown(conn)
        if self.closing:
            try:
                self.closing.remove(conn)
                return  # (uncounted when it was evicted)
            except KeyError:
                pass
        self.count -= 1

    def busy(self, conn: Closable) -> None:
        """A request started on `conn`."""
        self.idle.pop(conn, None)

    def idle_now(self, conn: Closable) -> None:
        """`conn` has no request in progress (again): it becomes the newest idle one."""
        idle = self.idle
        idle.pop(conn, None)
        idle[conn] = None

    def _evict_oldest(self) -> None:
        """Close the oldest idle connection; one that turns out busy (an HTTP/2 connection is
        only touched when a stream starts) moves to the end. At most EVICT_SCAN looked at."""
        idle = self.idle
        for _ in range(min(len(idle), EVICT_SCAN)):
            conn = next(iter(idle))
            del idle[conn]
            if conn.evict():  # its descriptor is released as the loop closes it: counted free now
                self.evicted += 1
                self.count -= 1
                if self.owner:
                    self._disown(conn)
                if self.unnamed:
                    self.unnamed.pop(conn, None)
                self.closing.add(conn)
                return
            idle[conn] = None

    def claim(self, conn: Closable, headers: Mapping[str, Any], transport: object, certs: bool,
              holds: bool = False) -> str | None:
        """With tenants: count `conn` for the tenant a request of it names by `headers` (its key,
        or on a mutual-TLS port (`certs`) its client certificate). None: no tenant named (no
        tenants, or a key that is no tenant's: the request's own check answers it), ask again
        at the connection's next request; "": counted, the connection is named for good; any
        other text: refused, the tenant holds its share already (the text says so): the server
        answers the request with it and closes the connection, which is not counted for the tenant.
        `holds`: a call that stays open whatever its requests' answers (a ModelStreamInfer call,
        whose errors, a missing key's too, are answered in band): without a tenant's key it counts
        as anonymous callers' (their one share), so keyless calls cannot hold every connection."""
        try:
            who = inflate.caller(headers, transport, certs)
        except InferError:
            if not holds:
                return None
            from meshserve.server import shm  # (the tenants file's share, as the shared-memory caps read it)
            share_of = shm.share_of
            if share_of is None:
                return None
            who = ("", share_of(""))
        if who is None:
            return None
        tenant, share = who
        if self.unnamed:
            self.unnamed.pop(conn, None)  # named, or refused and closed: no longer one of them
        limit = self.limit
        if not limit or conn in self.owner:
            return ""
        held = self.by_tenant.get(tenant, 0)
        cap = tenant_cap(limit, share)
        if held >= cap:
            self.refused_share += 1
            who_text = f"tenant '{tenant}' has" if tenant else "anonymous callers have"
            return (f"{who_text} {held} connections open, its share ({share:g} of --max-connections {limit}: "
                    f"{cap}); this connection is closed, retry later on one already open")
        self.by_tenant[tenant] = held + 1
        self.owner[conn] = tenant
        return ""

    def _disown(self, conn: Closable) -> None:
        """`conn` no longer counts for its tenant (at most once: the entry goes)."""
        tenant = self.owner.pop(conn, None)
        if tenant is not None:
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]


TABLE = ConnectionTable()

# the table's counts in /metrics, gateway and services alike (docs/observability.md)
FAMILIES = {
    "connections_open": metrics.Family("meshserve_connections_open", "gauge",
                                       "Client connections open (HTTP/1.1 and HTTP/2), counted against "
                                       "--max-connections"),
    "connections_refused": metrics.Family("meshserve_connections_refused_total", "counter",
                                          "Connections accepted and closed at once at --max-connections "
                                          "(nothing idle or unnamed to close)"),
    "connections_evicted": metrics.Family("meshserve_connections_evicted_total", "counter",
                                          "Idle connections closed to make room near --max-connections"),
    "connections_refused_share": metrics.Family(
        "meshserve_connections_refused_share_total", "counter",
        "Requests refused because their connection would have been their tenant's next past its share of "
        "--max-connections (with tenants; the connection is closed)"),
    "connections_unnamed_dropped": metrics.Family(
        "meshserve_connections_unnamed_dropped_total", "counter",
        "Connections that named no tenant yet closed past their share of --max-connections, or to make room "
        "at it for a new one (with tenants)"),
}


def samples(table: ConnectionTable | None = None) -> list[metrics.Sample]:
    """The table's counts as /metrics samples (``FAMILIES``)."""
    t = TABLE if table is None else table
    return [("connections_open", {}, t.count), ("connections_refused", {}, t.refused),
            ("connections_evicted", {}, t.evicted), ("connections_refused_share", {}, t.refused_share),
            ("connections_unnamed_dropped", {}, t.dropped)]


def configure(max_connections: int, shm_regions: int) -> int:
    """Raise NOFILE and set the cap (0: derived from NOFILE); returns the cap."""
    nofile = raise_nofile()
    cap = max_connections or derived_cap(nofile, shm_regions)
    TABLE.configure(cap)
    return cap
