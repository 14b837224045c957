"""What the python service and its model workers exchange: shared-memory regions for tensor
bytes, and small pickled messages (names, shapes, offsets) over a socket pair.

Used on both sides, so it imports only the standard library and numpy (the worker imports no
asyncio and no meshserve.server). A region is a file under /dev/shm that both processes map; the
side that writes into a region creates it (the service for inputs, the worker for outputs) and
grows it by replacing it with a larger one under a new name.

Measured (``python -m load.bench.python_vs_onnx --ipc``; 2-core box shared with other jobs, load
average 3-4, so small sizes are noisy): one round trip of two inputs to a second process and two
outputs back, as the service and a worker make it, best of 5, two runs:

    tensor size   shared memory        pickled over the socket
    64 B          54 / 149 us          46 / 112 us
    64 KiB        103 / 180 us         179 / 107 us
    1 MiB         1.6 / 1.1 ms         8.3 / 7.4 ms
    8 MiB         18 / 12 ms           92 / 85 ms

Up to 64 KiB the message round trip dominates either way (the difference is noise); from 1 MiB
the regions are 5-7x cheaper (one copy in, a view, one copy out, against pickling, socket copies
and unpickling both ways).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
MIN_REGION = 1 << 20  # 1 MiB: add_sub-sized batches never grow a region
ALIGN = 64


class TensorRef(NamedTuple):
    """One tensor in a region: where its bytes are and what they are (a tuple: it pickles
    several times cheaper than a dataclass, and every batch sends a few)."""

    name: str
    datatype: str  # v2 wire name (FP32, BYTES, ...)
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Region:
    """A shared-memory file mapped into this process (created here, or opened by name)."""

    def __init__(self, name: str, size: int, create: bool):
        self.name = name
        self.size = size
        self.path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.owned = create

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.map)[offset:offset + nbytes]

    def write(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        """Copy ``data`` (bytes, or a contiguous array: no intermediate copy) to ``offset``."""
        if isinstance(data, np.ndarray):
            data = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        self.map[offset:offset + len(data)] = data

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a numpy view still points into it: the mapping goes with the last view
        if self.owned:
            unlink(self.name)


def unlink(name: str) -> None:
    try:
        (SHM_DIR / name).unlink()
    except FileNotFoundError:
        pass


class _CurrentRegion:
    """The one region a side uses now; replacing it unmaps (and, if ours, removes) the old one."""

    def __init__(self) -> None:
        self.region: Region | None = None

    def _swap(self, fresh: Region) -> Region:
        if self.region is not None:
            self.region.close()
        self.region = fresh
        return fresh

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


class RegionWriter(_CurrentRegion):
    """The writing side's region: grown (replaced under a new name) when a batch needs more."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix
        self._generation = 0

    def ensure(self, needed: int) -> Region:
        region = self.region
        if region is None or region.size < needed:
            self._generation += 1
            size = max(MIN_REGION, 1 << max(needed - 1, 1).bit_length())
            return self._swap(Region(f"{self.prefix}-{self._generation}", size, create=True))
        return region


class RegionReader(_CurrentRegion):
    """The reading side: maps the writer's current region by name (remapped when it changes)."""

    def get(self, name: str, size: int) -> Region:
        region = self.region
        if region is None or region.name != name:
            return self._swap(Region(name, size, create=False))
        return region
