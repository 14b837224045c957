"""Every shared cap has a per-tenant share: the ensemble step slots too.

The gateway runs ensembles itself and bounds their step calls in flight, all ensembles and all
tenants together, by --ensemble-max-inflight-steps (default 256); a step beyond it waits for a
slot. A tenant holds its share of --max-inflight (64 requests at the defaults), and an ensemble
with parallel steps takes a slot per step, so one tenant's slow ensemble requests could hold every
slot (64 x 4 parallel steps at the defaults) and every other tenant's ensemble requests waited,
admitted, for them.

Here (a stand-in service whose models sleep 2 s, an ensemble of two parallel steps,
--max-inflight 8 and --ensemble-max-inflight-steps 8): mallory's four requests (its share of the
in-flight cap) want eight step slots. Now they hold at most max(1, 8 x 0.5) = 4 (the others wait
in mallory's own line) and acme's request, with the real tritonclient, runs at once: one delay.
Before, mallory's steps held all eight and acme's request took two delays."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import KEY, OTHER_KEY, tenant
from tests.conftest import _wait_http_ready, start
from tests.support import models
from tests.support.waiting import eventually

DELAY_S = 2.0
PARALLEL = models.ensemble_config("parallel", {"X": 4}, {"A": 4, "B": 4}, [
    models.step("sleep_a", {"IN": "X"}, {"OUT": "A"}), models.step("sleep_b", {"IN": "X"}, {"OUT": "B"})])
TENANTS = ("\ntenants:\n" + tenant("acme", KEY, ["parallel"]) + tenant("mallory", OTHER_KEY, ["parallel"]))


def _parallel(url: str, key: str) -> str:
    """One request for the ensemble: "ok" (both steps' outputs its input) or the error."""
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    with grpcclient.InferenceServerClient(url) as c:
        inp = grpcclient.InferInput("X", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        try:
            res = c.infer("parallel", [inp], headers={"x-api-key": key}, client_timeout=30)
        except InferenceServerException as exc:
            return f"{exc.status()}: {exc.message()}"
    return "ok" if np.array_equal(res.as_numpy("A"), x) and np.array_equal(res.as_numpy("B"), x) else "wrong"


def test_one_tenants_ensemble_steps_hold_only_its_share_of_the_step_slots(tmp_path: Path) -> None:
    (tmp_path / "repo" / "parallel" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "parallel" / "config.pbtxt").write_text(PARALLEL)
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    slow = start(["--grpc-port", "0", "--http-port", "0", "--delay-ms", str(DELAY_S * 1000)],
                 module="tests.integration.slow_service")
    try:
        g = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tmp_path / "tenants.yaml"),
                   "--upstream", slow.grpc, "--repository", str(tmp_path / "repo"), "--max-inflight", "8",
                   "--ensemble-max-inflight-steps", "8", "--coalesce-inflight", "0"])
    except Exception:
        slow.stop()
        raise
    mallory: list[str] = []
    lock = threading.Lock()

    def attack() -> None:
        outcome = _parallel(g.grpc, OTHER_KEY)
        with lock:
            mallory.append(outcome)

    attackers: list[threading.Thread] = []
    try:
        _wait_http_ready(g.http)

        def share_full() -> bool:
            """mallory's requests until one is refused for its share: then it holds 4 in flight."""
            with lock:
                if any("tenant 'mallory' has 4 inference requests in flight" in o for o in mallory):
                    return True
            attackers.append(threading.Thread(target=attack))
            attackers[-1].start()
            return False

        eventually(share_full, 20, "mallory's share of --max-inflight held", interval=0.1)
        t0 = time.monotonic()
        acme = _parallel(g.grpc, KEY)
        took = time.monotonic() - t0
        for t in attackers:
            t.join(60)
        assert acme == "ok", acme
        assert took < 1.5 * DELAY_S, f"acme's ensemble request took {took:.2f} s: it waited for mallory's steps"
        assert mallory.count("ok") == 4, mallory  # its 4 admitted requests all answered, in two delays
        assert all(o == "ok" or o.startswith("StatusCode.RESOURCE_EXHAUSTED") for o in mallory), mallory
    finally:
        g.stop()
        slow.stop()
