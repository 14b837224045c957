"""services/python/ipc.py with real sockets and memory files: a region reaches the other side
only as a descriptor, its size is sealed, and a descriptor that is not such a region is refused."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from services.python.ipc import Channel, Region, RegionError, RegionReader, RegionWriter, region_ref


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a), Channel(b)


def test_a_region_travels_once_as_a_descriptor_then_by_generation() -> None:
    here, there = _pair()
    writer, reader = RegionWriter("test-in"), RegionReader()
    try:
        for round_ in range(3):
            region = writer.ensure(1000)
            region.write(0, np.full(4, round_, np.int32))
            ref, fd = region_ref(region)
            assert (fd >= 0) == (round_ == 0)  # the descriptor goes with the first message only
            here.send(("exec", ref), fd)
            _, (generation, size, follows) = there.recv()
            got = reader.get(generation, size, there.recv_fd() if follows else -1)
            assert np.frombuffer(got.view(0, 16), np.int32).tolist() == [round_] * 4  # the same memory
        grown = writer.ensure(4 << 20)  # a larger one: the next generation, passed again
        ref, fd = region_ref(grown)
        assert ref[0] == 2 and ref[2] and fd >= 0
        here.send(("exec", ref), fd)
        _, (generation, size, follows) = there.recv()
        assert reader.get(generation, size, there.recv_fd()).size == grown.size >= 4 << 20
        with pytest.raises(RegionError):
            reader.get(1, 1 << 20, -1)  # an old generation is gone
    finally:
        writer.close()
        reader.close()
        here.close()
        there.close()


def test_a_region_has_no_name_and_cannot_be_shrunk() -> None:
    region = Region.create("test-sealed", 1, 1 << 20)
    try:
        assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:test-sealed")
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, 0)  # the reading side's mapping can never run past the file
    finally:
        region.close()


def test_a_descriptor_that_is_not_a_sealed_region_of_the_size_announced_is_refused() -> None:
    plain = os.memfd_create("test-plain")  # unsealed: its writer could shrink it under the reader
    os.ftruncate(plain, 1 << 20)
    with pytest.raises(RegionError):
        Region.attach(plain, 1, 1 << 20)
    sealed = Region.create("test-small", 1, 1 << 20)
    try:
        with pytest.raises(RegionError):
            Region.attach(os.dup(sealed.fd), 1, 2 << 20)  # smaller than announced
    finally:
        sealed.close()
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(OSError):
        Region.attach(r, 1, 1 << 20)  # not a memory file at all


def test_a_missing_descriptor_is_a_protocol_error_and_a_closed_peer_an_eof() -> None:
    here, there = _pair()
    here.sock.sendall(b"R")  # the byte without a descriptor
    with pytest.raises(RegionError):
        there.recv_fd()
    here.close()
    with pytest.raises(EOFError):
        there.recv_fd()
    there.close()
