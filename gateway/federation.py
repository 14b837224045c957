"""--federate-metrics: the gateway's /metrics carries the services' families too, each sample
labelled with its ``replica``; the services' expositions are read through the Upstream."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from gateway.upstream.upstream import Upstream
from meshserve.telemetry import metrics

log = logging.getLogger("meshserve.gateway")
# Every /metrics answer comes from a scrape of the services that began after its request
# arrived (a metric a model made just before is in it: NVIDIA's custom_metrics QA model reads the
# server's /metrics right after making one); requests that come while a scrape runs share the next
# one, which begins when that one ends and at least FEDERATION_SPACING_S after it began. So
# /metrics callers cannot multiply calls to the services: one scrape at a time, one waiting, at
# most 1/FEDERATION_SPACING_S a second. (Before: one scrape's answer reused for 0.5 s, so a family
# a model made within 0.5 s of the last scrape was missing.)
FEDERATION_SPACING_S = 0.25
FEDERATION_TIMEOUT_S = 5.0


class Federation:
    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._next: asyncio.Future[list[metrics.Federated]] | None = None  # the scrape not yet begun
        self._last: asyncio.Future[list[metrics.Federated]] | None = None  # the latest scrape (begun or not)
        self._began_at = -FEDERATION_SPACING_S
        self.up: dict[str, int] = {}  # replica -> 1 if its metrics were in the last scrape (federated_up)

    async def families(self) -> list[metrics.Federated]:
        """The healthy replicas' metric families, each sample labelled ``replica``, from a scrape
        that begins after this call (shared with the calls waiting for the same one)."""
        scrape = self._next
        if scrape is None:
            scrape = self._next = self._last = asyncio.ensure_future(self._scrape_after(self._last))
        return await asyncio.shield(scrape)

    async def _scrape_after(self, previous: asyncio.Future[list[metrics.Federated]] | None
                            ) -> list[metrics.Federated]:
        """Wait for ``previous`` to end and the spacing, then begin: callers from now on wait for
        the scrape after this one."""
        if previous is not None:
            await asyncio.wait([previous])
        delay = self._began_at + FEDERATION_SPACING_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        self._began_at = time.monotonic()
        self._next = None
        return await self._scrape_replicas()

    async def _scrape_replicas(self) -> list[metrics.Federated]:
        healthy = self.upstream.healthy()
        results = await self.upstream.each(healthy, lambda r: r.scrape(b"", timeout=FEDERATION_TIMEOUT_S))
        out: list[metrics.Federated] = []
        up = {r.endpoint: 0 for r in self.upstream.replicas}  # an unhealthy replica is not asked: 0
        texts = {r.endpoint: res.decode() for r, res in zip(healthy, results, strict=True)
                 if not isinstance(res, BaseException)}
        # A family a model defines (a python model's custom metric) that one replica alone has keeps
        # the model's own labels, as Triton shows it (NVIDIA's custom_metrics example looks for
        # `requests_process_latency_ns{model="custom_metrics",version="1"}`); several replicas'
        # samples of it need `replica` to stay apart.
        seen = Counter(name for text in texts.values() for name in set(metrics.family_names(text))
                       if metrics.is_model_defined(name))
        bare = frozenset(name for name, n in seen.items() if n == 1)
        for r, res in zip(healthy, results, strict=True):
            if isinstance(res, BaseException):
                log.debug("metrics of %s not federated: %s", r.endpoint, res)
                continue
            try:
                out.append(metrics.federate(texts[r.endpoint], {"replica": r.endpoint}, bare))
            except Exception as exc:  # an unreadable exposition costs that replica's families, not the scrape
                log.warning("metrics of %s not federated: unreadable exposition: %s", r.endpoint, exc)
                continue
            up[r.endpoint] = 1
        self.up = up
        return out
