"""Sequence pinning: rendezvous hashing over healthy replicas, keys from request parameters."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from gateway.routing.table import pick_pinned, rendezvous_score, sequence_affinity
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.protocol.errors import Code, InferError
from meshserve.protocol.infer_checks import SEQUENCE_ID_MAX


@dataclass
class R:
    endpoint: str
    outstanding: int = 0
    healthy: bool = True


def params(**kw: object) -> dict[str, pb.InferParameter]:
    req = pb.ModelInferRequest()
    for name, (field, value) in kw.items():  # type: ignore[misc]
        setattr(req.parameters[name], field, value)
    return dict(req.parameters)


def test_sequence_affinity_accepts_every_integer_member_and_strings() -> None:
    assert sequence_affinity(params(sequence_id=("int64_param", 42))) == "i:42"
    assert sequence_affinity(params(sequence_id=("uint64_param", 42))) == "i:42"
    assert sequence_affinity(params(sequence_id=("double_param", 42.0))) == "i:42"
    assert sequence_affinity(params(sequence_id=("int64_param", -1))) == f"i:{2**64 - 1}"
    assert sequence_affinity(params(sequence_id=("uint64_param", 2**64 - 1))) == f"i:{2**64 - 1}"
    assert sequence_affinity(params(sequence_id=("string_param", "42"))) == "s:42"
    assert sequence_affinity(params(sequence_id=("int64_param", 0))) is None
    assert sequence_affinity(params(sequence_id=("string_param", ""))) is None
    assert sequence_affinity(params(priority=("uint64_param", 1))) is None
    assert sequence_affinity({}) is None


def test_a_string_id_past_its_bound_is_refused() -> None:
    """The gateway keeps a sequence's key while it lives (its turns, a tenant's binding): a string
    id is at most SEQUENCE_ID_MAX characters (meshserve/protocol/infer_checks.py)."""
    longest = "x" * SEQUENCE_ID_MAX
    assert sequence_affinity(params(sequence_id=("string_param", longest))) == f"s:{longest}"
    with pytest.raises(InferError) as err:
        sequence_affinity(params(sequence_id=("string_param", longest + "y")))
    assert err.value.code is Code.INVALID_ARG
    assert err.value.message == (f"a string sequence_id may have at most {SEQUENCE_ID_MAX} characters, "
                                 f"this one has {SEQUENCE_ID_MAX + 1}")


def test_pinned_choice_is_deterministic_and_spreads() -> None:
    replicas = [R(f"10.0.0.{i}:8101") for i in range(4)]
    keys = [f"i:{n}" for n in range(2000)]
    first = [pick_pinned(replicas, k).endpoint for k in keys]
    assert first == [pick_pinned(list(reversed(replicas)), k).endpoint for k in keys], "order independent"
    counts = Counter(first)
    assert len(counts) == 4 and min(counts.values()) > 350  # ~500 each


def test_removing_a_replica_moves_only_its_sequences() -> None:
    replicas = [R(f"svc-{i}:8101") for i in range(5)]
    keys = [f"s:user-{n}" for n in range(1000)]
    before = {k: pick_pinned(replicas, k).endpoint for k in keys}
    gone = replicas[2].endpoint
    after = {k: pick_pinned([r for r in replicas if r.endpoint != gone], k).endpoint for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)


def test_score_is_stable_across_processes() -> None:
    # blake2b, not hash(): every gateway replica (and every restart) pins the same way.
    assert rendezvous_score("i:1", "a:1") == rendezvous_score("i:1", "a:1")
    assert rendezvous_score("i:1", "a:1") == int.from_bytes(
        __import__("hashlib").blake2b(b"i:1\x00a:1", digest_size=8).digest(), "big")


def test_pick_pinned_needs_a_replica() -> None:
    with pytest.raises(ValueError):
        pick_pinned([], "i:1")
