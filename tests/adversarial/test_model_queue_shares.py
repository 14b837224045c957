"""Every shared cap has a per-tenant share: a model's queue too.

A model's config may bound the requests queued for it at its service
(`dynamic_batching { default_queue_policy { max_queue_size: N } }`): beyond it the service refuses
"exceeds maximum queue size", as Triton does. The queue is every caller's, and a tenant's share of
--max-inflight (64 at the defaults) is far more than a small queue: one tenant's requests for the
model filled it, and another tenant's requests for that model were refused (or, held back by the
gateway's coalescer, waited behind all of them).

Here a python model that takes 300 ms a request, one instance, batches of 1 and a queue of 4:
mallory keeps 12 requests for it in flight; acme, with the real tritonclient, sends its own one
after the other. Each of acme's requests must be served, within a few runs of the model: mallory
holds at most its share, max(1, 0.5 x (4 queued + 1 running)) = 2, of the requests the model's
replica takes at once, and is refused at the gateway (429 / RESOURCE_EXHAUSTED naming its share)
beyond it (gateway/auth.py:Admission, gateway/core.py:GatewayCore.queue_room). Before: all five
of acme's requests were refused "exceeds maximum queue size" (mallory's 12 kept the queue full).

The same with priority levels (session 14): `sleepy_levels` queues priority 2 in a queue of 4
of its own (`priority_queue_policy { key: 2 ... }`), the default level unbounded; mallory and
acme send `priority=2`. Each level's bound has its share (gateway/auth.py:QueueRooms); before,
only the default policy's was read, and acme's five were refused "exceeds maximum queue size"."""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import KEY, OTHER_KEY, tenant
from tests.conftest import Proc, service_and_gateway
from tests.models import python_models
from tests.support.waiting import eventually

RUN_S = 0.3
SLEEPY = f'''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            time.sleep({RUN_S})  # the point: the model is slow
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x)]))
        return out
'''
CONFIG = python_models.config("sleepy", [("IN", "TYPE_FP32", "4")], [("OUT", "TYPE_FP32", "4")], 1,
                              "dynamic_batching { default_queue_policy { max_queue_size: 4 } }\n"
                              "instance_group [ { count: 1 kind: KIND_CPU } ]\n")
LEVELS_CONFIG = python_models.config(
    "sleepy_levels", [("IN", "TYPE_FP32", "4")], [("OUT", "TYPE_FP32", "4")], 1,
    "dynamic_batching { priority_levels: 2 default_priority_level: 1\n"
    "  priority_queue_policy { key: 2 value { max_queue_size: 4 } } }\n"
    "instance_group [ { count: 1 kind: KIND_CPU } ]\n")
MODELS = ["sleepy", "sleepy_levels"]
TENANTS = "\ntenants:\n" + tenant("acme", KEY, MODELS) + tenant("mallory", OTHER_KEY, MODELS)


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("model-queue")
    python_models.write(tmp / "repo", "sleepy", SLEEPY, CONFIG)
    python_models.write(tmp / "repo", "sleepy_levels", SLEEPY, LEVELS_CONFIG)
    (tmp / "tenants.yaml").write_text(TENANTS)
    with service_and_gateway("python", ["--repository", str(tmp / "repo")], ["--tenants", str(tmp / "tenants.yaml")],
                             timeout=180) as procs:
        yield procs


def _once(client: grpcclient.InferenceServerClient, key: str, tag: float, model: str = "sleepy",
          priority: int = 0) -> str:
    x = np.full((1, 4), tag, np.float32)
    inp = grpcclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    try:
        got = client.infer(model, [inp], headers={"x-api-key": key}, client_timeout=20,
                           priority=priority).as_numpy("OUT")
    except InferenceServerException as exc:
        return f"{exc.status()}: {(exc.message() or '')[:120]}"
    return "ok" if got is not None and np.array_equal(got, x) else "wrong"


def test_one_tenant_cannot_fill_a_models_queue(sleepy: tuple[Proc, Proc]) -> None:
    _, gateway = sleepy
    _acme_served_beside_mallorys_flood(gateway, "sleepy", 0)


def test_one_tenant_cannot_fill_a_priority_levels_queue(sleepy: tuple[Proc, Proc]) -> None:
    """The level's own max_queue_size (priority_queue_policy) has its share as the default's has."""
    _, gateway = sleepy
    _acme_served_beside_mallorys_flood(gateway, "sleepy_levels", 2)


def _acme_served_beside_mallorys_flood(gateway: Proc, model: str, priority: int) -> None:
    stop = time.monotonic() + 6.0
    mallory: Counter[str] = Counter()
    lock = threading.Lock()

    def flood(i: int) -> None:
        with grpcclient.InferenceServerClient(gateway.grpc) as c:
            while time.monotonic() < stop:
                outcome = _once(c, OTHER_KEY, float(i), model, priority)
                with lock:
                    mallory[outcome.split(":")[0] + (" (its share)" if "its share" in outcome else "")] += 1
                if outcome != "ok":
                    time.sleep(0.02)  # (a client that retries at once)

    attackers = [threading.Thread(target=flood, args=(i,)) for i in range(12)]
    for t in attackers:
        t.start()
    acme: list[tuple[str, float]] = []
    try:
        eventually(lambda: sum(mallory.values()) >= 2, 20, "mallory's requests answered (the flood under way)")
        with grpcclient.InferenceServerClient(gateway.grpc) as c:
            for i in range(5):
                t0 = time.monotonic()
                acme.append((_once(c, KEY, 100.0 + i, model, priority), time.monotonic() - t0))
    finally:
        for t in attackers:
            t.join(30)
    print(f"acme {acme}; mallory {dict(mallory)}")
    assert [o for o, _ in acme] == ["ok"] * 5, (acme, dict(mallory))
    assert max(s for _, s in acme) < 4 * RUN_S + 0.5, (acme, dict(mallory))  # its turn, not mallory's line
    assert mallory["StatusCode.RESOURCE_EXHAUSTED (its share)"] > 0, dict(mallory)  # refused at the gateway
    assert not [o for o in mallory if o not in ("ok", "StatusCode.RESOURCE_EXHAUSTED (its share)",
                                                "StatusCode.RESOURCE_EXHAUSTED")], dict(mallory)
