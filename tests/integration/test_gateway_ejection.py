"""A replica ejected under coalesced load and back: every answer is its own request's.

The case of docs/perf/side-by-side-round-3.md ("What remains"): a callgrind run of the gateway
saw UNAVAILABLE while its only replica was ejected, then INVALID_ARGUMENT "expected 2 inputs but
got 0 inputs" from the service. The cause was the load generator's (tests/load/test_load.py -k
ejected); this test holds the gateway's side: the requests in flight, merged, queued in the
coalescer, timed out (a merge's deadline: its members sent again alone) or refused while the
replica is out, and those sent once it is back, all carry their own inputs.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import service_and_gateway
from tests.support import eventually

THREADS = 16  # a busy model: requests merge in the gateway's coalescer
ALLOWED = {"StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"}  # while the replica is out


def _metrics(gateway_http: str) -> str:
    with urllib.request.urlopen(f"http://{gateway_http}/metrics", timeout=5) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def _merged_sends(gateway_http: str) -> float:
    found = re.search(r"^meshserve_gateway_merged_sends_total(?:{})? (\S+)$", _metrics(gateway_http), re.M)
    assert found is not None
    return float(found.group(1))


def _healthy(gateway_http: str, endpoint: str) -> bool:
    return f'meshserve_gateway_replica_healthy{{replica="{endpoint}"}} 1' in _metrics(gateway_http)


def test_answers_keep_their_own_inputs_across_an_ejection(model_repo: Path) -> None:
    with service_and_gateway("onnx", ["--repository", str(model_repo), "--model-control-mode", "explicit",
                                      "--load-model", "add_sub"], ["--discovery-interval", "0.5"]) as (svc, gw):
        # (start, outcome) per request; outcome "OK" only when both outputs are this request's own
        results: list[tuple[float, str]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def load(k: int) -> None:
            timeout = 5 if k % 2 else None  # half with a deadline (merges by deadline, resends), half without
            b = np.arange(16, dtype=np.float32).reshape(1, 16)
            with grpcclient.InferenceServerClient(gw.grpc) as client:
                j = 0
                while not stop.is_set():
                    j += 1
                    a = np.full((1, 16), k * 10_000 + j, np.float32) + b / 32
                    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
                              grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
                    inputs[0].set_data_from_numpy(a)
                    inputs[1].set_data_from_numpy(b)
                    t0 = time.monotonic()
                    try:
                        out = client.infer("add_sub", inputs, client_timeout=timeout)
                        own = np.array_equal(out.as_numpy("OUTPUT0"), a + b) and \
                            np.array_equal(out.as_numpy("OUTPUT1"), a - b)
                        outcome = "OK" if own else "another request's answer"
                    except InferenceServerException as exc:
                        outcome = f"{exc.status()}: {exc.message()}"
                    with lock:
                        results.append((t0, outcome))

        threads = [threading.Thread(target=load, args=(k,)) for k in range(THREADS)]
        stopped = False
        try:
            for t in threads:
                t.start()
            eventually(lambda: _merged_sends(gw.http) > 0, what="requests merged under load")
            os.kill(svc.proc.pid, signal.SIGSTOP)  # the probes time out: the gateway ejects it
            stopped = True
            eventually(lambda: not _healthy(gw.http, svc.grpc), timeout=60, what="the replica ejected")
            ejected_at = time.monotonic()
            eventually(lambda: any(t0 >= ejected_at and "no healthy replica" in o for t0, o in results),
                       timeout=30, what="requests refused while the replica is out")
            os.kill(svc.proc.pid, signal.SIGCONT)
            stopped = False
            eventually(lambda: _healthy(gw.http, svc.grpc), timeout=60, what="the replica back in the pool")
            back_at = time.monotonic()
            merged_before = _merged_sends(gw.http)
            eventually(lambda: sum(1 for t0, _ in results if t0 >= back_at) >= 50 * THREADS and
                       _merged_sends(gw.http) > merged_before, timeout=120, what="load on the replica back")
        finally:
            if stopped:
                os.kill(svc.proc.pid, signal.SIGCONT)
            stop.set()
            for t in threads:
                t.join(30)
        with lock:
            done = list(results)
    wrong = [o for _, o in done if o != "OK" and o.split(":")[0] not in ALLOWED]
    assert not wrong, wrong[:5]  # never INVALID_ARGUMENT (inputs lost), never another request's answer
    after = [o for t0, o in done if t0 >= back_at]
    assert after and all(o == "OK" for o in after), [o for o in after if o != "OK"][:5]
