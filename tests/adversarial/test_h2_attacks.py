"""HTTP/2 attacks on the gRPC front door (issue 17, items 5 and 3), each while the good client
runs, judged by harness.Verdict: the good client's p99 and failures, the attacked process's
RSS, and what the attacker's own connection saw (GOAWAY, RST_STREAM(REFUSED_STREAM), EOF, or
RESOURCE_EXHAUSTED). The new attacks run against the gateway and a service replica; the ones
that already held (CONTINUATION flood, HPACK bomb, huge header list, bad preface, invalid
frames) against the gateway (both with MESHSERVE_ADVERSARIAL_LONG=1), as does MadeYouReset (session 20:
the services' front door is the same server, whose unit tests are test_h2_server_resets.py).
"""
from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from tests.adversarial import h2raw
from tests.adversarial.h2raw import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    PING,
    PUSH_PROMISE,
    MiB,
    RawH2,
    frame,
)
from tests.adversarial.harness import LONG, OTHER_KEY, Mesh, Observation, under_attack
from tests.conftest import Proc

BOTH = ["gateway", "service"]
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
STREAM_CLOSED = 5  # RST_STREAM's code for a frame on a stream the client has ended (RFC 9113 5.1)
GATEWAY_ONLY = BOTH if LONG else ["gateway"]
CLOSE_WAIT_S = 3.0  # how long an attacker waits for the server's verdict after its last frame


def target(mesh: Mesh, which: str) -> Proc:
    return mesh.gateway if which == "gateway" else mesh.services[0]


def key_for(which: str) -> str | None:
    return OTHER_KEY if which == "gateway" else None  # services have no tenants


def batched(conn: RawH2, frames_of: object, n: int, batch: int) -> int:
    """Send n frame groups (frames_of(i) -> bytes) in batches; stops early when the server
    closes or stops reading. Returns how many were sent."""
    sent = 0
    while sent < n:
        k = min(batch, n - sent)
        if not conn.send(b"".join(frames_of(sent + j) for j in range(k))):  # type: ignore[operator]
            break
        sent += k
    return sent


def on_one_connection(mesh: Mesh, which: str, name: str, attack: Callable[[RawH2], Observation],
                      **options: Any) -> None:
    """Run ``attack`` on one new connection to the target (RawH2 ``options``; closed after),
    while the good client runs, and check the verdict (``name``: what the attack is)."""
    proc = target(mesh, which)

    def run() -> Observation:
        conn = RawH2(proc.grpc, **options)
        try:
            return attack(conn)
        finally:
            conn.close()

    under_attack(mesh, proc, f"{name} on {which}", run).judge().check()


def refused(conn: RawH2, stream: int) -> bool:
    """Waits for the server's verdict: the connection closed, a stream reset, or ``stream``
    answered with a status."""
    conn.wait("refused", CLOSE_WAIT_S)
    return conn.seen.closed_or_refused() or conn.seen.rst.total() > 0 or stream in conn.seen.statuses


# ---- the new attacks ----------------------------------------------------------------------------
@pytest.mark.parametrize("which", BOTH)
def test_headers_only_stream_flood(mesh: Mesh, which: str) -> None:
    """50k HEADERS-only streams on one connection: MAX_CONCURRENT_STREAMS advertised, excess
    streams refused (RST_STREAM(REFUSED_STREAM)) or the connection closed."""
    n = 200_000 if LONG else 50_000

    def attack(conn: RawH2) -> Observation:
        block = h2raw.grpc_headers(conn.authority, key=key_for(which))
        sent = batched(conn, lambda i: frame(HEADERS, END_HEADERS, 2 * i + 1, block), n, 1000)
        conn.wait("refused", CLOSE_WAIT_S)
        advertised = conn.seen.settings.get(h2raw.MAX_CONCURRENT_STREAMS)
        ok = conn.seen.closed_or_refused() and advertised is not None
        return Observation(f"sent {sent} streams; advertised MAX_CONCURRENT_STREAMS={advertised}; {conn.seen}",
                           ok)

    on_one_connection(mesh, which, "stream flood", attack)


