"""Decompressing a compressed gRPC request message (``grpc-encoding`` gzip / deflate) before its
handler, and so before admission, sees it: in slices, within a process-wide budget.

A unary message arrives whole (at most --max-request-bytes on the wire, within its connection's
receive window), and only then can its model and tenant be admitted: its model name is inside it.
Inflated in one call on the event loop, a 64 KiB gzip bomb cost ~0.4 s of loop time up to the
64 MiB message limit (every other call on the process waited), and the inflated bytes of all
connections together were bounded by nothing but the streams they could open (1024 a
connection). Here (``Inflation.run``):

- at most ``STEP`` (64 KiB) of output per slice, the event loop runs other calls between slices;
- one message (``TURNS``) is inflated at a time in the process (the HTTP front door's bodies take
  the same turns, a chunk's output at a time), the others wait their turn in order (holding only
  their compressed bytes, within their connections' receive windows): what a flood adds to each
  turn of the event loop is one slice, however many streams carry it (all inflating runs on the
  loop's thread: more at once would add no throughput, only longer turns; with 24 bombs inflating
  side by side the good client's p99 went from 5 to 400 ms);
- every slice is charged to ``INFLATING`` (the process's decompressed bytes held, both of its gRPC
  ports together; its limit is --max-receive-bytes, the same bound the HTTP front door holds its
  bodies, wire and decoded, to) before it is inflated; a message whose next slice does not fit is
  refused RESOURCE_EXHAUSTED at once (the client may retry) and what it held is given back;
- the message limit holds as before: more than --max-request-bytes inflated is
  RESOURCE_EXHAUSTED "Received message larger than max", never inflated further;
- the bytes stay charged until the call ends (``Inflation.release``): the handler holds the
  message, then its parsed request, until it answers. A request stream's message is a request of
  its own: charged until that request ends (ModelStreamInfer keeps the charge, `Call.keep_inflated`,
  and gives it back as the request's task ends), not until the whole call ends (one long stream
  would hold the budget for ever) nor only until its handler takes it (the parsed requests of a
  stream would be bounded by nothing but their count).

The HTTP front door decodes bodies in slices of 1 MiB (`meshserve/protocol/http_codec.py:BodyDecoder`)
and charges the decoded bytes to its own process-wide budget (--max-receive-bytes,
`meshserve/server/http1/request.py:Request.read_body`).

With tenants (a gateway's --tenants: ``tenant_of``, set by the gateway), every shared cap has a
per-tenant share (docs/security.md, "Tenant isolation and the hop marker"); here:

- the caller is named from the request's headers before a byte of its body is inflated (``caller``:
  its API key, or its client certificate on a mutual-TLS port; "" for anonymous callers, who
  share one share); a caller that is no tenant is refused UNAUTHENTICATED / 401 there;
- one tenant holds at most max(one slice, limit x its share) of the inflated bytes (``Tenancy``:
  gRPC's ``INFLATING``, the HTTP front door's decoded bytes of --max-receive-bytes); past it its
  message is refused RESOURCE_EXHAUSTED / 429 naming the limit and the share, the others still
  have the rest;
- the turns are served round-robin by tenant (``meshserve/server/slots.py:Slots``: a line per tenant), and a holder passes
  its turn on between two slices while another tenant waits: a tenant's waiting messages hold
  another tenant back by one slice each round, however many they are.

Without tenants nothing is counted per tenant: one line, no look-up, no share.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from meshserve.protocol.errors import InferError
from meshserve.server import tls
from meshserve.server.slots import Slots

STEP = 1 << 16  # output bytes inflated per slice (~0.1 ms quiet, ~0.4 ms on a busy 2-core box)
TURNS = 1  # messages inflated at once, process-wide


class Refused(Exception):
    """The message is not inflated: ``code`` (a grpc status name) and ``message`` for the client."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


Caller = tuple[str, float]  # (tenant, its share of a process-wide cap); tenant "" = anonymous callers

# With tenants (gateway/core.py sets it to gateway/auth.py:Admission.caller): a request's tenant
# and share from its headers; raises InferError (UNAUTHENTICATED) for a caller that is no tenant.
# None: nothing is counted per tenant (services; a gateway without --tenants).
tenant_of: Callable[[Mapping[str, Any]], Caller] | None = None


def caller(headers: Mapping[str, Any], transport: object, certs: bool) -> Caller | None:
    """The request's tenant and share, from its headers (``certs``: a mutual-TLS port whose
    client certificate may name the tenant), before any of its body is inflated; None without
    tenants. Raises InferError (UNAUTHENTICATED: an unknown key, or none where one is needed)."""
    find = tenant_of
    if find is None:
        return None
    if certs:
        headers = tls.client_cert(dict(headers), transport)
    return find(headers)


