"""Replica pools: two service replicas behind one gateway; one is killed under load and comes back."""
from __future__ import annotations

import calendar
import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.support import add_sub_inputs
from tests.conftest import _wait_http_ready, start
from tests.support import eventually

MODULES = {"http": httpclient, "grpc": grpcclient}
UNAVAILABLE = {"503", "StatusCode.UNAVAILABLE"}


def _inputs(proto: str) -> list:
    return add_sub_inputs(MODULES[proto])


def _served_by(service_grpc: str) -> int:
    with grpcclient.InferenceServerClient(service_grpc) as c:
        stats = c.get_inference_statistics("add_sub")
    return sum(s.inference_count for s in stats.model_stats)


def _replica_healthy(gateway_http: str, endpoint: str) -> bool:
    with urllib.request.urlopen(f"http://{gateway_http}/metrics", timeout=5) as r:
        text = r.read().decode()
    return f'meshserve_gateway_replica_healthy{{replica="{endpoint}"}} 1' in text


def _left_pool_at(gateway_output: list[str], endpoint: str) -> float | None:
    """When the gateway says it took ``endpoint`` out of its pool (the health watch, or a
    connection failure seen by a request), as epoch seconds from its own JSON log line."""
    for line in list(gateway_output):
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        msg = record.get("msg", "")
        if endpoint in msg and ("left the pool" in msg or "ejected" in msg):
            ts, _, millis = record["ts"].rstrip("Z").partition(".")
            return calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%S")) + int(millis) / 1000
    return None


def _answered_since(results: list[tuple[float, float, str]], lock: threading.Lock, t: float) -> int:
    with lock:
        return sum(1 for r in results if r[0] >= t)


def test_killed_replica_fails_fast_then_pool_heals(model_repo: Path) -> None:
    repo = str(model_repo)
    a = start(["service", "onnx", "--repository", repo, "--grpc-port", "0"])
    b = start(["service", "onnx", "--repository", repo, "--grpc-port", "0"])
    port_a = a.ports["grpc"]
    # a long probe interval: leaving and rejoining must come from the health watch, not the probe
    g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", a.grpc, "--upstream", b.grpc,
               "--discovery-interval", "30", "--log-format", "json"])
    results: list[tuple[float, float, str]] = []  # (start, duration, "OK" | status)
    lock = threading.Lock()
    stop = threading.Event()

    def load(proto: str) -> None:
        m, url = MODULES[proto], getattr(g, proto)
        inputs = _inputs(proto)
        with m.InferenceServerClient(url) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    if proto == "grpc":
                        c.infer("add_sub", inputs, client_timeout=20)
                    else:
                        c.infer("add_sub", inputs)
                    outcome = "OK"
                except InferenceServerException as e:
                    outcome = str(e.status())
                with lock:
                    results.append((t0, time.monotonic() - t0, outcome))

    threads = [threading.Thread(target=load, args=(p,)) for p in ("grpc", "http") * 4]
    try:
        _wait_http_ready(g.http)
        eventually(lambda: _replica_healthy(g.http, a.grpc) and _replica_healthy(g.http, b.grpc),
                   what="both replicas joined")
        for t in threads:
            t.start()
        eventually(lambda: _served_by(a.grpc) > 0 and _served_by(b.grpc) > 0, what="load spread over both replicas")
        assert _served_by(a.grpc) > 0 and _served_by(b.grpc) > 0, "load was not spread over both replicas"
        killed_at, killed_wall = time.monotonic(), time.time()
        a.stop(signal.SIGKILL)
        # out of the pool within 3 s of the kill, by the gateway's own clock (its log line's time):
        # the test's polls of /metrics, slowed by a busy machine, do not count against the gateway
        left_at = eventually(lambda: _left_pool_at(g.output, a.grpc), what="the gateway's word that the replica left")
        assert left_at is not None
        assert -0.01 <= left_at - killed_wall < 3.0, f"the killed replica left the pool {left_at - killed_wall:.2f} s after"
        eventually(lambda: not _replica_healthy(g.http, a.grpc), what="the killed replica out of the pool")
        # the pool serves on b alone for a while (the window after_kill below looks at)
        eventually(lambda: _answered_since(results, lock, killed_at + 0.5) > 20, what="load on the pool after the kill")
        assert not _replica_healthy(g.http, a.grpc)

        # back on the same port: it rejoins the pool and gets traffic again
        a = start(["service", "onnx", "--repository", repo, "--grpc-port", str(port_a)])
        eventually(lambda: _served_by(a.grpc) > 0, what="traffic on the restarted replica")
        assert _replica_healthy(g.http, a.grpc)
        back_at = time.monotonic()
        eventually(lambda: _answered_since(results, lock, back_at) > 20, what="load on the healed pool")
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(30)
        g.stop()
        a.stop()
        b.stop()

    failures = [r for r in results if r[2] != "OK"]
    assert all(r[2] in UNAVAILABLE for r in failures), failures[:5]
    assert all(r[1] < 2.0 for r in failures), f"a failing request hung: {max(r[1] for r in failures)}s"
    after_kill = [r for r in results if killed_at + 0.5 <= r[0] < back_at]
    assert len(after_kill) > 20
    assert all(r[2] == "OK" for r in after_kill), [r for r in after_kill if r[2] != "OK"][:5]
    assert all(r[2] == "OK" for r in results if r[0] >= back_at)
    print(f"pool: {len(results)} requests, {len(failures)} failed fast (in flight on the killed replica)")
