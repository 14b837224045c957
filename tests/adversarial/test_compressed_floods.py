"""Compressed request floods, decompressed before admission (meshserve/server/inflate.py): a
tenant with a valid key floods the gateway with small compressed requests that each inflate to
24 MiB, for a model it may not use, on several connections at once, over gRPC (`grpc-encoding:
gzip` unary ModelInfer, and ModelStreamInfer calls of several such messages) and over HTTP (`Content-Encoding: gzip`). Admission can refuse them only
once they are inflated and parsed (the gRPC model name is inside the message), so what holds is
the decompressing itself: in 1 MiB slices between which other calls run, each slice charged
before it is inflated to the process's budget of request bytes held (--max-receive-bytes, 32 MiB
for this gateway), a message that does not fit refused at once (RESOURCE_EXHAUSTED / 429).

Before (gRPC): each message was inflated in one call on the event loop (~0.15 s of loop time per
24 MiB here) and every inflated message of every stream was held, with no bound across them.
The suite's rules: the good client's p99 stays under max(250 ms, 5x its baseline) with no
failure, the gateway's RSS grows < 100 MiB and comes back, and no flooded call is answered with
INTERNAL/UNKNOWN or a 5xx."""
from __future__ import annotations

import collections
import contextlib
import functools
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshserve._proto import grpc_service_pb2 as pb
from tests.adversarial import h2raw
from tests.adversarial.harness import (
    LIMIT_FLAGS,
    OTHER_KEY,
    TENANTS,
    GoodClient,
    Mesh,
    Observation,
    under_attack,
)
from tests.conftest import Proc, _wait_http_ready, start
from tests.support.http1 import connect, read_answer
from tests.support.waiting import eventually

MiB = 1 << 20
BUDGET = 32 * MiB  # the gateway's --max-receive-bytes here
INFLATED = 24 * MiB  # each flooded request, inflated
CONNECTIONS = 4
IN_FLIGHT = 6  # streams each gRPC connection keeps open
FLOOD_S = 3.0
REFUSALS = {"5", "7", "8", "3"}  # NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
STREAMED = 3  # messages of each flooded ModelStreamInfer call


@functools.cache
def bomb() -> bytes:
    """A valid ModelInferRequest for a model the attacker may not use, 24 MiB of zeros as its
    tensor, gzip-compressed (~24 KB)."""
    request = pb.ModelInferRequest(model_name="not_yours", raw_input_contents=[bytes(INFLATED)])
    request.inputs.add(name="INPUT0", datatype="UINT8", shape=[INFLATED])
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return c.compress(request.SerializeToString()) + c.flush()


@pytest.fixture(scope="module")
def stack(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The suite's mesh (a gateway with tenants before an ONNX service, the good client), with
    the gateway's --max-receive-bytes at 32 MiB."""
    yield from compressed_mesh(model_repo, tmp_path_factory.mktemp("compressed"))


def compressed_mesh(model_repo: Path, tmp: Path, good: tuple[str, ...] = ()) -> Iterator[Mesh]:
    """The mesh of ``stack`` (``good``: the good client's extra arguments), stopped after its yield."""
    (tmp / "tenants.yaml").write_text(TENANTS)
    procs: list[Proc] = []
    try:
        procs.append(start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port",
                            "0", "--model-control-mode", "explicit", "--load-model", "add_sub",
                            "--load-model", "identity_fp32", *LIMIT_FLAGS]))
        procs.insert(0, start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tmp / "tenants.yaml"),
                               "--upstream", procs[0].grpc, "--max-receive-bytes", str(BUDGET), *LIMIT_FLAGS]))
        for p in procs:
            _wait_http_ready(p.http)
        client = GoodClient(procs[0], extra=good)
        assert client.wait_past(time.monotonic(), 30), "the good client did not start"
        mesh = Mesh(procs[0], procs[1:], client, tmp)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    yield mesh
    mesh.stop()