class Tenancy:
    """What each tenant holds of one process-wide budget of bytes: at most max(``least``, limit x
    its share) (``least``: one slice, which a message needs to make any progress)."""

    __slots__ = ("held", "least")

    def __init__(self, least: int) -> None:
        self.held: dict[str, int] = {}  # tenant -> bytes its messages hold (absent: none)
        self.least = least

    def cap(self, limit: int, share: float) -> int:
        return max(self.least, int(limit * share))

    def refusal(self, who: Caller, n: int, limit: int, what: str) -> str | None:
        """Why ``n`` more bytes for ``who`` would pass its share of ``limit`` (None: they fit)."""
        tenant, share = who
        held = self.held.get(tenant, 0)
        cap = self.cap(limit, share)
        if held + n <= cap:
            return None
        name = f"tenant '{tenant}'" if tenant else "anonymous callers"
        return (f"{name} holds {held} bytes of {what}; {n} more would pass its share ({share:g} of "
                f"--max-receive-bytes {limit}: {cap}), retry later")

    def charge(self, tenant: str, n: int) -> None:
        self.held[tenant] = self.held.get(tenant, 0) + n

    def refund(self, tenant: str, n: int) -> None:
        left = self.held.get(tenant, 0) - n
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)


class Budget:
    """Decompressed bytes of request messages held by calls not yet ended, process-wide."""

    __slots__ = ("limit", "used", "tenants")

    def __init__(self) -> None:
        self.limit = 0  # 0: unbounded (set from --max-receive-bytes by the gRPC server)
        self.used = 0
        self.tenants = Tenancy(STEP)  # what each tenant's messages hold of it (with tenants)


INFLATING = Budget()


INFLATING_NOW = Slots(TURNS)  # the process's turns of inflating and decoding (``Slots``: a line per tenant)


class Inflation:
    """One message's inflation and what it holds of ``INFLATING`` (and, with tenants, of its
    tenant's share of it). ``metadata``: the call's (name, value) pairs, ``transport`` its
    connection's: they name the tenant."""

    __slots__ = ("held", "metadata", "transport", "tenant")

    def __init__(self, metadata: Iterable[tuple[str, Any]] = (), transport: object = None) -> None:
        self.held = 0
        self.metadata = metadata
        self.transport = transport
        self.tenant: str | None = None  # the tenant charged (with tenants, once run names it)

    def release(self) -> None:
        """Give back what the message held (the call ended); idempotent."""
        INFLATING.used -= self.held
        if self.tenant is not None:
            INFLATING.tenants.refund(self.tenant, self.held)
        self.held = 0

    async def run(self, encoding: bytes | None, data: bytes, limit: int) -> bytes:
        """``data`` inflated (gzip or deflate by ``encoding``), at most ``limit`` bytes of it,
        in slices of ``STEP`` charged to ``INFLATING`` (and the tenant's share of it) as they are
        made. Raises Refused."""
        if encoding == b"gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == b"deflate":
            d = zlib.decompressobj()
        else:
            raise Refused("INVALID_ARGUMENT",
                          "cannot decompress the request: compressed flag set without a grpc-encoding")
        who: Caller | None = None
        if tenant_of is not None:  # (with tenants: named before anything is inflated)
            try:
                who = caller(dict(self.metadata), self.transport, tls.cert_names_grpc)
            except InferError as exc:
                raise Refused(exc.grpc_status.name, exc.message) from None
        tenant = None if who is None else who[0]
        parts: list[bytes] = []
        size = 0
        tail = data
        budget = INFLATING
        turns = INFLATING_NOW
        index = await turns.take(tenant, TURNS)
        turn = True  # (this message holds a turn)
        try:
            while True:
                room = min(STEP, limit + 1 - size)
                if budget.limit and budget.used + room > budget.limit:
                    raise Refused("RESOURCE_EXHAUSTED",
                                  f"server busy: {budget.used} bytes of decompressed request messages held "
                                  f"(limit --max-receive-bytes {budget.limit}); retry later")
                if who is not None and budget.limit:
                    refusal = budget.tenants.refusal(who, room, budget.limit, "decompressed request messages")
                    if refusal is not None:
                        raise Refused("RESOURCE_EXHAUSTED", refusal)
                    self.tenant = tenant
                    budget.tenants.charge(who[0], room)
                budget.used += room
                self.held += room
                piece = d.decompress(tail, room)
                unused = room - len(piece)
                budget.used -= unused
                self.held -= unused
                if self.tenant is not None:
                    budget.tenants.refund(self.tenant, unused)
                size += len(piece)
                if size > limit:
                    raise Refused("RESOURCE_EXHAUSTED",
                                  f"Received message larger than max (decompressed over {limit} vs. {limit})")
                parts.append(piece)
                if d.eof:
                    break
                tail = d.unconsumed_tail
                if len(piece) < room and not tail:
                    raise zlib.error("incomplete or truncated stream")
                turn = False
                index = await turns.between(index, tenant, TURNS)  # (other calls run between slices; other tenants' first)
                turn = True
        except zlib.error as exc:
            self.release()
            raise Refused("INVALID_ARGUMENT", f"cannot decompress the request: {exc}") from None
        except BaseException:
            self.release()
            raise
        finally:
            if turn:
                turns.give(index, tenant)
        return parts[0] if len(parts) == 1 else b"".join(parts)
