"""Every shared cap has a per-tenant share: the model mesh's lazy loads too (docs/security.md,
"Session 14: lazy loads by tenant").

A gateway in lazy mode loads a model no replica serves on its first request, at most
--max-concurrent-loads (default 4) loads at once; the others wait their turn. One tenant asking
for many cold models it may use, each slow to load, held every load slot, and another tenant's
first request for its own cold model waited until the flood's loads had ended.

Here (a python service whose models take LOAD_S to initialize, a gateway with --tenants in lazy
mode, the harness's good client on add_sub from an onnx service beside it): mallory asks for six
cold models at once. Now at most max(1, 4 x 0.5) = 2 of its loads run at once, its four other
requests wait in its own line (each within its deadline; one that gives up there starts no load)
and are all served as its loads end, and acme's own cold model, with the real tritonclient,
starts loading at once: its initialize() begins before any of mallory's has ended. Before,
mallory's six loads took the four slots and the queue, and acme's load began only after four of
them had ended."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.adversarial.harness import (
    KEY,
    LIMIT_FLAGS,
    OTHER_KEY,
    Observation,
    one_service_mesh,
    tenant,
    under_attack,
)
from tests.conftest import Proc, start
from tests.models import python_models
from tests.support.metrics import sample, scrape
from tests.support.waiting import eventually

LOAD_S = 3.0
FLOOD = 6  # mallory's cold models, all asked for at once
MAX_LOADS = 4

# initialize() notes when it began and when it ended (time.time(), one clock for every process)
# in <repository>/.<model>.init, beside the model directories (not a change of the model's files)
SLOW_LOAD = f'''
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

HERE = Path(__file__).resolve().parent.parent


def _note(what):
    with open(HERE.parent / f".{{HERE.name}}.init", "a") as f:
        f.write(f"{{what}} {{time.time()}}\\n")


class TritonPythonModel:
    def initialize(self, args):
        _note("start")
        time.sleep({LOAD_S})
        _note("end")

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(
            r, "X").as_numpy())]) for r in requests]
'''

COLD = [f"cold_{i}" for i in range(FLOOD)]
LATE = "cold_late"  # mallory's request for it gives up while it waits in mallory's line
OWN = "acme_cold"
TENANTS = ("\ntenants:\n" + tenant("acme", KEY, ["add_sub", OWN]) + tenant("mallory", OTHER_KEY, ["add_sub", "cold_*"]))


def _repository(root: Path) -> Path:
    repo = root / "lazy"
    for name in [*COLD, LATE, OWN]:
        python_models.write(repo, name, SLOW_LOAD, python_models.config(
            name, [("X", "TYPE_FP32", "4")], [("Y", "TYPE_FP32", "4")],
            extra="instance_group [ { count: 1 kind: KIND_CPU } ]\n"))
    return repo


def _init(repo: Path, name: str) -> dict[str, float]:
    """When ``name``'s initialize() began and ended ({} before it began)."""
    path = repo / f".{name}.init"
    if not path.exists():
        return {}
    return {what: float(t) for what, t in (ln.split() for ln in path.read_text().splitlines() if ln.strip())}


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals running at one moment (an end before a start at a tie)."""
    running = most = 0
    for _, step in sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals]):
        running += step
        most = max(most, running)
    return most


def _infer(url: str, key: str, model: str, timeout: float = 60) -> str:
    """One request with the real tritonclient: "ok" (its input echoed) or the error."""
    x = np.arange(4, dtype=np.float32).reshape(4)
    with grpcclient.InferenceServerClient(url) as c:
        inp = grpcclient.InferInput("X", [4], "FP32")
        inp.set_data_from_numpy(x)
        try:
            res = c.infer(model, [inp], headers={"x-api-key": key}, client_timeout=timeout)
        except InferenceServerException as exc:
            return f"{exc.status()}: {exc.message()}"
    return "ok" if np.array_equal(res.as_numpy("Y"), x) else "wrong"


def test_one_tenants_cold_models_hold_only_its_share_of_the_load_slots(model_repo: Path, tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    python = start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                    "--model-control-mode", "explicit", *LIMIT_FLAGS], timeout=180)

    def gateway_argv(service: Proc, tenants: Path) -> list[str]:
        tenants.write_text(TENANTS)  # acme may use its cold model, mallory the six others
        return ["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tenants),
                "--upstream", service.grpc, "--upstream", python.grpc, "--repository", str(repo),
                "--model-control-mode", "lazy", "--max-concurrent-loads", str(MAX_LOADS),
                "--discovery-interval", "1", *LIMIT_FLAGS]

    try:
        with one_service_mesh(model_repo, tmp_path, gateway_argv) as mesh:
            g = mesh.gateway
            mallory: dict[str, str] = {}
            seen: dict[str, str] = {}
            took: list[float] = []
            lock = threading.Lock()

            def flood(model: str) -> None:
                outcome = _infer(g.grpc, OTHER_KEY, model)
                with lock:
                    mallory[model] = outcome

            def attack() -> Observation:
                threads = [threading.Thread(target=flood, args=(m,)) for m in COLD]
                for t in threads:
                    t.start()

                def flood_settled() -> bool:
                    """Each of mallory's requests answered or waiting for its model's load."""
                    with lock:
                        answered = len(mallory)
                    waiting = sample(scrape(g.http), "meshserve_gateway_cold_waiting_requests")
                    return answered + waiting == FLOOD

                eventually(flood_settled, 60, "mallory's six requests answered or waiting", interval=0.1)
                eventually(lambda: any(_init(repo, m) for m in COLD), 60, "mallory's loads under way", interval=0.1)
                # one more of mallory's, while its loads run and its line is full, gives up after 1 s
                late = threading.Thread(target=lambda: seen.__setitem__("late", _infer(g.grpc, OTHER_KEY, LATE, 1.0)))
                late.start()
                t0 = time.monotonic()
                seen["acme"] = _infer(g.grpc, KEY, OWN)
                took.append(time.monotonic() - t0)
                seen["acme_again"] = _infer(g.grpc, KEY, OWN)  # served: loaded now
                for t in [late, *threads]:
                    t.join(120)
                return Observation(f"mallory: {sorted(mallory.items())}, late: {seen.get('late')}", True)

            verdict = under_attack(mesh, g, "lazy loads of one tenant's cold models", attack).judge(
                expect_refusal=False)
            print(verdict.summary(), f"acme waited {took[0]:.2f} s")
            assert seen["acme"] == "ok" and seen["acme_again"] == "ok", seen
            own = _init(repo, OWN)
            started = {m: _init(repo, m) for m in COLD}
            # acme's load did not wait for any of mallory's to end: a slot of its own was free
            first_end = min(t["end"] for t in started.values() if "end" in t)
            assert own["start"] < first_end, (
                f"acme's load began {own['start'] - first_end:.2f} s after mallory's first load ended "
                f"(it waited {took[0]:.2f} s for its model): mallory held the load slots; {started}")
            # mallory: every request served, its loads never more than its share at once
            assert mallory == {m: "ok" for m in COLD}, mallory
            most = _most_at_once([(t["start"], t["end"]) for t in started.values()])
            assert most == 2, f"{most} of mallory's loads ran at once (its share: 2): {started}"
            # the request that gave up in the line ended once, and no load was started for it
            assert seen.get("late", "").startswith("StatusCode.DEADLINE_EXCEEDED"), seen
            assert _init(repo, LATE) == {}
            waits = sample(scrape(g.http), "meshserve_gateway_lazy_load_share_waits_total", tenant="mallory")
            assert waits >= FLOOD - 2
            verdict.check()
            # the share is given back when the loads end: mallory's next cold model loads
            assert _infer(g.grpc, OTHER_KEY, LATE) == "ok"
            with httpclient.InferenceServerClient(g.http) as c:
                assert c.is_model_ready(OWN, headers={"x-api-key": KEY})
    finally:
        python.stop()
