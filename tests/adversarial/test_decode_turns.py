"""Every shared cap has a per-tenant share: the body worker's turns too.

An HTTP body whose JSON is larger than `meshserve/server/body_worker.py:OFFLOAD_BYTES` (64 KiB)
is decoded in the process's one body worker, one body at a time; the others wait their turn.
That turn is a process-wide resource like the inflating turns ("Session 11: inflate shares"),
and a tenant reaches it with nothing but a valid key: the body is decoded before the model's
permission and existence are judged. Tenant mallory sends 1 MiB JSON bodies for a model it may
not use on many connections at once (each costs it a 403, and the worker ~30-100 ms); tenant
acme, with the real tritonclient, sends identity_fp32 requests whose ~100 KB JSON is offloaded
too.

Before (one line, first come first served): acme's body waited behind every body of mallory's
queued before it. Session 13: a line per tenant, served round-robin: acme's body waited for at
most the one being decoded and one more of mallory's (p99 110-264 ms here, 344 ms in a fresh-clone
suite, limit 250). Session 18: two workers, a tenant at most its share of them at once
(`meshserve/server/body_worker.py:Slots`): mallory's bodies hold one, acme's take the other and
wait for none of mallory's. The suite's rules hold for acme (p99 under max(250 ms, 5x its
baseline), no failure; the gateway's RSS); every one of mallory's bodies is a client error."""
from __future__ import annotations

import ast
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tests.adversarial.harness import KEY, LONG, OTHER_KEY, GoodClient, Mesh, Observation, under_attack
from tests.adversarial.support import raw_http
from tests.conftest import ROOT

FLOOD_S = 8.0 if LONG else 4.0
CONNECTIONS = 48
ELEMENTS = (1 << 20) // 4  # "1.5," a value: 1 MiB of JSON
BODY = (b'{"inputs":[{"name":"INPUT0","shape":[1,%d],"datatype":"FP32","data":[' % ELEMENTS
        + b",".join([b"1.5"] * ELEMENTS) + b"]}]}")


class JsonClient(GoodClient):
    """tests.adversarial.json_client in its own process, read as GoodClient reads its own."""

    def __init__(self, http: str):  # (GoodClient's record keeping, another client's process)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.adversarial.json_client", "--http", http,
                                      "--key", KEY], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        self.records: list[tuple[float, float, str]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._pump, daemon=True).start()


def _flood(http: str) -> Observation:
    """mallory's bodies on CONNECTIONS connections at once for FLOOD_S: the answers' statuses."""
    stop = time.monotonic() + FLOOD_S

    def one_connection() -> Counter[str]:
        seen: Counter[str] = Counter()
        while time.monotonic() < stop:
            try:
                seen[str(raw_http(http, "POST", "/v2/models/not_mallorys/infer", {"x-api-key": OTHER_KEY}, BODY)[0])] += 1
            except OSError as exc:
                seen[type(exc).__name__] += 1
        return seen

    with ThreadPoolExecutor(CONNECTIONS) as pool:
        codes = sum((f.result() for f in [pool.submit(one_connection) for _ in range(CONNECTIONS)]), Counter())
    return Observation(f"{dict(codes)}", bool(codes) and all(c.startswith("4") for c in codes))


def test_one_tenants_large_json_bodies_leave_another_tenants_their_turn_in_the_body_worker(mesh: Mesh) -> None:
    acme = JsonClient(mesh.gateway.http)
    try:
        assert acme.wait_past(time.monotonic(), 30), "the JSON client did not start"
        view = Mesh(mesh.gateway, mesh.services, acme, mesh.tmp)  # (the harness judges view.good)
        verdict = under_attack(view, mesh.gateway, "large JSON bodies of another tenant",
                               lambda: _flood(mesh.gateway.http)).judge()
    finally:
        acme.stop()
    print(verdict.summary())  # (the figures, shown with -s)
    codes = ast.literal_eval(verdict.observed)
    assert codes.get("403", 0) > CONNECTIONS, codes  # mallory's bodies were decoded, then refused
    verdict.check()
