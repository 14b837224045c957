"""TLS handshakes as an attack surface (meshserve/server/tls.py): a gateway with TLS on both
ports (tenants, in front of an ONNX replica) while the good client runs over TLS
(harness.Verdict), and a prober that opens a FRESH TLS connection for each of its requests
(the good client keeps its connections, so it alone would not notice handshakes refused):

- stalled handshakes: more connections than --max-tls-handshakes that never send a ClientHello
  (the oldest are closed to make room, the rest at --tls-handshake-timeout-s); fresh clients'
  handshakes keep completing;
- a slow handshake: a real ClientHello sent a byte at a time: closed at the handshake timeout;
- a full-handshake flood: threads completing handshakes as fast as they can;
- garbage instead of a ClientHello: closed at once.
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.adversarial.harness import (
    LIMIT_FLAGS,
    P99_FACTOR,
    P99_FLOOR_S,
    TENANTS,
    GoodClient,
    Mesh,
    Observation,
    p99,
    under_attack,
)
from tests.adversarial.test_http1_attacks import drip_until
from tests.conftest import Proc, start
from tests.support import certs
from tests.support.waiting import eventually

HANDSHAKE_TIMEOUT_S = 2.0
MAX_HANDSHAKES = 64
STALLED = 300  # per port: several times the cap
FLAGS = ["--tls-handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S), "--max-tls-handshakes", str(MAX_HANDSHAKES)]


@dataclass
class TlsMesh:
    mesh: Mesh
    ca: Path
    ports: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def tls_mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    tmp = tmp_path_factory.mktemp("tlsmesh")
    (tmp / "tenants.yaml").write_text(TENANTS)
    ca = certs.authority(tmp, "mesh-ca")
    server = ca.issue(tmp, "server", server=True)
    tls = [a for proto in ("grpc", "http") for a in (f"--{proto}-use-ssl", f"--{proto}-server-cert", str(server.cert),
                                                    f"--{proto}-server-key", str(server.key))]
    service = start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port", "0",
                     "--model-control-mode", "explicit", "--load-model", "add_sub", *LIMIT_FLAGS])
    procs: list[Proc] = [service]  # stopped in this order, the gateway first
    good = None
    try:
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tmp / "tenants.yaml"),
                         "--upstream", service.grpc, *LIMIT_FLAGS, *FLAGS, *tls])
        procs.insert(0, gateway)
        good = GoodClient(gateway, extra=("--root-cert", str(ca.cert)))
        assert good.wait_past(time.monotonic(), 60), "the good client did not start"
        yield TlsMesh(Mesh(gateway, [service], good, tmp), ca.cert, dict(gateway.ports))
    finally:
        for stoppable in ([good] if good is not None else []) + procs:
            stoppable.stop()


class Prober:
    """A fresh TLS connection and one HTTP request (GET /v2/health/live) every PERIOD_S, on a thread."""

    PERIOD_S = 0.05

    def __init__(self, port: int, ca: Path) -> None:
        self.port = port
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self.records: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _once(self) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as raw:
            with self.ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
        return "ok" if data.startswith(b"HTTP/1.1 200") else repr(data[:60])

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status = self._once()
            except (OSError, ssl.SSLError) as exc:
                status = f"{type(exc).__name__}: {exc}"
            self.records.append((t0, time.monotonic() - t0, status))
            self._stop.wait(self.PERIOD_S)

    def window(self, t0: float, t1: float) -> list[tuple[float, float, str]]:
        return [r for r in list(self.records) if t0 <= r[0] < t1]

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


def _with_prober(tm: TlsMesh, name: str, attack: Callable[[], Observation]) -> None:
    """under_attack, plus the prober's fresh handshakes judged by the same p99 rule."""
    prober = Prober(tm.ports["http"], tm.ca)
    try:
        t0 = time.monotonic()
        eventually(lambda: len(prober.window(t0, time.monotonic())) >= 20, timeout=30, what="prober baseline")
        t1 = time.monotonic()
        verdict = under_attack(tm.mesh, tm.mesh.gateway, name, attack)
        t2 = time.monotonic()
    finally:
        prober.stop()
    base = [lat for _, lat, st in prober.window(t0, t1) if st == "ok"]
    during = prober.window(t1, t2)
    failures = [st for _, _, st in during if st != "ok"]
    limit = max(P99_FLOOR_S, P99_FACTOR * p99(base))
    verdict.check()
    assert during, "the prober made no connection during the attack"
    assert not failures, f"fresh TLS connections failed during the attack: {failures[:3]} ({verdict.summary()})"
    assert p99([lat for _, lat, _ in during]) <= limit, (
        f"fresh TLS connection p99 {p99([lat for _, lat, _ in during]) * 1000:.1f} ms > {limit * 1000:.1f} ms "
        f"(baseline {p99(base) * 1000:.1f} ms); {verdict.summary()}")


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _client_hello() -> bytes:
    """A real ClientHello, as bytes (from a client-side TLS object on memory buffers)."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def test_stalled_handshakes_do_not_lock_out_fresh_clients(tls_mesh: TlsMesh) -> None:
    def attack() -> Observation:
        socks = []
        for proto in ("http", "grpc"):
            for _ in range(STALLED):
                socks.append(socket.create_connection(("127.0.0.1", tls_mesh.ports[proto]), timeout=5))
        t0 = time.monotonic()
        eventually(lambda: all(_closed(s) for s in socks), timeout=HANDSHAKE_TIMEOUT_S + 10,
                   what="every stalled handshake closed")
        took = time.monotonic() - t0
        for s in socks:
            s.close()
        return Observation(f"{len(socks)} stalled connections all closed after {took:.1f} s", True)

    _with_prober(tls_mesh, "stalled TLS handshakes", attack)


def test_a_handshake_under_way_outlives_a_flood_of_silent_connections(tls_mesh: TlsMesh) -> None:
    """At the cap the silent connections go first: a client whose ClientHello came (the server
    answered it) keeps its handshake while more silent connections than the cap arrive after it.
    On the old rule (the oldest of all first) the cap-th of them closed it: on a loaded machine a
    fresh client of the stalled-handshakes test above was closed that way (SSLEOFError)."""
    port = tls_mesh.ports["http"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(_client_hello())
        assert client.recv(1 << 16), "no answer to the ClientHello"  # the server's first flight: under way
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_HANDSHAKES + 10)]
        try:
            # the cap holds the client and the newest MAX_HANDSHAKES - 1 silent ones: the 11 oldest
            # silent ones are closed to make room (well within the 2 s timeout)
            over = len(silent) + 1 - MAX_HANDSHAKES
            eventually(lambda: all(_closed(s) for s in silent[:over]), timeout=HANDSHAKE_TIMEOUT_S - 0.5,
                       what="the oldest silent connections closed at the cap", interval=0.02)
            assert not _closed(client), "the handshake under way was closed to make room for silent connections"
            assert not any(_closed(s) for s in silent[over:])
        finally:
            for s in silent:
                s.close()


def test_slow_handshake_closed_at_the_timeout(tls_mesh: TlsMesh) -> None:
    hello = _client_hello()

    def attack() -> Observation:
        socks = [socket.create_connection(("127.0.0.1", tls_mesh.ports[p]), timeout=5)
                 for p in ("http", "grpc") for _ in range(10)]
        t0 = time.monotonic()
        sent = 0
        open_ = list(socks)

        def step() -> bool:  # one more byte on each connection still open (the attack's pace: drip_until)
            nonlocal sent
            for s in list(open_):
                try:
                    s.send(hello[sent:sent + 1])
                except OSError:
                    open_.remove(s)
                    continue
                if _closed(s):
                    open_.remove(s)
                s.setblocking(True)
            sent += 1
            return not open_ or sent >= len(hello)

        drip_until(t0 + HANDSHAKE_TIMEOUT_S + 5, step, pace=0.1)  # a byte every 100 ms
        took = time.monotonic() - t0
        closed = eventually(lambda: all(_closed(s) for s in socks) or None, timeout=5, what="all closed")
        for s in socks:
            s.close()
        return Observation(f"{len(socks)} slow ClientHellos ({sent} of {len(hello)} bytes sent) closed "
                           f"after {took:.1f} s", bool(closed) and took < HANDSHAKE_TIMEOUT_S + 3)

    _with_prober(tls_mesh, "slow TLS handshake", attack)


def test_full_handshake_flood(tls_mesh: TlsMesh) -> None:
    ctx = ssl.create_default_context(cafile=str(tls_mesh.ca))
    done = [0]

    def flood(port: int, until: float) -> None:
        while time.monotonic() < until:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                    with ctx.wrap_socket(raw, server_hostname="localhost"):
                        done[0] += 1
            except (OSError, ssl.SSLError):
                pass

    def attack() -> Observation:
        until = time.monotonic() + 3.0
        threads = [threading.Thread(target=flood, args=(tls_mesh.ports[p], until)) for p in ("http", "grpc")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return Observation(f"{done[0]} full handshakes in 3 s", True)

    _with_prober(tls_mesh, "full TLS handshake flood", attack)


def test_garbage_instead_of_a_client_hello(tls_mesh: TlsMesh) -> None:
    def attack() -> Observation:
        took = []
        for proto in ("http", "grpc"):
            for payload in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x16\x03\x01\xff\xff" + b"A" * 4096):
                with socket.create_connection(("127.0.0.1", tls_mesh.ports[proto]), timeout=5) as s:
                    t0 = time.monotonic()
                    s.sendall(payload)
                    s.settimeout(HANDSHAKE_TIMEOUT_S + 5)
                    try:
                        while s.recv(65536):
                            pass
                    except ConnectionResetError:
                        pass
                    took.append(time.monotonic() - t0)
        return Observation(f"closed after at most {max(took):.2f} s", max(took) < 1.0)

    _with_prober(tls_mesh, "garbage on a TLS port", attack)
