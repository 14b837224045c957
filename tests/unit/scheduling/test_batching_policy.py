"""BatchingPolicy: built from Triton's ModelDynamicBatching message, validated."""
from __future__ import annotations

import pytest

from meshserve._proto import model_config_pb2 as mc
from services.base.scheduling import BatchingPolicy


def test_no_dynamic_batching_runs_each_request_alone() -> None:
    p = BatchingPolicy.from_config(8, None)
    assert not p.batching
    assert p.max_batch_size == 0
    assert p.max_queue_size == 0


def test_from_config_reads_every_field() -> None:
    db = mc.ModelDynamicBatching(preferred_batch_size=[8, 2, 4, 4], max_queue_delay_microseconds=250,
                                 preserve_ordering=True)
    db.default_queue_policy.max_queue_size = 100
    p = BatchingPolicy.from_config(16, db)
    assert p == BatchingPolicy(max_batch_size=16, preferred_batch_sizes=(2, 4, 8),
                               max_queue_delay_ns=250_000, max_queue_size=100, preserve_ordering=True)
    assert p.batching
    assert p.max_preferred == 8


def test_empty_dynamic_batching_block_uses_defaults() -> None:
    p = BatchingPolicy.from_config(4, mc.ModelDynamicBatching())
    assert p == BatchingPolicy(max_batch_size=4)
    assert p.max_preferred == 4  # Triton normalises no preferred sizes to [max_batch_size]


def test_dynamic_batching_without_batch_dimension_keeps_the_queue_limit() -> None:
    db = mc.ModelDynamicBatching(preserve_ordering=True)
    db.default_queue_policy.max_queue_size = 3
    p = BatchingPolicy.from_config(0, db)
    assert not p.batching
    assert p.max_queue_size == 3
    assert p.preserve_ordering


def test_preferred_size_above_max_batch_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="preferred_batch_size 16 .* max_batch_size 8"):
        BatchingPolicy.from_config(8, mc.ModelDynamicBatching(preferred_batch_size=[4, 16]))


@pytest.mark.parametrize("kwargs", [
    {"max_batch_size": -1},
    {"max_batch_size": 4, "max_queue_delay_ns": -1},
    {"max_batch_size": 4, "max_queue_size": -1},
    {"max_batch_size": 0, "preferred_batch_sizes": (1,)},
    {"max_batch_size": 4, "preferred_batch_sizes": (0,)},
])
def test_invalid_values_are_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        BatchingPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_is_immutable() -> None:
    p = BatchingPolicy(max_batch_size=4)
    with pytest.raises(AttributeError):
        p.max_batch_size = 8  # type: ignore[misc]
