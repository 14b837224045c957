"""HTTP/1.1 attacks on the REST front door (issue 17, items 4 and 5), on the gateway and a
service replica, while the good client runs (harness.Verdict): a 100 MB JSON body (413 before
it is read), a gzip bomb (413), header slowloris and a stalled body (closed after the
--header-timeout-s / --read-timeout-s the mesh runs with: 2 s and 3 s)."""
from __future__ import annotations

import functools
import socket
import time
import zlib
from collections.abc import Callable

import pytest

from tests.adversarial.harness import LONG, OTHER_KEY, Mesh, Observation, under_attack
from tests.conftest import Proc
from tests.support.http1 import connect

MiB = 1 << 20
BOTH = ["gateway", "service"]
HEADER_TIMEOUT_S, READ_TIMEOUT_S = 2.0, 3.0  # harness.LIMIT_FLAGS
MARGIN_S = 3.0


def target(mesh: Mesh, which: str) -> Proc:
    return mesh.gateway if which == "gateway" else mesh.services[0]


# how a slow or stalled request may end: its connection closed, or answered with one of these
ENDED = ("closed", "EOF", "408", "400", "429")


def head(hostport: str, path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"x-api-key: {OTHER_KEY}\r\nContent-Length: {length}\r\n{extra}\r\n").encode()