@pytest.mark.parametrize("which", BOTH)
def test_rapid_reset(mesh: Mesh, which: str) -> None:
    """CVE-2023-44487: 20k HEADERS + RST_STREAM pairs end in GOAWAY(ENHANCE_YOUR_CALM) and a close."""
    n = 100_000 if LONG else 20_000

    def attack(conn: RawH2) -> Observation:
        block = h2raw.grpc_headers(conn.authority, key=key_for(which))
        sent = batched(conn, lambda i: frame(HEADERS, END_HEADERS, 2 * i + 1, block) + h2raw.rst(2 * i + 1),
                       n, 500)
        conn.wait("closed", CLOSE_WAIT_S)
        return Observation(f"sent {sent} HEADERS+RST pairs; {conn.seen}",
                           conn.seen.goaway == ENHANCE_YOUR_CALM)

    on_one_connection(mesh, which, "rapid reset", attack)


@pytest.mark.parametrize("which", GATEWAY_ONLY)  # (the services' front door is the same server: both in LONG)
def test_made_you_reset(mesh: Mesh, which: str) -> None:
    """CVE-2025-8671 (MadeYouReset): 20k whole requests, each followed by a DATA frame after its
    END_STREAM, a protocol error the server answers with RST_STREAM(STREAM_CLOSED). Each such
    reset stops the request's work and is charged as the client's own reset would be, so the
    flood ends in GOAWAY(ENHANCE_YOUR_CALM), as a rapid reset does. (Before: each call was
    answered an error while its inference went on, outside MAX_CONCURRENT_STREAMS, until the
    queues' shares refused the rest and new streams were REFUSED_STREAM. A call the server
    answered before the DATA after its end was read may show its OK.)"""
    n = 100_000 if LONG else 20_000
    body = h2raw.grpc_message(identity_request(16))

    def attack(conn: RawH2) -> Observation:
        block = h2raw.grpc_headers(conn.authority, key=key_for(which))
        sent = batched(conn, lambda i: frame(HEADERS, END_HEADERS, 2 * i + 1, block)
                       + frame(DATA, END_STREAM, 2 * i + 1, body) + frame(DATA, 0, 2 * i + 1, body), n, 200)
        conn.wait("closed", CLOSE_WAIT_S)
        return Observation(f"sent {sent} requests with DATA after their end; {conn.seen}",
                           conn.seen.goaway == ENHANCE_YOUR_CALM and set(conn.seen.rst) <= {STREAM_CLOSED}
                           and set(conn.seen.statuses.values()) <= {"0"})

    on_one_connection(mesh, which, "MadeYouReset", attack)


