"""Bounded admission: a process-wide cap on inference requests in flight and on their bytes.

One gate per process (`gate`), configured by `process.serve` from ServerLimits.max_inflight /
max_inflight_bytes and consulted by `observe.infer`, the one place both front ends (unary
ModelInfer, each request of a ModelStreamInfer stream, HTTP infer) pass through, on the gateway
and on services alike. Beyond either bound a request is refused at once with
RESOURCE_EXHAUSTED (HTTP 429 + Retry-After), before it costs anything else, so the requests
already admitted keep their latency under overload instead of every request queueing.

The check is a few integer operations on plain attributes: no lock (one event loop), no
await. A request is admitted while fewer than `max_requests` are in flight (it may carry the
count past the bound by its own weight) and while its bytes fit in what is left of
`max_bytes`; an idle process admits any one request, so a single request larger than the
byte bound is judged by max_request_bytes alone, never refused forever here.

Weight: a request the gateway merged from N client requests (``meshserve_merged_requests``)
counts N at a service, so the service's bound means "client requests in flight" whether they
came direct or merged. The gateway's own bound (counted per client request before merging) is
what protects the mesh: with equal bounds a service never refuses what one gateway admitted.
"""
from __future__ import annotations

import sys

from meshserve.protocol.errors import InferError
from meshserve.server.limits import ServerLimits

UNBOUNDED = sys.maxsize
# What a refused client is told to wait (HTTP Retry-After is whole seconds, so it reads "1"):
# in-flight requests finish within milliseconds, and a client retrying after that finds room.
RETRY_AFTER_S = 1.0


class Gate:
    """In-flight requests and bytes of this process, against their bounds (0 = unbounded)."""

    __slots__ = ("max_requests", "max_bytes", "requests", "bytes", "rejected")

    def __init__(self, max_requests: int = 0, max_bytes: int = 0) -> None:
        self.max_requests = max_requests or UNBOUNDED
        self.max_bytes = max_bytes or UNBOUNDED
        self.requests = 0  # admitted, not yet answered (weighted: a merged request counts its members)
        self.bytes = 0
        self.rejected = 0  # requests refused since start

    def refuse(self, model: str, weight: int, size: int) -> InferError:
        """The error for a request that does not fit (and count it)."""
        self.rejected += 1
        if self.requests >= self.max_requests:
            what = f"{self.requests} inference requests in flight (limit --max-inflight {self.max_requests})"
        else:
            what = (f"{self.bytes} bytes of inference requests in flight; this one's {size} would pass "
                    f"the limit --max-inflight-bytes {self.max_bytes}")
        return InferError.exhausted(f"server busy: {what}; request for model '{model}' refused, retry later",
                                    retry_after_s=RETRY_AFTER_S)


def tenant_cap(cap: int, share: float) -> int:
    """What one tenant may hold of a cap the whole process shares: max(1, cap * share) (the
    gateway's tenants file sets the shares: gateway/auth.py:Admission)."""
    return max(1, int(cap * share))


gate = Gate()  # unbounded until `configure` (in-process cores in unit tests stay unbounded)


def configure(limits: ServerLimits) -> Gate:
    """Set this process's bounds (process.serve), in place: observe holds the one gate."""
    gate.max_requests = limits.max_inflight or UNBOUNDED
    gate.max_bytes = limits.max_inflight_bytes or UNBOUNDED
    return gate