def read_status(sock: socket.socket, timeout: float) -> str:
    """The response's status code, "EOF" when the server closed without one, "silent" when
    nothing came within `timeout` (bounded)."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while b"\r\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                return "EOF" if not buf else f"partial {buf[:40]!r}"
            buf += chunk
    except TimeoutError:
        return "silent"
    except OSError:
        return "EOF"  # reset
    parts = buf.split(b"\r\n", 1)[0].split()
    return parts[1].decode() if len(parts) > 1 else f"bad status line {buf[:40]!r}"


def send_body(hostport: str, header: bytes, body_parts: object, deadline_s: float) -> tuple[int, str]:
    """Send header + body in parts until done, refused (the server closed) or the deadline;
    then read the status. Returns (bytes of body sent, status)."""
    sock = connect(hostport, timeout=5.0)
    sent = 0
    try:
        sock.sendall(header)
        end = time.monotonic() + deadline_s
        for part in body_parts:  # type: ignore[attr-defined]
            if time.monotonic() > end:
                break
            try:
                sock.sendall(part)
            except TimeoutError:
                break  # the server stopped reading
            except OSError:
                break  # closed: the status (if any) is in our receive buffer
            sent += len(part)
        return sent, read_status(sock, 5.0)
    finally:
        sock.close()


def big_json_parts(total: int) -> object:
    """A JSON infer body of `total` bytes: one input with a very long data list, in 1 MiB parts."""
    start = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":['
    end = b"1.0]}]}"
    filler = b"1.0," * (MiB // 4)
    yield start
    left = total - len(start) - len(end)
    while left > 0:
        n = min(left, len(filler))
        yield filler[:n]
        left -= n
    yield end


@pytest.mark.parametrize("which", BOTH)
def test_100mb_json_body(mesh: Mesh, which: str) -> None:
    """Over the body limit (64 MiB by default): 413 before the body is read past it."""
    total = 100_000_000
    proc = target(mesh, which)

    def attack() -> Observation:
        sent, status = send_body(proc.http, head(proc.http, "/v2/models/add_sub/infer", total),
                                 big_json_parts(total), 30)
        return Observation(f"sent {sent / MiB:.0f} MiB of {total / MiB:.0f} MiB; status {status}", status == "413")

    under_attack(mesh, proc, f"100 MB JSON on {which}", attack).judge().check()


@functools.cache
def gzip_bomb(size: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * (16 * MiB)
    return b"".join(c.compress(zeros) for _ in range(size // len(zeros))) + c.flush()


@pytest.mark.parametrize("which", BOTH)
def test_gzip_bomb(mesh: Mesh, which: str) -> None:
    """A ~250 KB gzip body that inflates to 256 MiB (1 GiB with the long flag): 413."""
    bomb = gzip_bomb((1024 if LONG else 256) * MiB)
    proc = target(mesh, which)

    def attack() -> Observation:
        sent, status = send_body(proc.http, head(proc.http, "/v2/models/add_sub/infer", len(bomb),
                                                 "Content-Encoding: gzip\r\n"), [bomb], 10)
        return Observation(f"{len(bomb)} bytes of gzip; status {status}", status == "413")

    under_attack(mesh, proc, f"gzip bomb on {which}", attack).judge().check()


def open_many(hostport: str, n: int, first: bytes, socks: list[socket.socket]) -> None:
    """n connections (appended to `socks`, which the caller closes), each having sent `first`."""
    for _ in range(n):
        s = connect(hostport, timeout=5.0)
        socks.append(s)
        s.sendall(first)


def drip_until(end: float, step: Callable[[], bool], pace: float = 0.5) -> None:
    """A slow client's clock: ``step()`` (one more piece on each connection still open; True once
    none is left) every ``pace`` s, until it is done or the monotonic time ``end`` passes."""
    while time.monotonic() < end and not step():
        time.sleep(pace)  # the point: the drip rate of a slow client, not a wait for a condition


def _slow_clients(hostport: str, n: int, first: bytes, drip: bytes, limit_s: float) -> Observation:
    """n connections send `first`, then one byte of `drip` every 0.5 s: each must be closed
    (or answered 408/400, or refused 429: past its tenant's share of the receive budget, which
    a declared body is charged to as it starts, so a LONG run's 200 bodies of 1 MiB are 72 over
    mallory's half of 256 MiB) within limit_s + MARGIN_S. Bounded by that time."""
    socks: list[socket.socket] = []
    try:
        open_many(hostport, n, first, socks)
        open_ = {id(s): s for s in socks}
        verdicts: dict[str, int] = {}
        sent = 0

        def one_more_byte() -> bool:
            nonlocal sent
            for key, s in list(open_.items()):
                try:
                    s.sendall(drip[sent % len(drip):sent % len(drip) + 1])
                except OSError:
                    verdicts["closed"] = verdicts.get("closed", 0) + 1
                    del open_[key]
                    continue
                status = read_status(s, 0.001)
                if status != "silent":
                    verdicts[status] = verdicts.get(status, 0) + 1
                    del open_[key]
            sent += 1
            return not open_

        drip_until(time.monotonic() + limit_s + MARGIN_S, one_more_byte)
        ok = not open_ and all(k in ENDED for k in verdicts)
        return Observation(f"{n} slow connections after {limit_s + MARGIN_S:.0f} s: {verdicts}, "
                           f"{len(open_)} still open", ok)
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("which", BOTH)
def test_header_slowloris(mesh: Mesh, which: str) -> None:
    proc = target(mesh, which)
    n = 500 if LONG else 50

    def attack() -> Observation:
        return _slow_clients(proc.http, n, b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\n",
                             b"X-Slow-Header-Name-That-Never-Ends-", HEADER_TIMEOUT_S)

    under_attack(mesh, proc, f"header slowloris on {which}", attack).judge().check()


@pytest.mark.parametrize("which", BOTH)
def test_stalled_body(mesh: Mesh, which: str) -> None:
    proc = target(mesh, which)
    n = 200 if LONG else 20

    def attack() -> Observation:
        first = head(proc.http, "/v2/models/add_sub/infer", MiB) + b'{"inputs":[{"name":"INPUT0",'
        return _stalled(proc.http, n, first)

    under_attack(mesh, proc, f"stalled body on {which}", attack).judge().check()


def _stalled(hostport: str, n: int, first: bytes) -> Observation:
    """n connections send headers and the start of a 1 MiB body, then nothing: each must be
    closed (or answered 408/400, or refused 429 past its tenant's share: ``_slow_clients``)
    within --read-timeout-s + MARGIN_S."""
    socks: list[socket.socket] = []
    try:
        open_many(hostport, n, first, socks)
        end = time.monotonic() + READ_TIMEOUT_S + MARGIN_S
        verdicts: dict[str, int] = {}
        for s in socks:
            status = read_status(s, max(0.01, end - time.monotonic()))
            verdicts[status] = verdicts.get(status, 0) + 1
        ok = all(k in ENDED for k in verdicts)
        return Observation(f"{n} stalled bodies after {READ_TIMEOUT_S + MARGIN_S:.0f} s: {verdicts}", ok)
    finally:
        for s in socks:
            s.close()