@pytest.mark.parametrize("which", GATEWAY_ONLY)  # (the services' front door is the same server: both in LONG)
def test_frames_that_carry_nothing(mesh: Mesh, which: str) -> None:
    """CVE-2019-9518 and kin: 1.5 million frames that carry nothing (empty DATA on an open stream,
    PRIORITY, WINDOW_UPDATE of 1, an unknown type), each 9-14 bytes, at loopback speed. Each is
    legal on its own and is read and dropped; what must hold is the good client's latency: the
    server reads at most FRAMES_PER_PASS frames of a connection per loop pass
    (meshserve/server/h2/connection.py). Before that bound, one pass took ~58,000 of them (one
    512 KiB read burst), and the good client's p99 went from ~3-15 ms to 165-365 ms."""
    n = 6_000_000 if LONG else 1_500_000

    def attack(conn: RawH2) -> Observation:
        conn.send(frame(HEADERS, END_HEADERS, 1, h2raw.grpc_headers(conn.authority, key=key_for(which))))
        mix = (frame(DATA, 0, 1, b"") + frame(h2raw.PRIORITY, 0, 3, b"\0\0\0\1\x10")
               + h2raw.window_update(1, 1) + frame(0x20, 0, 0, b""))
        sent = 4 * batched(conn, lambda i: mix, n // 4, 5000)
        conn.wait("closed", 0.5)
        return Observation(f"sent {sent} frames that carry nothing; {conn.seen}", sent == n or conn.seen.eof)

    on_one_connection(mesh, which, "frames that carry nothing", attack)


@pytest.mark.parametrize("which", GATEWAY_ONLY)  # (the services' front door is the same server: both in LONG)
def test_requests_of_many_header_fields(mesh: Mesh, which: str) -> None:
    """400 unary calls in one write, each with ~1,750 metadata fields (1-byte references to one
    HPACK table entry, and a field of its own so that no block is the one before: each is
    decoded). Each field costs ~3 us of pure-Python decoding and parsing: the server advertises
    and holds a header list of MAX_HEADER_LIST (64 KiB; a larger one is a COMPRESSION_ERROR), and
    a read's decoded fields count against its FRAMES_PER_PASS (meshserve/server/h2/frames.py,
    connection.py). Before: 1 MiB lists (29,000 such fields a call), and a pass decoded every
    block of a read; these 400 calls stalled a good client 3.9 s."""
    import hpack

    calls, fields = (1000, 1750) if LONG else (400, 1750)  # (1750 x 36 bytes: under MAX_HEADER_LIST)

    def attack(conn: RawH2) -> Observation:
        enc = hpack.Encoder()
        base = [(":method", "POST"), (":scheme", "http"), (":path", h2raw.INFER), (":authority", conn.authority),
                ("content-type", "application/grpc"), ("te", "trailers")]
        if key_for(which):
            base.append(("x-api-key", key_for(which)))  # type: ignore[arg-type]
        body = h2raw.grpc_message(identity_request(4))
        conn.send(b"".join(
            h2raw.header_frames(2 * i + 1, enc.encode(base + [("x-a", "b")] * fields
                                                      + [hpack.NeverIndexedHeaderTuple("x-n", str(i))]))
            + frame(DATA, END_STREAM, 2 * i + 1, body) for i in range(calls)))
        conn.wait_answered(2 * calls - 1, 60)
        answered = len(conn.seen.statuses)
        return Observation(f"{calls} calls of {fields} header fields; {answered} answered; {conn.seen}",
                           conn.seen.closed_or_refused() or answered > 0)

    on_one_connection(mesh, which, "requests of many header fields", attack)


@pytest.mark.parametrize("which", BOTH if LONG else ["service"])  # (the gateway's ModelStreamInfer is the same code)
def test_stream_messages_in_a_row(mesh: Mesh, which: str) -> None:
    """One connection with 20 ModelStreamInfer calls, each sending 2,000 empty messages at once
    (5 bytes each: 200 KB in all), then reading the answers. Each message is a request (an
    unknown model's error, answered in band). A connection's handlers take at most
    MESSAGES_PER_PASS messages in one pass of the loop, all its streams together
    (meshserve/server/h2/requests.py), and the error lines stay within the caller's budget
    (meshserve/server/observe.py:ERROR_LINES_PER_S). Before: a pass took up to STREAM_MAX_QUEUED
    (4096) messages of each stream, each failed request wrote a log line, and one stream of
    40,000 raised a good client's p99 from ~6 to 345-508 ms on a service (200 streams of 3,200:
    1.5-3.2 s, 2-3 good requests in 20 s)."""
    streams, each = (100, 2_000) if LONG else (20, 2_000)
    body = h2raw.grpc_message(b"") * each

    def attack(conn: RawH2) -> Observation:
        block = h2raw.grpc_headers(conn.authority, path=STREAM, key=key_for(which))
        conn.send(b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, block) + frame(DATA, 0, 2 * i + 1, body)
                           for i in range(streams)))
        seen = [-1, time.monotonic()]
        deadline = time.monotonic() + (60 if LONG else 20)
        while time.monotonic() < deadline and time.monotonic() - seen[1] < 0.5:  # until the answers stop
            if conn.seen.data_bytes != seen[0]:
                seen[:] = [conn.seen.data_bytes, time.monotonic()]
            time.sleep(0.05)  # (polling the reader thread's count)
        return Observation(f"{streams} streams of {each} empty messages at once; {conn.seen}",
                           conn.seen.data_bytes > 0)

    on_one_connection(mesh, which, "stream messages in a row", attack)


