"""Descriptors and connections (issue 29, finding 6 / item 5): a gateway started with
NOFILE 1024 (soft and hard: the default soft limit, and nothing to raise it to), with tenants
in front of an ONNX replica, while the good client runs (harness.Verdict). 1000 idle keep-alive
HTTP connections and 200 idle HTTP/2 connections (before: the descriptors ran out and good
clients were refused): near --max-connections (derived: 1024 - 128 - 256 shared-memory regions
= 640) the longest idle are closed, and the good client never notices. Also: the soft limit is
raised to the hard one at start."""
from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.h2raw import PREFACE, settings
from tests.adversarial.harness import LIMIT_FLAGS, Mesh, Observation, one_service_mesh, under_attack
from tests.conftest import start
from tests.support.http1 import connect

NOFILE = 1024
HTTP_CONNS, H2_CONNS = 1000, 200


@pytest.fixture(scope="module")
def capped(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with one_service_mesh(model_repo, tmp_path_factory.mktemp("capped"), lambda service, tenants: [
            str(NOFILE), str(NOFILE), "gateway", "--grpc-port", "0", "--http-port", "0",
            "--tenants", str(tenants), "--upstream", service.grpc, *LIMIT_FLAGS],
            module="tests.adversarial.lownofile") as mesh:
        yield mesh


def _closed(sock: socket.socket) -> bool:
    """Has the server closed it? (What it sent before, an HTTP/2 preamble or a GOAWAY, is read past.)"""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
        return True  # EOF
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_idle_connection_flood(capped: Mesh) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * NOFILE:  # this process holds the attacker's sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8 * NOFILE), hard))
    proc = capped.gateway
    host, port = proc.grpc.rsplit(":", 1)

    def attack() -> Observation:
        socks: list[socket.socket] = []
        refused = 0
        try:
            for _ in range(HTTP_CONNS):
                try:
                    s = connect(proc.http, timeout=5.0)
                    socks.append(s)
                    s.sendall(f"GET /v2/health/live HTTP/1.1\r\nHost: {proc.http}\r\n\r\n".encode())
                    s.recv(4096)  # its answer: the connection is now an idle keep-alive one
                except OSError:
                    refused += 1
            for _ in range(H2_CONNS):
                try:
                    s = socket.create_connection((host, int(port)), timeout=5.0)
                    socks.append(s)
                    s.sendall(PREFACE + settings())
                except OSError:
                    refused += 1
            time.sleep(2.0)  # idle, as the attacker means them to be (the good client keeps going)
            closed = sum(_closed(s) for s in socks)
        finally:
            for s in socks:
                s.close()
        return Observation(f"{len(socks)} idle connections opened ({refused} refused at connect); "
                           f"{closed} closed by the gateway", closed >= HTTP_CONNS + H2_CONNS - (NOFILE - 128 - 256))

    under_attack(capped, proc, "idle connection flood on a gateway with NOFILE 1024", attack).judge().check()


def test_soft_nofile_is_raised_to_the_hard_limit(model_repo: Path) -> None:
    service = start(["256", "4096", "service", "onnx", "--repository", str(model_repo), "--grpc-port", "0",
                     "--model-control-mode", "explicit"], module="tests.adversarial.lownofile")
    try:
        limits = Path(f"/proc/{service.proc.pid}/limits").read_text()
        line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line
    finally:
        service.stop()
