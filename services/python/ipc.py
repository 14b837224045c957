"""What the python service and its model workers exchange: shared-memory regions for tensor
bytes, and small pickled messages (shapes, offsets) over a socket pair (``Channel``).

Used on both sides, so it imports only the standard library and numpy (the worker imports no
asyncio and no meshserve.server). A region is an anonymous memory file (``memfd_create``): it has
no name anyone can open (nothing under /dev/shm, which a gateway tenant could register as a
shared-memory region), and the other process gets it only as a descriptor passed over the
worker's own socket (SCM_RIGHTS), right after the message that first names it. The side that
writes into a region creates it (the service for inputs, the worker for outputs), seals its size
(so the reading side can never be left with a mapping past the end of the file, a SIGBUS), and
grows it by replacing it with a larger one of the next generation.

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
and unpickling both ways). Passing a descriptor costs one more system call on each side, once per
region (not per batch).
"""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
from multiprocessing.connection import Connection
from typing import NamedTuple

import numpy as np

MIN_REGION = 1 << 20  # 1 MiB: add_sub-sized batches never grow a region
ALIGN = 64
# a region's size can neither shrink nor grow, and its seals cannot change
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# A region as a message names it: (generation, size, whether its descriptor follows the message).
RegionRef = tuple[int, int, bool]


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


class RegionError(OSError):
    """A descriptor that is not a region as announced (its peer broke the protocol)."""


class Region:
    """An anonymous shared-memory file mapped into this process: created here
    (``Region.create``) or received as a descriptor (``Region.attach``)."""

    def __init__(self, fd: int, generation: int, size: int, owned: bool):
        self.generation = generation
        self.size = size
        self.map = mmap.mmap(fd, size)
        self.fd = fd if owned else -1  # kept until the peer has it (``handover``)
        if not owned:
            os.close(fd)

    @classmethod
    def create(cls, label: str, generation: int, size: int) -> Region:
        fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, generation, size, owned=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, generation: int, size: int) -> Region:
        """Map a region received from the peer (the descriptor is closed here)."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & fcntl.F_SEAL_SHRINK == 0 or os.fstat(fd).st_size < size:
                raise RegionError(f"region {generation}: not a sealed region of {size} bytes")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, generation, size, owned=False)

    def handover(self) -> int:
        """The descriptor to pass to the peer the first time a message names this region, else -1
        (the caller closes it: ``Channel.send`` does)."""
        fd, self.fd = self.fd, -1
        return fd

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
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _CurrentRegion:
    """The one region a side uses now; replacing it unmaps the old one."""

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
    """The writing side's region: grown (replaced by the next generation) when a batch needs more."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label
        self._generation = 0

    def ensure(self, needed: int) -> Region:
        region = self.region
        if region is None or region.size < needed:
            self._generation += 1
            size = max(MIN_REGION, 1 << max(needed - 1, 1).bit_length())
            return self._swap(Region.create(self.label, self._generation, size))
        return region


    def retire(self) -> None:
        """Stop writing into the current region: the next ``ensure`` makes a new one. (A batch
        whose requests stay open after execute() returned: the worker may still read their
        inputs in place, so they are not overwritten; its mapping there lives with its views.)"""
        self.close()


class RegionReader(_CurrentRegion):
    """The reading side: the writer's current region, mapped from the descriptor that came with
    the first message naming it."""

    def get(self, generation: int, size: int, fd: int) -> Region:
        """The region of ``generation``; ``fd`` (>= 0) is a new one's descriptor."""
        if fd >= 0:
            return self._swap(Region.attach(fd, generation, size))
        region = self.region
        if region is None or region.generation != generation:
            raise RegionError(f"region {generation} was never passed")
        return region


def region_ref(region: Region) -> tuple[RegionRef, int]:
    """How a message names ``region``, and the descriptor to send with it (-1: the peer has it)."""
    fd = region.handover()
    return (region.generation, region.size, fd >= 0), fd


class Channel:
    """One end of the service-worker socket: pickled messages (multiprocessing's framing), and
    a region's descriptor right after the message that announces it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self._send_lock = threading.Lock()  # (senders: the event loop, the model's threads)

    def send(self, msg: tuple, fd: int = -1) -> None:
        """Send ``msg``, then ``fd`` (>= 0: a region's descriptor, closed here once sent)."""
        try:
            with self._send_lock:
                self.conn.send(msg)
                if fd >= 0:
                    socket.send_fds(self.sock, [b"R"], [fd])
        finally:
            if fd >= 0:
                os.close(fd)

    def recv(self) -> tuple:
        msg: tuple = self.conn.recv()
        return msg

    def recv_fd(self) -> int:
        """The descriptor that follows a message announcing a region (EOFError: the peer is gone)."""
        data, fds, _, _ = socket.recv_fds(self.sock, 1, 1, socket.MSG_CMSG_CLOEXEC)
        if not data:
            raise EOFError
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise RegionError("a region's descriptor was expected")
        return fds[0]

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def shutdown(self) -> None:
        """End the reading side's wait (``recv`` sees EOF), whoever else holds the other end."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.conn.close()
        self.sock.close()