@pytest.mark.parametrize("which", BOTH)
def test_partial_huge_unary_message(mesh: Mesh, which: str) -> None:
    """A unary message announcing 400 MB, of which up to 150 MiB is sent (as fast as the
    server's windows allow) and never finished: RESOURCE_EXHAUSTED (or a reset/close) before
    it is buffered; windows are not handed back for bytes nobody consumes."""
    declared = 400_000_000
    budget = (declared if LONG else 150 * MiB)

    def attack(conn: RawH2) -> Observation:
        sent = 0
        conn.send(frame(HEADERS, END_HEADERS, 1, h2raw.grpc_headers(conn.authority, key=key_for(which))))
        prefix = h2raw.grpc_message(b"", length=declared)
        conn.send(frame(DATA, 0, 1, prefix))
        deadline = time.monotonic() + (60 if LONG else 15)
        chunk = b"\0" * (1 << 20)
        while sent < budget and time.monotonic() < deadline:
            if conn.seen.statuses or conn.seen.rst or conn.seen.eof or conn.seen.goaway is not None:
                break
            max_frame = min(conn.seen.settings.get(MAX_FRAME_SIZE, 16384), len(chunk))
            n = conn.take_window(1, max_frame, timeout=2.0)
            if n == 0:
                break  # the server holds its window: flow control stops us, as it should
            if not conn.send(frame(DATA, 0, 1, chunk[:n])):
                break
            sent += n
        conn.wait("refused", 1.0)
        status = conn.seen.statuses.get(1)
        ok = status == "8" or conn.seen.rst.total() > 0 or conn.seen.eof or conn.seen.goaway is not None
        return Observation(f"sent {sent / MiB:.0f} MiB of a {declared}-byte message; stream status {status}; "
                           f"{conn.seen}", ok)

    on_one_connection(mesh, which, "partial 400 MB message", attack)


def identity_request(elements: int) -> bytes:
    req = pb.ModelInferRequest(model_name="identity_fp32")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, elements])
    req.raw_input_contents.append(b"\0" * (4 * elements))
    return req.SerializeToString()


