"""The local response cache shared by ``meshserve gateway --workers N`` (``--cache-config local``).

One file of exactly ``size`` bytes in the workers' directory (meshserve/server/workers.py:
SharedState), mapped by every worker, changed under one flock. Why this and not one worker
owning the store behind a unix socket, or requiring Redis: a hit stays a memory lookup in the
answering process (measured in docs/perf/response-cache.md: no system call and one copy of the
answer, where a socket round trip to an owner would cost that owner's event loop a request of
its own per hit, and Redis a network round trip); a worker that dies holding the lock releases
it (flock is the kernel's); a restarted worker maps the same entries again.

Layout (all little-endian): a header, the per-model generations, the counts table, the index,
then the data ring.

- **Data ring** (what is left of ``size``): answers are appended at ``head``, a monotonic byte
  position (the file offset is ``head % ring``); an answer never straddles the end (the rest of
  the ring is skipped). Appending moves ``tail`` up to ``head - ring``: every answer at a
  position below ``tail`` is gone, so eviction is one store and an entry is valid while its
  position is >= ``tail`` (FIFO within the byte budget; a hit on an answer less than a quarter
  of the ring from being overwritten appends it again, so what is used stays: about LRU).
- **Index**: buckets of ``WAYS`` slots (key 16 | position 8 | length 4 | generation 4 |
  config 8); a key lives in bucket ``key % buckets``; a full bucket gives up its oldest slot.
  One slot per ``BYTES_PER_SLOT`` bytes of ``size``.
- **Generations**: ``GENERATIONS`` counters, a model's is ``hash(model) % GENERATIONS``; a
  reload or unload through any worker bumps it (two models sharing a counter drop each other's
  answers: a miss, never a wrong answer). An entry also keeps its config's fingerprint: a
  service's reload that the gateway did not drive is a miss too.
- **Counts**: ``COUNT_ROWS`` named rows of (hits, misses, hit ns, miss ns) per worker index
  (``SharedCounts``): the statistics and ``nv_cache_*`` read the sums, the same totals
  whichever worker answers.

A lookup takes no lock on x86-64 (``LOCK_FREE_READS``: a sequence lock); a hit counts into the
worker's own counters, without a lock; storing an answer, invalidating and claiming a count row
take the lock.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import platform
import struct
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.cache import ENTRY_OVERHEAD, ENTRY_SHARE, CacheCounts
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.telemetry import metrics

MAGIC = 0x4D53_4341_4348_4531  # "MSCACHE1"
HEADER = 64  # magic, size, buckets, ring, head, tail, write sequence
GENERATIONS = 1024
WAYS = 8
SLOT = 40
_SLOT = struct.Struct("<16sQII8s")
BYTES_PER_SLOT = 512  # the index is SLOT / BYTES_PER_SLOT (~8%) of size
COUNT_ROWS = 128
NAME_BYTES = 224
WORKER_SLOTS = 16  # counters per worker index: --workers above this with a local cache is refused
_COUNTS = struct.Struct("<QQQQ")  # hits, misses, hit ns, miss ns
MIN_SIZE = 1 << 20
KEPT = 1024  # config fingerprints and model generation offsets remembered per process
_HEAD_AT, _SEQ_AT = 32, 48
_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_HEAD_TAIL = struct.Struct("<QQ")
# Lookups read without the lock (a sequence lock: a writer makes the sequence odd, writes, makes
# it even again; a reader that saw it change reads again) where stores are seen in program order
# by other cores (x86-64's TSO); elsewhere they take the lock.
LOCK_FREE_READS = platform.machine() in ("x86_64", "AMD64")


def _layout(size: int) -> tuple[int, int, int, int, int, int]:
    """(buckets, generations at, names at, counters at, index at, ring at) for ``size`` bytes."""
    buckets = max(16, size // BYTES_PER_SLOT // WAYS)
    generations = HEADER
    names = generations + GENERATIONS * 4
    counters = names + COUNT_ROWS * NAME_BYTES
    index = counters + WORKER_SLOTS * COUNT_ROWS * _COUNTS.size
    ring = index + buckets * WAYS * SLOT
    return buckets, generations, names, counters, index, ring


class SharedCache:
    """``LocalCache``'s interface (get / put / generation / invalidate) over the shared file;
    ``counts``: the shared hit and miss counts (``worker``: this process's row of counters)."""

    def __init__(self, path: str, size: int, worker: int = 0):
        if size < MIN_SIZE:
            raise ValueError(f"local cache: with --workers the size must be at least {MIN_SIZE} bytes, got {size}")
        if not 0 <= worker < WORKER_SLOTS:
            raise ValueError(f"local cache: at most {WORKER_SLOTS} workers share one")
        self.size = size
        self.max_entry = size // ENTRY_SHARE
        self.buckets, self._gens, self._names, self._counters, self._index, self._ring = _layout(size)
        self.ring = size - self._ring
        self._lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with self.locked():
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fresh = os.fstat(fd).st_size == 0
                if fresh:
                    os.ftruncate(fd, size)
                elif os.fstat(fd).st_size != size:
                    raise ValueError(f"{path}: a cache of another size is there")
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            if fresh:
                struct.pack_into("<QQQQ", self.mm, 0, MAGIC, size, self.buckets, self.ring)
        self._fingerprints: dict[int, tuple[mc.ModelConfig, bytes]] = {}
        self._gen_offsets: dict[str, int] = {}
        self.counts = SharedCounts(self, worker)

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """The lock, and the sequence odd while entries change (lock-free readers read again)."""
        mm = self.mm
        with self.locked():
            seq = _Q.unpack_from(mm, _SEQ_AT)[0] | 1
            _Q.pack_into(mm, _SEQ_AT, seq)
            try:
                yield
            finally:
                _Q.pack_into(mm, _SEQ_AT, seq + 1)

    def close(self) -> None:
        self.mm.close()
        os.close(self._lock_fd)

    # ---- entries ---------------------------------------------------------------------------
    def _fingerprint(self, config: mc.ModelConfig) -> bytes:
        """8 bytes naming the config (the same in every worker), worked out once per config."""
        known = self._fingerprints.get(id(config))
        if known is None or known[0] is not config:
            if len(self._fingerprints) >= KEPT:
                self._fingerprints.clear()
            digest = hashlib.blake2b(config.SerializeToString(deterministic=True), digest_size=8).digest()
            known = self._fingerprints[id(config)] = (config, digest)
        return known[1]

    def _gen_at(self, model: str) -> int:
        at = self._gen_offsets.get(model)
        if at is None:
            if len(self._gen_offsets) >= KEPT:
                self._gen_offsets.clear()
            digest = hashlib.blake2b(model.encode(), digest_size=4).digest()
            at = self._gen_offsets[model] = self._gens + 4 * (int.from_bytes(digest, "little") % GENERATIONS)
        return at

    def generation(self, model: str) -> int:
        value: int = _I.unpack_from(self.mm, self._gen_at(model))[0]
        return value

    def invalidate(self, model: str) -> None:
        at = self._gen_at(model)
        with self.writing():
            _I.pack_into(self.mm, at, (_I.unpack_from(self.mm, at)[0] + 1) & 0xFFFF_FFFF)

    def _bucket(self, key: bytes) -> int:
        return self._index + (int.from_bytes(key[:8], "little") % self.buckets) * WAYS * SLOT

    def _find(self, bucket: int, key: bytes) -> int:
        """The slot's offset holding ``key`` in ``bucket``, or -1."""
        slots = self.mm[bucket:bucket + WAYS * SLOT]  # (a copy: bytes.find is faster than mmap.find)
        at = slots.find(key)
        while at >= 0 and at % SLOT:
            at = slots.find(key, at + 1)
        return at if at < 0 else bucket + at

    def _lookup(self, key: bytes, fingerprint: bytes, gen_at: int) -> tuple[bytes | None, int]:
        """(the answer or None, how far behind the head it is: ``ring`` on, it is overwritten)."""
        mm = self.mm
        slot = self._find(self._bucket(key), key)
        if slot < 0:
            return None, 0
        _, pos, length, gen, cfg = _SLOT.unpack_from(mm, slot)
        head, tail = _HEAD_TAIL.unpack_from(mm, _HEAD_AT)
        if pos < tail or pos + length > head or length > self.max_entry or cfg != fingerprint \
                or gen != _I.unpack_from(mm, gen_at)[0]:
            return None, 0  # (a stale slot is reused by the next put of its bucket)
        start = self._ring + pos % self.ring
        return mm[start:start + length], head - pos

    def get(self, key: bytes, config: mc.ModelConfig, model: str) -> bytes | None:
        fingerprint, gen_at = self._fingerprint(config), self._gen_at(model)
        mm = self.mm
        answer: bytes | None = None
        for _ in range(4 if LOCK_FREE_READS else 0):
            seq = _Q.unpack_from(mm, _SEQ_AT)[0]
            if seq & 1:
                continue
            answer, age = self._lookup(key, fingerprint, gen_at)
            if _Q.unpack_from(mm, _SEQ_AT)[0] == seq:
                break
        else:  # (a writer kept changing entries, or no lock-free reads here)
            with self.locked():
                answer, age = self._lookup(key, fingerprint, gen_at)
        if answer is not None and age > self.ring - self.ring // 4:  # soon overwritten: keep what is used
            with self.writing():
                if self._lookup(key, fingerprint, gen_at)[0] is not None:
                    self._append(self._find(self._bucket(key), key), key, answer,
                                 _I.unpack_from(mm, gen_at)[0], fingerprint)
        return answer

    def put(self, key: bytes, model: str, answer: bytes, config: mc.ModelConfig, generation: int) -> bool:
        """Keep an answer (False: too large, or the model was invalidated since it was asked)."""
        if len(key) + len(answer) + ENTRY_OVERHEAD > self.max_entry:
            return False
        fingerprint = self._fingerprint(config)
        mm = self.mm
        with self.writing():
            if generation != _I.unpack_from(mm, self._gen_at(model))[0]:
                return False
            bucket = self._bucket(key)
            slot = self._find(bucket, key)
            if slot < 0:  # a free or evicted slot, else the oldest
                tail = _HEAD_TAIL.unpack_from(mm, _HEAD_AT)[1]
                slot, oldest = bucket, -1
                for at in range(bucket, bucket + WAYS * SLOT, SLOT):
                    pos = _Q.unpack_from(mm, at + 16)[0]
                    if pos < tail or not any(mm[at:at + 16]):
                        slot = at
                        break
                    if oldest < 0 or pos < oldest:
                        slot, oldest = at, pos
            self._append(slot, key, answer, generation, fingerprint)
        return True

    def _append(self, slot: int, key: bytes, answer: bytes, generation: int, fingerprint: bytes) -> None:
        """Write ``answer`` at the ring's head and point ``slot`` at it (inside ``writing``)."""
        mm, ring = self.mm, self.ring
        head, tail = _HEAD_TAIL.unpack_from(mm, _HEAD_AT)
        if head % ring + len(answer) > ring:  # never across the end
            head += ring - head % ring
        end = head + len(answer)
        tail = max(tail, end - ring)
        _HEAD_TAIL.pack_into(mm, _HEAD_AT, end, tail)  # (first: a reader sees the old bytes as gone)
        start = self._ring + head % ring
        mm[start:start + len(answer)] = answer
        _SLOT.pack_into(mm, slot, key, head, len(answer), generation, fingerprint)

    @property
    def used(self) -> int:
        """Bytes of the ring between the tail and the head (answers, skipped ends, stale copies)."""
        head, tail = _HEAD_TAIL.unpack_from(self.mm, _HEAD_AT)
        return int(head - tail)


class SharedCounts(CacheCounts):
    """``CacheCounts`` in the shared file: a (model, version) pair's row is claimed once, under
    the lock, in the names table; each worker adds to its own counters of that row (one writer
    each: no lock), and a read sums every worker's. A restarted worker goes on from its
    counters, so the totals never go backwards. Pairs beyond ``COUNT_ROWS`` (or with longer
    names) are counted by each worker alone."""

    def __init__(self, cache: SharedCache, worker: int):
        super().__init__()
        self.cache = cache
        self._mine = cache._counters + worker * COUNT_ROWS * _COUNTS.size
        self._rows: dict[tuple[str, str], int] = {}

    def _row(self, model: tuple[str, str]) -> int:
        """The pair's row number, or -1 (the table is full, or the name too long)."""
        row = self._rows.get(model)
        if row is not None:
            return row
        name = f"{model[0]}\0{model[1]}".encode()
        if len(name) > NAME_BYTES:
            return -1
        cache = self.cache
        mm, found = cache.mm, -1
        with cache.locked():
            for i in range(COUNT_ROWS):
                at = cache._names + i * NAME_BYTES
                stored = mm[at:at + NAME_BYTES].rstrip(b"\0")
                if stored == name:
                    found = i
                    break
                if not stored:
                    mm[at:at + len(name)] = name
                    found = i
                    break
        if found >= 0:
            self._rows[model] = found
        return found

    def _add(self, model: tuple[str, str], field: int, ns: int) -> bool:
        row = self._row(model)
        if row < 0:
            return False
        mm, at = self.cache.mm, self._mine + row * _COUNTS.size + field * 8
        _Q.pack_into(mm, at, _Q.unpack_from(mm, at)[0] + 1)
        _Q.pack_into(mm, at + 16, _Q.unpack_from(mm, at + 16)[0] + ns)
        return True

    def hit(self, model: tuple[str, str], ns: int) -> None:
        if not self._add(model, 0, ns):
            super().hit(model, ns)

    def miss(self, model: tuple[str, str], ns: int) -> None:
        if not self._add(model, 1, ns):
            super().miss(model, ns)

    def totals(self) -> CacheCounts:
        """Every worker's counts plus this worker's own overflow."""
        out = CacheCounts()
        cache = self.cache
        mm = cache.mm
        with cache.locked():  # (the names: a row being claimed is not read half written)
            names = [mm[at:at + NAME_BYTES].rstrip(b"\0")
                     for at in range(cache._names, cache._names + COUNT_ROWS * NAME_BYTES, NAME_BYTES)]
        for i, name in enumerate(names):
            if not name:
                break
            model, _, version = name.decode(errors="replace").partition("\0")
            key = (model, version)
            for w in range(WORKER_SLOTS):
                hits, misses, hit_ns, miss_ns = _COUNTS.unpack_from(
                    mm, cache._counters + (w * COUNT_ROWS + i) * _COUNTS.size)
                out.hits[key] += hits
                out.misses[key] += misses
                out.hit_ns[key] += hit_ns
                out.miss_ns[key] += miss_ns
        for key, (hits, misses, hit_ns, miss_ns) in self.table().items():  # this worker's overflow
            out.hits[key] += hits
            out.misses[key] += misses
            out.hit_ns[key] += hit_ns
            out.miss_ns[key] += miss_ns
        return out

    def samples(self) -> list[metrics.Sample]:
        return self.totals().samples()

    def add_to(self, stats: pb.ModelStatistics) -> None:
        self.totals().add_to(stats)
