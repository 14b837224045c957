"""The coalescer never fails a member with another member's deadline (issue 29, finding 4): one
tenant's client with a tiny deadline among many clients of another tenant without one, through
the mesh's gateway (tenants, two ONNX replicas, coalescing on) with the real tritonclient. Before
the fix a merged request carried its smallest member's deadline and every member got its
failure: clients with no deadline saw DEADLINE_EXCEEDED (67 of 11k in the probe). Every answer
is also checked to be the client's own (each sends its own random tensors)."""
from __future__ import annotations

import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import KEY, LONG, OTHER_KEY, Mesh
from tests.support.metrics import scrape

CLIENTS = 8  # acme's clients, no deadline
REQUESTS = 400 if LONG else 150  # each
TINY_S = 0.002  # mallory's deadline


def merged_sends(hostport: str) -> float:
    return sum(v for (name, _), v in scrape(hostport).items() if name == "meshserve_gateway_merged_sends_total")


def inputs(rng: np.random.Generator) -> tuple[list[grpcclient.InferInput], np.ndarray, np.ndarray]:
    a = rng.standard_normal((1, 16)).astype(np.float32)
    b = rng.standard_normal((1, 16)).astype(np.float32)
    ins = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"), grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    return ins, a, b


def test_a_tiny_deadline_fails_no_other_client(mesh: Mesh) -> None:
    g = mesh.gateway
    before = merged_sends(g.http)
    failures: list[str] = []
    wrong: list[str] = []
    tiny: dict[str, int] = {}
    done = threading.Event()
    lock = threading.Lock()

    def patient(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpcclient.InferenceServerClient(g.grpc) as c:
            for i in range(REQUESTS):
                ins, a, b = inputs(rng)
                try:
                    r = c.infer("add_sub", ins, request_id=f"p{seed}-{i}", headers={"x-api-key": KEY})
                except InferenceServerException as exc:
                    with lock:
                        failures.append(f"{exc.status()}: {exc.message()}")
                    continue
                if not (np.array_equal(r.as_numpy("OUTPUT0"), a + b) and np.array_equal(r.as_numpy("OUTPUT1"), a - b)
                        and r.get_response().id == f"p{seed}-{i}"):
                    with lock:
                        wrong.append(f"p{seed}-{i}")

    def hurried() -> None:
        rng = np.random.default_rng(1000)
        # its own connection: each expired deadline resets a stream, and past the rapid-reset
        # guard (--stream-reset-burst) the gateway closes that connection; gRPC Python would
        # otherwise share one connection among all the test's clients (the global subchannel pool)
        with grpcclient.InferenceServerClient(g.grpc, channel_args=[("grpc.use_local_subchannel_pool", 1)]) as c:
            while not done.is_set():
                ins, a, b = inputs(rng)
                try:
                    r = c.infer("add_sub", ins, headers={"x-api-key": OTHER_KEY}, client_timeout=TINY_S)
                    outcome = "ok" if np.array_equal(r.as_numpy("OUTPUT0"), a + b) else "wrong"
                except InferenceServerException as exc:
                    outcome = str(exc.status())
                tiny[outcome] = tiny.get(outcome, 0) + 1

    hurry = [threading.Thread(target=hurried) for _ in range(2)]
    clients = [threading.Thread(target=patient, args=(seed,)) for seed in range(CLIENTS)]
    t0 = time.monotonic()
    for t in hurry + clients:
        t.start()
    for t in clients:
        t.join(300)
    done.set()
    for t in hurry:
        t.join(30)
    elapsed = time.monotonic() - t0
    merges = merged_sends(g.http) - before
    print(f"{CLIENTS * REQUESTS} patient requests in {elapsed:.1f} s, {merges:.0f} merged sends; "
          f"the tiny-deadline client: {tiny}")
    assert not failures, f"{len(failures)} of {CLIENTS * REQUESTS} requests without a deadline failed: {failures[:5]}"
    assert not wrong, f"answers that were not the client's own: {wrong[:5]}"
    assert tiny.get("wrong", 0) == 0, tiny
    assert tiny.get("StatusCode.DEADLINE_EXCEEDED", 0) > 0, f"the tiny deadline never expired: {tiny}"
    assert merges > 0, "nothing was merged: the test did not exercise the coalescer"