@pytest.mark.parametrize("which", BOTH)
def test_zero_window_client_never_reads(mesh: Mesh, which: str) -> None:
    """A client with INITIAL_WINDOW_SIZE 0 that never gives window back asks for 256 KiB
    responses, 400 of them (100 MiB): the server stops answering into it and closes the
    connection once its unsent output passes the send budget; the memory goes with it.
    (Small answers, asked one after another as each one's HEADERS arrive, so what grows is what
    the server holds for the peer, not the work of many requests in progress at once.)"""
    count = 2000 if LONG else 400
    body = h2raw.grpc_message(identity_request((MiB // 4) // 4))

    def attack(conn: RawH2) -> Observation:
        sent = 0
        block = h2raw.grpc_headers(conn.authority, key=key_for(which))
        deadline = time.monotonic() + (60 if LONG else 20)
        for i in range(count):
            sid = 2 * i + 1
            if not conn.send(frame(HEADERS, END_HEADERS, sid, block)):
                break
            pos = 0
            while pos < len(body) and time.monotonic() < deadline:
                max_frame = conn.seen.settings.get(MAX_FRAME_SIZE, 16384)
                n = conn.take_window(sid, min(max_frame, len(body) - pos), timeout=2.0)
                if n == 0:
                    break
                last = pos + n == len(body)
                if not conn.send(frame(DATA, END_STREAM if last else 0, sid, body[pos:pos + n])):
                    break
                pos += n
            if pos < len(body):
                break
            sent += 1
            if not conn.wait_answered(sid, 5.0):  # one at a time: the server holds each answer
                break
        conn.wait("closed", CLOSE_WAIT_S)
        return Observation(f"sent {sent} requests for 256 KiB answers, read none; {conn.seen}",
                           conn.seen.eof or conn.seen.goaway is not None)

    on_one_connection(mesh, which, "zero-window reader", attack, client_settings={INITIAL_WINDOW_SIZE: 0},
                      give_window=False)


def _control_flood(mesh: Mesh, which: str, one: bytes, what: str) -> None:
    n = 1_000_000 if LONG else 200_000

    def attack(conn: RawH2) -> Observation:
        sent = batched(conn, lambda i: one, n, 5000)
        conn.wait_closed_unread(CLOSE_WAIT_S)
        return Observation(f"sent {sent} {what} frames without reading (blocked={conn.blocked}); {conn.seen}",
                           conn.seen.eof or conn.seen.goaway is not None)

    on_one_connection(mesh, which, f"{what} flood", attack, read=False, send_timeout=2.0)  # never reads: the ACKs pile up


@pytest.mark.parametrize("which", BOTH)
def test_ping_flood(mesh: Mesh, which: str) -> None:
    _control_flood(mesh, which, frame(PING, 0, 0, b"12345678"), "PING")


@pytest.mark.parametrize("which", BOTH)
def test_settings_flood(mesh: Mesh, which: str) -> None:
    _control_flood(mesh, which, h2raw.settings({INITIAL_WINDOW_SIZE: 65535}), "SETTINGS")


@pytest.mark.parametrize("which", BOTH)
def test_headers_never_finished_are_timed_out(mesh: Mesh, which: str) -> None:
    """HEADERS without END_HEADERS and then silence: closed after --header-timeout-s (2 s here)."""
    proc = target(mesh, which)

    def attack() -> Observation:
        conns = [RawH2(proc.grpc) for _ in range(20)]
        try:
            for c in conns:
                c.send(frame(HEADERS, 0, 1, h2raw.grpc_headers(c.authority, key=key_for(which))[:10]))
            deadline = time.monotonic() + 2 + CLOSE_WAIT_S
            closed = sum(c.wait("closed", max(0.0, deadline - time.monotonic())) for c in conns)
            return Observation(f"{closed}/{len(conns)} half-sent header blocks closed within "
                               f"{2 + CLOSE_WAIT_S:.0f} s", closed == len(conns))
        finally:
            for c in conns:
                c.close()

    under_attack(mesh, proc, f"unfinished headers on {which}", attack).judge().check()


# ---- what held before and must keep holding -----------------------------------------------------
@pytest.mark.parametrize("which", GATEWAY_ONLY)
def test_continuation_flood(mesh: Mesh, which: str) -> None:
    def attack(conn: RawH2) -> Observation:
        conn.send(frame(HEADERS, 0, 1, h2raw.grpc_headers(conn.authority, key=key_for(which))))
        junk = h2raw.grpc_headers(conn.authority, extra=[("x-junk", "j" * 16000)])[-16000:]
        sent = batched(conn, lambda i: frame(CONTINUATION, 0, 1, junk), 4096, 64)  # up to 64 MiB
        conn.wait("closed", CLOSE_WAIT_S)
        return Observation(f"sent {sent} CONTINUATION frames; {conn.seen}",
                           conn.seen.eof or conn.seen.goaway is not None)

    on_one_connection(mesh, which, "CONTINUATION flood", attack)


@pytest.mark.parametrize("which", GATEWAY_ONLY)
def test_hpack_bomb(mesh: Mesh, which: str) -> None:
    """A 4 KB header in the dynamic table, then referenced 100k times (1 byte each): 400 MB
    of headers from 100 KB on the wire."""
    import hpack

    def attack(conn: RawH2) -> Observation:
        enc = hpack.Encoder()
        base = [(":method", "POST"), (":scheme", "http"), (":path", h2raw.INFER),
                (":authority", conn.authority), ("content-type", "application/grpc")]
        first = enc.encode(base + [("x-bomb", "b" * 4000)])  # indexed: x-bomb is dynamic entry 62
        conn.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, first))
        conn.send(h2raw.header_frames(3, h2raw.grpc_headers(conn.authority) + b"\xbe" * 100_000))
        ok = refused(conn, 3)
        return Observation(f"{conn.seen}", ok)

    on_one_connection(mesh, which, "HPACK bomb", attack)


@pytest.mark.parametrize("which", GATEWAY_ONLY)
def test_huge_header_list(mesh: Mesh, which: str) -> None:
    def attack(conn: RawH2) -> Observation:
        extra = [(f"x-h-{i}", "v" * 1000) for i in range(2048)]  # 2 MiB of headers
        block = h2raw.grpc_headers(conn.authority, key=key_for(which), extra=extra)
        conn.send(h2raw.header_frames(1, block))
        ok = refused(conn, 1)
        return Observation(f"{len(block)} bytes of headers; {conn.seen}", ok)

    on_one_connection(mesh, which, "huge header list", attack)


@pytest.mark.parametrize("which", GATEWAY_ONLY)
def test_bad_preface(mesh: Mesh, which: str) -> None:
    proc = target(mesh, which)

    def attack() -> Observation:
        results = []
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 256, b"PRI * HTTP/1.1\r\n\r\n"):
            conn = RawH2(proc.grpc, preface=False)
            try:
                conn.send(junk)
                results.append(conn.wait("closed", CLOSE_WAIT_S))
            finally:
                conn.close()
        return Observation(f"closed: {results}", all(results))

    under_attack(mesh, proc, f"bad preface on {which}", attack).judge().check()


