"""Every buffer bounded in bytes: the gateway's request counts by model name.

`meshserve_gateway_requests_total{model, outcome}` counts every request that passed the name
check, by its model name, and a client makes the name up: a model that does not exist (404), or
one its tenant may not call (403). Each new name was a new key of the gateway's counts and a new
/metrics line, for ever (probed: 300 requests for 300 made-up names of ~215 bytes, 300 more
lines in /metrics), so a client with a key grew the gateway's memory and every scrape without
bound, 1 KB a request or so.

Now (`gateway/core.py:RequestCounts`): once the counts pass MAX_MODEL_LABELS keys, the names the
gateway does not serve are folded into the label model="(other)", their counts summed. mallory
sends 5,000 requests, each for a name of its own; the good client is judged by the suite's rules
while it does, and /metrics then holds at most MAX_MODEL_LABELS of mallory's names, the rest in
"(other)", every request still counted."""
from __future__ import annotations

import http.client
import re

from gateway.core import MAX_MODEL_LABELS, OTHER_MODELS
from tests.adversarial.harness import LONG, OTHER_KEY, Mesh, Observation, under_attack
from tests.adversarial.support import raw_http

NAMES = 12_000 if LONG else 5_000


def test_made_up_model_names_do_not_grow_the_request_counts_without_bound(mesh: Mesh) -> None:
    prefix = "madeup_"

    def flood() -> Observation:
        host, port = mesh.gateway.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        codes: dict[int, int] = {}
        try:
            for i in range(NAMES):
                conn.request("POST", f"/v2/models/{prefix}{i:06d}_{'x' * 200}/infer", body=b'{"inputs": []}',
                             headers={"x-api-key": OTHER_KEY, "Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                codes[r.status] = codes.get(r.status, 0) + 1
        finally:
            conn.close()
        return Observation(f"{codes}", set(codes) <= {403, 404})

    verdict = under_attack(mesh, mesh.gateway, "made-up model names", flood).judge()
    print(verdict.summary())
    verdict.check()
    status, body = raw_http(mesh.gateway.http, "GET", "/metrics")
    assert status == 200
    text = body.decode()
    lines = [line for line in text.splitlines() if line.startswith("meshserve_gateway_requests_total{")]
    named = {m.group(1) for line in lines if (m := re.search(r'model="(' + prefix + r'[^"]*)"', line))}
    assert len(named) < MAX_MODEL_LABELS, f"{len(named)} made-up names in /metrics"
    other = [line for line in lines if f'model="{OTHER_MODELS}"' in line]
    assert other, "no folded counts"
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in other) + len(named)  # (one request each)
    assert counted >= NAMES, (counted, other)
