"""Every buffer bounded in bytes (issue 29, finding 5 / item 4), against the suite's mesh (a
gateway with tenants in front of two ONNX replicas) while the good client runs (harness.Verdict):

- HTTP/1.1 pipelining: tens of MiB of pipelined `GET /v2/health/live` on one connection, first
  never reading the answers, then reading them (before: 74 MiB took the gateway to 3 GiB);
- bodies without a key, with tenants: refused (401) before the body is read (before: read and
  decoded first, +161 MiB for 4 connections);
- a chunked body whose chunk extensions make it large on the wire and tiny decoded: 413 once
  the wire bytes pass --max-request-bytes (before: 300 MiB of wire accepted);
- a body sent one byte at a time (never silent for --read-timeout-s): closed after
  --body-timeout-s (the mesh runs with 3 s).
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from tests.adversarial import h2raw
from tests.adversarial.harness import BODY_TIMEOUT_S, LONG, OTHER_KEY, Mesh, Observation, under_attack
from tests.adversarial.test_http1_attacks import (
    MARGIN_S,
    _slow_clients,
    drip_until,
    head,
    read_status,
    target,
)
from tests.support.http1 import connect

MiB = 1 << 20
BOTH = ["gateway", "service"]


def _drain(sock: socket.socket, stop: threading.Event, got: list[int]) -> None:
    """Read and drop what the server sends until `stop` or EOF (counting the bytes)."""
    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except OSError:
            return
        if not chunk:
            return
        got[0] += len(chunk)


@pytest.mark.parametrize("which", BOTH)
def test_pipelining_flood(mesh: Mesh, which: str) -> None:
    """Pipelined health checks as fast as the server takes them: first without reading a byte
    of the answers (the server stops reading: it holds one socket buffer of answers and at most
    its pipelining bound of requests), then reading them; 74 MiB (the issue's) or 3 s + 5 s
    (3 s + 20 s with MESHSERVE_ADVERSARIAL_LONG=1): the server's memory is bounded by what it
    holds per connection, not by what was sent, so a longer phase 2 only repeats the same state."""
    proc = target(mesh, which)
    request = f"GET /v2/health/live HTTP/1.1\r\nHost: {proc.http}\r\n\r\n".encode()
    burst = request * (MiB // len(request))
    total = (300 if LONG else 74) * MiB

    def attack() -> Observation:
        sock = connect(proc.http, timeout=1.0)
        sent = 0
        stop = threading.Event()
        got = [0]
        try:
            end = time.monotonic() + 3  # phase 1: never read; the server must stop reading
            while sent < total and time.monotonic() < end:
                try:
                    sock.sendall(burst)
                except TimeoutError:
                    break
                sent += len(burst)
            unread = sent
            reader = threading.Thread(target=_drain, args=(sock, stop, got), daemon=True)
            reader.start()  # phase 2: read the answers; send the rest
            sock.settimeout(5.0)
            end = time.monotonic() + (20 if LONG else 5)
            while sent < total and time.monotonic() < end:
                try:
                    sock.sendall(burst)
                except (TimeoutError, OSError):
                    break
                sent += len(burst)
            stop.set()
            reader.join(2)
        finally:
            sock.close()
        return Observation(f"{unread / MiB:.1f} MiB sent before the server stopped reading (not reading the "
                           f"answers), {sent / MiB:.0f} MiB in all; {got[0] / MiB:.0f} MiB of answers read",
                           unread < 32 * MiB)

    under_attack(mesh, proc, f"pipelining flood on {which}", attack).judge().check()


def test_keyless_bodies_are_refused_before_they_are_read(mesh: Mesh) -> None:
    """With tenants, 4 connections POST (the issue's) 64 MiB JSON infer bodies with no key: 401 from the
    headers, the bodies never read (before: read and decoded first)."""
    proc = mesh.gateway
    n, size = 4, 64 * MiB - 1024
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[' + b"1.0," * (MiB // 4)

    def one(verdicts: list[str]) -> None:
        header = (f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: {proc.http}\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {size}\r\n\r\n").encode()
        sock = connect(proc.http, timeout=5.0)
        try:
            sock.sendall(header)
            sent = 0
            while sent < size:
                try:
                    sock.sendall(body[:min(len(body), size - sent)])
                except OSError:
                    break  # closed: the answer is in our buffer
                sent += min(len(body), size - sent)
            verdicts.append(read_status(sock, 5.0))
        finally:
            sock.close()

    def attack() -> Observation:
        verdicts: list[str] = []
        threads = [threading.Thread(target=one, args=(verdicts,)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return Observation(f"{n} keyless 64 MiB bodies: {verdicts}", verdicts == ["401"] * n)

    under_attack(mesh, proc, "keyless bodies on gateway", attack).judge().check()


# (chunk data bytes, extension bytes per chunk, the answer): 1-byte chunks with 4 KB extensions
# (framing over 16 times the data: 400 after the first MiB), 1000-byte chunks with 4 KB
# extensions (framing 4x the data, ~13 MiB decoded: 413 once the wire passes --max-request-bytes),
# or 1-byte chunks without (6x the data, within the framing bound: 400 past BODY_PIECES_FREE
# chunks; before, 11 million of them were read, a minute of a core, then 413)
CHUNK_FLOODS = {"framing": (1, 4000, "400"), "wire": (1000, 4000, "413"), "tiny": (1, 0, "400")}


@pytest.mark.parametrize("which", BOTH)
@pytest.mark.parametrize("flood", list(CHUNK_FLOODS))
def test_chunk_extension_flood(mesh: Mesh, which: str, flood: str) -> None:
    """A chunked infer body whose chunk extensions make it large on the wire and small decoded
    (before: 300 MiB of wire accepted for one request), or of 1-byte chunks (a Python call and a
    buffered object each). Refused: 400 or 413 (CHUNK_FLOODS)."""
    proc = target(mesh, which)
    size, ext_len, expect = CHUNK_FLOODS[flood]
    chunk = (f"{size:x};x={'e' * ext_len}\r\n" if ext_len else f"{size:x}\r\n").encode() + b" " * size + b"\r\n"
    total = 100 * MiB

    def attack() -> Observation:
        header = (f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: {proc.http}\r\nContent-Type: application/json\r\n"
                  f"x-api-key: {OTHER_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        sock = connect(proc.http, timeout=5.0)
        sent = 0
        block = chunk * (MiB // len(chunk))
        try:
            sock.sendall(header)
            while sent < total:
                try:
                    sock.sendall(block)
                except OSError:
                    break
                sent += len(block)
            status = read_status(sock, 5.0)
        finally:
            sock.close()
        return Observation(f"sent {sent / MiB:.0f} MiB of chunked body; status {status}", status == expect)

    under_attack(mesh, proc, f"chunk extension flood ({flood}) on {which}", attack).judge().check()


@pytest.mark.parametrize("which", BOTH)
def test_body_trickle(mesh: Mesh, which: str) -> None:
    """20 connections send a body a byte every 0.5 s (never silent for --read-timeout-s, 3 s):
    each is closed (or answered 408/400) within --body-timeout-s (3 s) + a margin."""
    proc = target(mesh, which)
    n = 200 if LONG else 20

    def attack() -> Observation:
        first = head(proc.http, "/v2/models/add_sub/infer", MiB) + b'{"inputs":['
        return _slow_clients(proc.http, n, first, b" ", BODY_TIMEOUT_S)

    under_attack(mesh, proc, f"body trickle on {which}", attack).judge().check()


@pytest.mark.parametrize("which", BOTH)
def test_grpc_message_trickle(mesh: Mesh, which: str) -> None:
    """20 ModelInfer calls whose 1 MiB message arrives in 1-byte DATA frames, one every 0.5 s
    (every frame complete: the read timeout never sees a partial one): each call ends with
    RESOURCE_EXHAUSTED (or the connection closes) within --body-timeout-s (3 s) + a margin."""
    proc = target(mesh, which)
    n = 200 if LONG else 20

    def attack() -> Observation:
        conns = [h2raw.RawH2(proc.grpc) for _ in range(n)]
        try:
            for c in conns:
                c.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1,
                                   h2raw.grpc_headers(c.authority, key=OTHER_KEY if which == "gateway" else None))
                       + h2raw.frame(h2raw.DATA, 0, 1, struct.pack(">BI", 0, MiB)))
            def ended(c: h2raw.RawH2) -> bool:
                return 1 in c.seen.statuses or c.seen.closed_or_refused()

            def one_more_byte() -> bool:
                for c in conns:
                    if not ended(c):
                        c.send(h2raw.frame(h2raw.DATA, 0, 1, b"\0"))
                return all(ended(c) for c in conns)

            drip_until(time.monotonic() + BODY_TIMEOUT_S + MARGIN_S, one_more_byte)  # the trickle
            seen = [c.seen.statuses.get(1, "closed" if c.seen.closed_or_refused() else "open") for c in conns]
            return Observation(f"{n} trickled messages after {BODY_TIMEOUT_S + MARGIN_S:.0f} s: "
                               f"{ {s: seen.count(s) for s in set(seen)} }",
                               all(s in ("8", "closed") for s in seen))
        finally:
            for c in conns:
                c.close()

    under_attack(mesh, proc, f"gRPC message trickle on {which}", attack).judge().check()


def test_keyless_grpc_messages_are_refused_at_their_headers(mesh: Mesh) -> None:
    """With tenants, 4 connections send ModelInfer calls of 60 MiB messages with no key, as
    fast as the server's windows allow: UNAUTHENTICATED at the headers, the messages never
    held (before: each connection could hold its receive budget, 64 MiB, until the handler ran)."""
    proc = mesh.gateway
    size = 60 * MiB

    def one(verdicts: list[str]) -> None:
        conn = h2raw.RawH2(proc.grpc)
        try:
            conn.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1, h2raw.grpc_headers(conn.authority)))
            conn.send(h2raw.frame(h2raw.DATA, 0, 1, h2raw.grpc_message(b"", length=size)))
            chunk = b"\0" * (1 << 20)
            sent = 0
            while sent < size and 1 not in conn.seen.statuses and not conn.seen.closed_or_refused():
                n = conn.take_window(1, min(conn.seen.settings.get(h2raw.MAX_FRAME_SIZE, 16384), len(chunk)), 2.0)
                if n == 0 or not conn.send(h2raw.frame(h2raw.DATA, 0, 1, chunk[:n])):
                    break
                sent += n
            conn.wait_answered(1, 5.0)
            verdicts.append(conn.seen.statuses.get(1, f"none after {sent / MiB:.0f} MiB"))
        finally:
            conn.close()

    def attack() -> Observation:
        verdicts: list[str] = []
        threads = [threading.Thread(target=one, args=(verdicts,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return Observation(f"4 keyless 60 MiB gRPC messages: grpc-status {verdicts}", verdicts == ["16"] * 4)

    under_attack(mesh, proc, "keyless gRPC messages on gateway", attack).judge().check()