INVALID_FRAMES = {
    "DATA on stream 0": frame(DATA, 0, 0, b"x"),
    "HEADERS on an even stream": frame(HEADERS, END_HEADERS, 2, b"\x82"),
    "WINDOW_UPDATE of 0": h2raw.window_update(0, 0),
    "SETTINGS of bad length": frame(h2raw.SETTINGS, 0, 0, b"\0\0\0"),
    "SETTINGS on a stream": frame(h2raw.SETTINGS, 0, 1, b""),
    "PING of bad length": frame(PING, 0, 0, b"1234"),
    "PUSH_PROMISE from a client": frame(PUSH_PROMISE, END_HEADERS, 1, b"\0\0\0\2\x82"),
    "CONTINUATION without HEADERS": frame(CONTINUATION, END_HEADERS, 1, b"\x82"),
    # a header announcing 16 MiB - 1 (over any MAX_FRAME_SIZE we advertise), then some of it
    "frame over MAX_FRAME_SIZE": b"\xff\xff\xff" + bytes((DATA, 0)) + struct.pack(">I", 1) + b"\0" * 65536,
    "window overflow": h2raw.window_update(0, 0x7FFFFFFF) * 2,
    "garbage frame header": b"\xff" * 9 + b"\0" * 64,
}


def test_rst_stream_on_stream_0_is_a_connection_error(mesh: Mesh) -> None:
    """RFC 9113 6.4: RST_STREAM on stream 0 is a connection error (PROTOCOL_ERROR). Found by
    this suite: the server ignores it (harmless, but not what a hardened stack does)."""
    conn = RawH2(mesh.gateway.grpc)
    try:
        conn.send(frame(h2raw.RST_STREAM, 0, 0, struct.pack(">I", 0)))
        assert conn.wait("closed", CLOSE_WAIT_S), f"RST_STREAM on stream 0 left the connection open: {conn.seen}"
    finally:
        conn.close()


@pytest.mark.parametrize("which", GATEWAY_ONLY)
def test_invalid_frames(mesh: Mesh, which: str) -> None:
    proc = target(mesh, which)

    def attack() -> Observation:
        open_ones = []
        for name, data in INVALID_FRAMES.items():
            conn = RawH2(proc.grpc)
            try:
                conn.send(data)
                if not conn.wait("closed", CLOSE_WAIT_S):
                    open_ones.append(name)
            finally:
                conn.close()
        return Observation(f"left open after: {open_ones}" if open_ones else "every connection closed",
                           not open_ones)

    under_attack(mesh, proc, f"invalid frames on {which}", attack).judge().check()
