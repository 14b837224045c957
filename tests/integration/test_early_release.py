"""Early release through a real ONNX service and the real tritonclient: N closed-loop clients
(each waits for its answer before sending again) against a long max_queue_delay. With early release
(the default) a round runs as soon as its N requests are queued; switched off in the model's config
(parameters meshserve_early_release "false") every round waits the delay, as in Triton. Proven
with the statistics extension (queue time per request, executions) and /metrics: counts and
ratios with wide margins, no wall-clock limits."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import Proc, start
from tests.support import models
from tests.support.metrics import metric

N = 4  # closed-loop clients
DELAY_NS = 200_000_000  # max_queue_delay: long, so that a wait shows in the queue time


def config(name: str, early: str | None) -> str:
    extra = f"dynamic_batching {{ max_queue_delay_microseconds: {DELAY_NS // 1000} }}\n" \
            "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    if early is not None:
        extra += f'parameters {{ key: "meshserve_early_release" value: {{ string_value: "{early}" }} }}\n'
    return models.pair_config(name, "onnxruntime_onnx", 16, max_batch_size=16, extra=extra)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo: Path = tmp_path_factory.mktemp("early")
    from onnx import TensorProto

    for name, early in (("early_on", None), ("early_off", "false"), ("early_bad", "sometimes")):
        models.write(repo, name, config(name, early), {1: models.add_sub(TensorProto.FLOAT)})
    proc = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"])
    yield proc
    proc.stop()


def stats(proc: Proc, model: str) -> dict:
    with httpclient.InferenceServerClient(proc.http) as c:
        return c.get_inference_statistics(model)["model_stats"][0]


def closed_loop(proc: Proc, model: str, rounds: int) -> None:
    """N clients, each sending ``rounds`` requests one after another (answer, then the next)."""
    start_together = threading.Barrier(N)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with grpcclient.InferenceServerClient(proc.grpc) as c:
                a = np.full((1, 16), float(i), np.float32)
                inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
                for inp in inputs:
                    inp.set_data_from_numpy(a)
                start_together.wait(30)
                for _ in range(rounds):
                    out = c.infer(model, inputs, client_timeout=30)
                    assert (out.as_numpy("OUTPUT0") == 2 * a).all()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def run(proc: Proc, model: str, rounds: int) -> tuple[int, int, float, float]:
    """(inferences, executions, queue ns per request, early releases) of ``rounds`` closed-loop rounds."""
    early0 = metric(proc.http, "meshserve_batch_early_release_total", model=model)
    before = stats(proc, model)
    closed_loop(proc, model, rounds)
    after = stats(proc, model)
    early = metric(proc.http, "meshserve_batch_early_release_total", model=model) - early0
    queue = {k: int(after["inference_stats"]["queue"][k]) - int(before["inference_stats"]["queue"].get(k, 0))
             for k in ("count", "ns")}
    return (after["inference_count"] - before["inference_count"],
            after["execution_count"] - before["execution_count"], queue["ns"] / queue["count"], early)


def test_closed_loop_rounds_run_without_waiting_the_delay(service: Proc) -> None:
    rounds = 30
    inferences, executions, queue_ns, early = run(service, "early_on", rounds)
    assert inferences == N * rounds
    # every round is one batch of all N (the first waited the delay: it taught the batcher N);
    # a round split only if a client were a whole delay late
    assert executions <= rounds + rounds // 3, executions
    assert queue_ns < DELAY_NS / 4, queue_ns  # ~1/30 of the delay: only the first round waited it
    assert early >= rounds // 2, early


def test_switched_off_in_the_config_every_round_waits_the_delay(service: Proc) -> None:
    rounds = 4
    inferences, executions, queue_ns, early = run(service, "early_off", rounds)
    assert inferences == N * rounds
    assert executions <= rounds + 1, executions  # the rounds still batch: all N within one delay
    assert queue_ns > DELAY_NS / 2, queue_ns  # Triton's wait: from the oldest request, all N wait ~the delay
    assert early == 0


def test_a_bad_switch_value_fails_the_model_load_with_its_reason(service: Proc) -> None:
    with httpclient.InferenceServerClient(service.http) as c:
        index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["early_bad"]["state"] == "UNAVAILABLE"
    assert "meshserve_early_release" in index["early_bad"]["reason"]
    assert "sometimes" in index["early_bad"]["reason"]
    assert index["early_on"]["state"] == "READY" and index["early_off"]["state"] == "READY"
