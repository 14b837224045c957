"""The test suite's port picker (tests/support/net.py): quiet range, own slice per worker, checked."""
from __future__ import annotations

import itertools
import socket

import pytest

from tests.support import net


def _quiet_range() -> bool:
    return net._candidates() is not None


def test_a_port_comes_from_below_the_ephemeral_range() -> None:
    """No outgoing connection takes a local port below ip_local_port_range, so nothing takes the
    picked port between the pick and the server's bind."""
    if not _quiet_range():
        pytest.skip("this machine's ephemeral range starts too low for a quiet range")
    ports = [net.free_port() for _ in range(50)]
    assert all(net._LOWEST <= p < net._ephemeral_start() for p in ports), ports
    assert len(set(ports)) == len(ports)  # never the same port twice in a run


def test_xdist_workers_pick_from_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _quiet_range():
        pytest.skip("this machine's ephemeral range starts too low for a quiet range")
    picked = {}
    for worker in ("gw0", "gw1", "gw7"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        candidates = net._candidates()
        assert candidates is not None
        size = (net._ephemeral_start() - net._LOWEST) // net._SLICES
        picked[worker] = set(itertools.islice(candidates, size))
        assert len(picked[worker]) == size  # the whole slice, each port once
    assert not picked["gw0"] & picked["gw1"] and not picked["gw1"] & picked["gw7"] and not picked["gw0"] & picked["gw7"]


def test_a_port_something_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        held.listen()
        probe.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()
        monkeypatch.setattr(net, "_ports", itertools.cycle([taken, free]))
        assert net.free_port() == free
