"""The model mesh's placement arithmetic (gateway/routing/placement.py) and the figures the
gateway reads from a replica's exposition (gateway/placement.py:ReplicaFacts)."""
from __future__ import annotations

from collections import Counter

from gateway.placement import ReplicaFacts, evicted
from gateway.routing.placement import Demand, pick_copies, rank, wanted_copies
from meshserve.protocol.errors import InferError, model_not_found

REPLICAS = {f"10.0.0.{i}:9001": 1.0 for i in range(1, 4)}


def test_rank_is_the_same_in_every_process_and_order() -> None:
    """Two gateways (any dict order) rank the replicas alike for every model."""
    reversed_weights = dict(reversed(list(REPLICAS.items())))
    for i in range(200):
        assert rank(f"m{i}", REPLICAS) == rank(f"m{i}", reversed_weights)


def test_rank_spreads_by_weight() -> None:
    firsts = Counter(rank(f"m{i}", REPLICAS)[0] for i in range(3000))
    assert all(800 < n < 1200 for n in firsts.values()), firsts
    heavy = {**REPLICAS, "10.0.0.1:9001": 2.0}
    firsts = Counter(rank(f"m{i}", heavy)[0] for i in range(3000))
    assert 1300 < firsts["10.0.0.1:9001"] < 1700, firsts  # twice the weight: about half of them


def test_removing_a_replica_moves_only_its_models() -> None:
    before = {f"m{i}": rank(f"m{i}", REPLICAS)[0] for i in range(500)}
    gone = "10.0.0.2:9001"
    after = {k: rank(k, {e: w for e, w in REPLICAS.items() if e != gone})[0] for k in before}
    assert all(after[k] == first for k, first in before.items() if first != gone)


def test_wanted_copies() -> None:
    busy = Demand(copies=1, pending=20.0, busy_rounds=3)
    assert wanted_copies(busy, 1, 3, 8.0, 3, 300.0, now=0.0) == 2
    assert wanted_copies(Demand(1, 20.0, busy_rounds=2), 1, 3, 8.0, 3, 300.0, now=0.0) == 1  # not long enough
    assert wanted_copies(busy, 1, 1, 8.0, 3, 300.0, now=0.0) == 1  # no replica more
    assert wanted_copies(busy, 1, 3, 0.0, 3, 300.0, now=0.0) == 1  # growth off
    idle = Demand(copies=3, pending=0.0, idle_since=100.0)
    assert wanted_copies(idle, 1, 3, 8.0, 3, 300.0, now=399.0) == 3
    assert wanted_copies(idle, 1, 3, 8.0, 3, 300.0, now=400.0) == 2
    assert wanted_copies(Demand(2, 0.0, idle_since=0.0), 2, 3, 8.0, 3, 300.0, now=1e6) == 2  # never under min
    assert wanted_copies(Demand(1, 0.0), 2, 3, 8.0, 3, 300.0, now=0.0) == 2  # min copies


def test_pick_copies_adds_best_and_drops_worst() -> None:
    order = ["a", "b", "c"]
    assert pick_copies(order, ["c"], 2) == (["a"], [])
    assert pick_copies(order, ["a", "b", "c"], 1) == ([], ["b", "c"])
    assert pick_copies(order, ["b"], 1) == ([], [])


def test_replica_facts_from_an_exposition() -> None:
    text = "\n".join([
        "# HELP meshserve_memory_budget_bytes x", "# TYPE meshserve_memory_budget_bytes gauge",
        "meshserve_memory_budget_bytes 1000", "meshserve_memory_used_bytes 250", "meshserve_memory_base_bytes 90",
        'meshserve_model_memory_bytes{model="a",version="1"} 100',
        'meshserve_model_memory_bytes{model="a",version="2"} 50',
        'nv_inference_pending_request_count{model="a",version="1"} 3',
        'nv_inference_request_success{model="a",version="1"} 7',
        'nv_inference_request_failure{model="a",reason="REJECTED",version="1"} 1',
        'meshserve_model_evictions_total{model="b"} 2', 'meshserve_model_loads_total{model="b"} 4',
        'nv_inference_count{model="a",version="1"} 99', "garbage line {", ""])
    facts = ReplicaFacts.parse(text)
    assert (facts.budget, facts.used, facts.base) == (1000.0, 250.0, 90.0)
    assert facts.sizes == {"a": 150.0} and facts.pending == {"a": 3.0} and facts.served == {"a": 8.0}
    assert (facts.loads, facts.evictions) == (4.0, 2.0)
    assert ReplicaFacts.parse("").budget is None


def test_evicted_is_only_the_services_unknown_model() -> None:
    assert evicted(model_not_found("m"))
    assert not evicted(InferError.not_found("failed to load 'm', failed to poll from model repository"))
    assert not evicted(InferError.unavailable("Request for unknown model"))
