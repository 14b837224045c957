"""Every shared cap has a per-tenant share: a sequence model's slots too.

A stateful model's service holds at most so many live sequences at once (the direct strategy:
`max_batch_size` x instances slots; oldest: `max_candidate_sequences`, or `max(1, max_batch_size)`, x instances); a new sequence beyond
them waits in the backlog until a live one ends or idles past `max_sequence_idle_microseconds`.
A tenant's share of the gateway's bound sequences (32,768) is far more: its sequences, started and
kept alive, held every slot, and another tenant's new sequence waited without end.

Here `seq_ctl` (direct, 4 slots, 5 s idle): mallory starts four sequences and leaves them open;
acme, with the real tritonclient, starts its own. Now mallory holds at most its share of the
slots, max(1, 4 x 0.5) = 2 (its other starts are refused at the gateway, 429 /
RESOURCE_EXHAUSTED naming the share), and acme's sequence runs at once. Before: acme's first
request waited in the backlog past its 3 s timeout.

With two replicas (session 14) the sequences are pinned to replicas by their id, so mallory,
choosing ids that all pin to one replica, put its whole share of both replicas' slots (4 of 8)
on that one, and acme's new sequence pinned there waited past its timeout; now a tenant's new
sequence also takes at most its share of the replica its id is pinned to, max(1, 4 x 0.5) = 2
(gateway/auth.py:Admission._take_slot, gateway/core.py:GatewayCore.sequence_replica)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.routing.table import rendezvous_score
from tests.adversarial.harness import KEY, OTHER_KEY, tenant
from tests.conftest import service_and_gateway, start
from tests.support.metrics import scrape
from tests.support.waiting import eventually

TENANTS = "\ntenants:\n" + tenant("acme", KEY, ["seq_ctl"]) + tenant("mallory", OTHER_KEY, ["seq_ctl"])


def _step(client: grpcclient.InferenceServerClient, key: str, sequence: int, value: float, **flags: bool) -> str:
    inp = grpcclient.InferInput("INPUT", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[value]], np.float32))
    try:
        got = client.infer("seq_ctl", [inp], sequence_id=sequence, headers={"x-api-key": key}, client_timeout=3,
                           **flags).as_numpy("OUTPUT")
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"
    return str(float(got[0, 0]))


def test_one_tenants_sequences_hold_only_its_share_of_a_models_slots(tmp_path: Path) -> None:
    from tests.models.sequence import build

    repo = build(tmp_path / "models")
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    with service_and_gateway("sequence", ["--repository", str(repo)],
                             ["--tenants", str(tmp_path / "tenants.yaml")]) as (_, g):
        with grpcclient.InferenceServerClient(g.grpc) as c:
            mallory = [_step(c, OTHER_KEY, 100 + i, 1.0, sequence_start=True) for i in range(4)]
            acme = [_step(c, KEY, 7, 10.0, sequence_start=True), _step(c, KEY, 7, 5.0),
                    _step(c, KEY, 7, 1.0, sequence_end=True)]
            assert acme == ["10.0", "15.0", "16.0"], (acme, mallory)
            assert mallory[:2] == ["1.0", "1.0"], mallory
            for refused in mallory[2:]:
                assert refused.startswith("StatusCode.RESOURCE_EXHAUSTED"), mallory
                assert "tenant 'mallory' has 2 sequences of model 'seq_ctl' in progress" in refused, refused
            assert _step(c, OTHER_KEY, 100, 1.0, sequence_end=True) == "2.0"  # its own go on
            assert _step(c, OTHER_KEY, 102, 1.0, sequence_start=True) == "1.0"  # a slot of its share again


def test_one_tenants_sequences_hold_only_its_share_of_each_replicas_slots(tmp_path: Path) -> None:
    from tests.models.sequence import build

    repo = build(tmp_path / "models")
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    ports = ["--grpc-port", "0", "--http-port", "0"]
    services = [start(["service", "sequence", *ports, "--repository", str(repo)]) for _ in range(2)]
    try:
        g = start(["gateway", *ports, "--upstream", services[0].grpc, "--upstream", services[1].grpc,
                   "--tenants", str(tmp_path / "tenants.yaml")])
        try:
            def both_healthy() -> list[str] | None:
                healthy = [dict(labels)["replica"] for (name, labels), v in scrape(g.http).items()
                           if name == "meshserve_gateway_replica_healthy" and v == 1]
                return healthy if len(healthy) == 2 else None

            replicas = eventually(both_healthy, 30, "both replicas healthy at the gateway")

            def pinned_to(sequence: int) -> str:  # (gateway/routing/table.py:pick_pinned)
                return max(replicas, key=lambda r: rendezvous_score(f"i:{sequence}", r))

            crowded = pinned_to(100)
            ids = [i for i in range(100, 400) if pinned_to(i) == crowded]
            with grpcclient.InferenceServerClient(g.grpc) as c:
                mallory = [_step(c, OTHER_KEY, i, 1.0, sequence_start=True) for i in ids[:4]]
                acme = [_step(c, KEY, ids[4], 10.0, sequence_start=True), _step(c, KEY, ids[4], 5.0),
                        _step(c, KEY, ids[4], 1.0, sequence_end=True)]
                assert acme == ["10.0", "15.0", "16.0"], (acme, mallory)
                assert mallory[:2] == ["1.0", "1.0"], mallory
                for refused in mallory[2:]:
                    assert refused.startswith("StatusCode.RESOURCE_EXHAUSTED"), mallory
                    assert "tenant 'mallory' has 2 sequences of model 'seq_ctl' in progress on the replica" in refused
                other = next(i for i in range(400, 700) if pinned_to(i) != crowded)
                assert _step(c, OTHER_KEY, other, 1.0, sequence_start=True) == "1.0"  # its share of the other one
                assert _step(c, OTHER_KEY, ids[0], 1.0, sequence_end=True) == "2.0"  # its own go on
                assert _step(c, OTHER_KEY, ids[2], 1.0, sequence_start=True) == "1.0"  # a slot of its share again
        finally:
            g.stop()
    finally:
        for service in services:
            service.stop()