def _on_connections(one: Callable[[], None]) -> None:
    """``one`` on CONNECTIONS threads at once (each bounded by FLOOD_S and its own waits)."""
    threads = [threading.Thread(target=one) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def _grpc_flood(hostport: str, stream: bool = False) -> Observation:
    """CONNECTIONS raw HTTP/2 connections, each keeping IN_FLIGHT compressed calls open for
    FLOOD_S seconds; the grpc-status of every answered call. ``stream``: ModelStreamInfer calls of
    STREAMED messages each (their refusals are in-band: the call itself ends OK)."""
    block = h2raw.grpc_headers(hostport, path=STREAM if stream else h2raw.INFER, key=OTHER_KEY,
                               extra=[("grpc-encoding", "gzip")])
    message = (b"\x01" + len(bomb()).to_bytes(4, "big") + bomb()) * (STREAMED if stream else 1)
    statuses: collections.Counter[str] = collections.Counter()
    unanswered = [0]
    lock = threading.Lock()

    def one() -> None:
        conn = h2raw.RawH2(hostport)
        try:
            sid, open_, sent = 1, [], []
            deadline = time.monotonic() + FLOOD_S
            while time.monotonic() < deadline and not conn.seen.closed_or_refused():
                while len(open_) < IN_FLIGHT:
                    if not conn.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, sid, block)
                                     + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, message)):
                        break  # (the server stopped reading: backpressure, nothing more is sent)
                    open_.append(sid)
                    sent.append(sid)
                    sid += 2
                if not open_:
                    break
                conn.wait_answered(open_[0], 5)
                open_ = [s for s in open_ if s not in conn.seen.statuses]
            for s in open_:
                conn.wait_answered(s, 30)
            with contextlib.suppress(AssertionError):  # (a response's trailers may follow its HEADERS)
                eventually(lambda: all(s in conn.seen.statuses for s in sent), 10, "every call's grpc-status")
            with lock:
                statuses.update(conn.seen.statuses.values())
                unanswered[0] += sum(1 for s in sent if s not in conn.seen.statuses)
        finally:
            conn.close()

    _on_connections(one)
    refused = sum(n for code, n in statuses.items() if code in REFUSALS or (stream and code == "0"))
    return Observation(f"grpc-status {dict(statuses)}, {unanswered[0]} unanswered",
                       refused > 0 and refused == sum(statuses.values()) and unanswered[0] == 0)


def _http_flood(hostport: str) -> Observation:
    """CONNECTIONS HTTP/1.1 connections posting gzip bodies for FLOOD_S seconds, one after the
    other on each; the status of every answer."""
    body = bomb()
    head = (f"POST /v2/models/not_yours/infer HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: 0\r\nx-api-key: {OTHER_KEY}\r\nContent-Encoding: gzip\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    statuses: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()

    def one() -> None:
        deadline = time.monotonic() + FLOOD_S
        sock: socket.socket | None = None
        try:
            while time.monotonic() < deadline:
                if sock is None:
                    sock = connect(hostport, timeout=10)
                    reader = sock.makefile("rb")
                sock.sendall(head + body)
                answer = read_answer(reader)
                with lock:
                    statuses[answer.status] += 1
                if answer.headers.get("connection", "").lower() == "close":
                    sock.close()
                    sock = None
        finally:
            if sock is not None:
                sock.close()

    _on_connections(one)
    ok = statuses and all(400 <= s < 500 for s in statuses)
    return Observation(f"HTTP statuses {dict(statuses)}", bool(ok))


@pytest.mark.parametrize("door", ["grpc", "http", "grpc-stream"])  # (last: what it leaves in the gateway does not reach the others)
def test_a_compressed_flood_costs_the_good_client_nothing(stack: Mesh, door: str) -> None:
    def flood() -> Observation:
        if door == "http":
            return _http_flood(stack.gateway.http)
        return _grpc_flood(stack.gateway.grpc, stream=door == "grpc-stream")

    verdict = under_attack(stack, stack.gateway, f"compressed {door} flood", flood).judge()
    print(verdict.summary())  # (the figures, shown with -s)
    verdict.check()
