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
# One scrape of the services serves every /metrics request of this long (and concurrent requests
# share one), so /metrics callers cannot multiply calls to the services.
FEDERATION_REUSE_S = 0.5
FEDERATION_TIMEOUT_S = 5.0


class Federation:
    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self._scrape: asyncio.Future[list[metrics.Federated]] | None = None
        self._scraped_at = 0.0
        self.up: dict[str, int] = {}  # replica -> 1 if its metrics were in the last scrape (federated_up)

    async def families(self) -> list[metrics.Federated]:
        """The healthy replicas' metric families, each sample labelled ``replica``; one scrape of
        the services at a time, reused for FEDERATION_REUSE_S."""
        now = time.monotonic()
        if self._scrape is None or (self._scrape.done() and now - self._scraped_at > FEDERATION_REUSE_S):
            self._scraped_at = now
            self._scrape = asyncio.ensure_future(self._scrape_replicas())
        return await asyncio.shield(self._scrape)

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
