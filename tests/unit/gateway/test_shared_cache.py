"""gateway/shared_cache.py: the local cache that --workers share, as two mappings of one file
(two workers): an answer kept by one is a hit in the other, invalidation and a changed config
are misses, the byte bound and the per-entry cap hold, and the counts are one table."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.cache import ENTRY_OVERHEAD, ENTRY_SHARE
from gateway.shared_cache import MIN_SIZE, WORKER_SLOTS, SharedCache
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc

SIZE = 1 << 20


def _pair(tmp_path: Path) -> tuple[SharedCache, SharedCache]:
    path = str(tmp_path / "response-cache")
    return SharedCache(path, SIZE, 0), SharedCache(path, SIZE, 1)


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def test_one_workers_answer_is_the_others_hit(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    config = mc.ModelConfig(name="m")
    assert b.get(_key(1), config, "m") is None
    assert a.put(_key(1), "m", b"answer", config, a.generation("m"))
    assert b.get(_key(1), mc.ModelConfig(name="m"), "m") == b"answer"  # an equal config (its own copy)
    assert os.path.getsize(tmp_path / "response-cache") == SIZE


def test_invalidation_and_a_changed_config_are_misses(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    config = mc.ModelConfig(name="m")
    generation = a.generation("m")
    a.put(_key(1), "m", b"x", config, generation)
    b.invalidate("m")
    assert a.get(_key(1), config, "m") is None
    assert not a.put(_key(2), "m", b"late", config, generation)  # asked before the reload: not kept
    a.put(_key(3), "m", b"y", config, a.generation("m"))
    assert b.get(_key(3), mc.ModelConfig(name="m", max_batch_size=4), "m") is None


def test_the_byte_bound_and_the_entry_cap(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    config = mc.ModelConfig(name="m")
    assert not a.put(_key(0), "m", bytes(SIZE // ENTRY_SHARE - 16 - ENTRY_OVERHEAD + 1), config, 0)
    answer = bytes(range(256)) * 16  # 4 KiB
    for i in range(1, 2000):  # ~8 MiB through a 1 MiB cache
        assert a.put(_key(i), "m", answer, config, 0)
        assert a.used <= a.ring < SIZE
    assert b.get(_key(1), config, "m") is None  # overwritten long ago
    assert b.get(_key(1999), config, "m") == answer
    kept = sum(b.get(_key(i), config, "m") == answer for i in range(1, 2000))
    assert 100 <= kept <= a.ring // len(answer)


def test_a_used_entry_outlives_the_fifo_order(tmp_path: Path) -> None:
    a, _ = _pair(tmp_path)
    config = mc.ModelConfig(name="m")
    answer = bytes(4096)
    a.put(_key(1), "m", answer, config, 0)
    for i in range(2, 2000):
        a.put(_key(i), "m", answer, config, 0)
        assert a.get(_key(1), config, "m") == answer  # used all along: kept


def test_the_counts_are_one_table(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    a.counts.hit(("m", "1"), 1000)
    b.counts.hit(("m", "1"), 3000)
    b.counts.miss(("m", "1"), 500)
    for cache in (a, b):
        stats = pb.ModelStatistics(name="m", version="1")
        cache.counts.add_to(stats)
        assert (stats.inference_stats.cache_hit.count, stats.inference_stats.cache_miss.count) == (2, 1)
        assert stats.inference_stats.cache_hit.ns == 4000
        samples = {(name, labels["model"]): value for name, labels, value in cache.counts.samples()}
        assert samples[("cache_hits", "m")] == 2 and samples[("cache_misses", "m")] == 1


def test_too_small_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least"):
        SharedCache(str(tmp_path / "c"), MIN_SIZE - 1)
    with pytest.raises(ValueError, match="at most"):
        SharedCache(str(tmp_path / "c"), MIN_SIZE, WORKER_SLOTS)
