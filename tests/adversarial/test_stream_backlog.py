"""Streaming clients that never read (issue 29, finding 5): a decoupled python model answers
`count` responses of 1 MiB each, as fast as it can; a client asks for 300 of them and reads
none. Before, the gateway held up to 1024 responses per request (1 GiB). Now the answers
waiting for one request are bounded in bytes (--max-stream-backlog-bytes, 8 MiB; the gRPC
writer's queue too, and the HTTP/2 server keeps one message of a stream the peer's window
stopped): the request ends with RESOURCE_EXHAUSTED and the service stops it. Judged by the
suite's rules on the gateway (harness.Verdict) while the good client runs, over SSE
(generate_stream) and gRPC (ModelStreamInfer); the gateway fronts an ONNX replica (add_sub,
the good client's) and a python service (the streaming model)."""
from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from meshserve._proto import grpc_service_pb2 as pb
from tests.adversarial import h2raw, harness
from tests.adversarial.harness import KEY, OTHER_KEY, GoodClient, Mesh, Observation, under_attack
from tests.conftest import _wait_http_ready, start
from tests.models.python_models import model_source
from tests.support.http1 import connect
from tests.support.waiting import eventually

MiB = 1 << 20
COUNT = 300
CLIENTS = 3
ENDED_WITHIN_S = 20.0

BIG_STREAM_CONFIG = ('name: "big_stream" backend: "python" max_batch_size: 0 '
                     'model_transaction_policy { decoupled: true }\n'
                     'input [ { name: "count" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                     'output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]\n')

BIG_STREAM_MODEL = model_source('''
    n = int(pb_utils.get_input_tensor_by_name(request, "count").as_numpy()[0])
    for _ in range(n):
        if sender.is_cancelled():
            break
        sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", BLOB)]))
''', head='''
BLOB = np.array([b"x" * (1 << 20)], dtype=np.object_)
''', decoupled=True)

TENANTS_WITH_STREAM = harness.TENANTS.replace('models: ["add_sub", "identity_fp32"]', 'models: ["add_sub", "big_stream"]')


@pytest.fixture(scope="module")
def streaming_mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("stream_backlog")
    repo = tmp / "python"
    (repo / "big_stream" / "1").mkdir(parents=True)
    (repo / "big_stream" / "config.pbtxt").write_text(BIG_STREAM_CONFIG.lstrip())
    (repo / "big_stream" / "1" / "model.py").write_text(BIG_STREAM_MODEL.lstrip())
    (tmp / "tenants.yaml").write_text(TENANTS_WITH_STREAM)
    procs = []
    good = None
    try:
        procs.append(start(["service", "onnx", "--repository", str(model_repo), "--grpc-port", "0", "--http-port",
                            "0", "--model-control-mode", "explicit", "--load-model", "add_sub", *harness.LIMIT_FLAGS]))
        procs.append(start(["service", "python", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                            *harness.LIMIT_FLAGS], timeout=120))
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--tenants", str(tmp / "tenants.yaml"),
                         "--upstream", procs[0].grpc, "--upstream", procs[1].grpc, *harness.LIMIT_FLAGS])
        procs.insert(0, gateway)
        _wait_http_ready(gateway.http)
        good = GoodClient(gateway)
        assert good.wait_past(time.monotonic(), 30), "the good client did not start"
        yield Mesh(gateway, procs[1:], good, tmp)
    finally:
        if good is not None:
            good.stop()
        for p in procs:
            p.stop()


def _warm(gateway: str) -> None:
    """One streamed request read to its end: the python model is loaded and answering (polled:
    on a busy machine the gateway may still count the python replica unhealthy after the
    previous test's attack, 503 "no healthy replica", until its next health check)."""
    eventually(lambda: _streamed_two(gateway), 30, "big_stream answering through the gateway")


def _streamed_two(gateway: str) -> bool:
    sock = connect(gateway, timeout=60)
    try:
        body = b'{"count": 2}'
        sock.sendall((f"POST /v2/models/big_stream/generate_stream HTTP/1.1\r\nHost: {gateway}\r\nx-api-key: {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                      ).encode() + body)
        got = b""
        while chunk := sock.recv(1 << 20):
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and got.count(b"data: ") == 2, got[:200]
        return True
    finally:
        sock.close()


def _never_read_sse(gateway: str) -> list[socket.socket]:
    socks = []
    body = f'{{"count": {COUNT}}}'.encode()
    for _ in range(CLIENTS):
        s = connect(gateway, timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.sendall((f"POST /v2/models/big_stream/generate_stream HTTP/1.1\r\nHost: {gateway}\r\nx-api-key: {OTHER_KEY}"
                   f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        socks.append(s)
    return socks


def _stream_request() -> bytes:
    req = pb.ModelInferRequest(model_name="big_stream", id="r")
    inp = req.inputs.add(name="count", datatype="INT32", shape=[1])
    del inp  # (the value travels as raw contents)
    req.raw_input_contents.append(struct.pack("<i", COUNT))
    return req.SerializeToString()


def _cancelled(service: str) -> int:
    """How many big_stream requests the python service ended as failed (CANCELED: the gateway
    gave up on them while their clients were still connected)."""
    with httpclient.InferenceServerClient(service) as c:
        stats = c.get_inference_statistics("big_stream")["model_stats"][0]["inference_stats"]
    return int(stats["fail"]["count"])


def _nobody_reads(service: str, before: int) -> bool:
    """The attack's length: the model answers 300 MiB each as fast as it can while nobody reads,
    until the service has ended every attacker's request (the gateway cancels one whose answers
    wait past --max-stream-backlog-bytes; the model stops at is_cancelled()). False when some
    was still running after ENDED_WITHIN_S (it would have sent 300 MiB by then)."""
    try:
        eventually(lambda: _cancelled(service) >= before + CLIENTS, ENDED_WITHIN_S,
                   "the service ended the unread requests")
        return True
    except AssertionError:
        return False


def _never_read_grpc(gateway: str) -> list[h2raw.RawH2]:
    conns = []
    for _ in range(CLIENTS):
        c = h2raw.RawH2(gateway, read=False)
        block = h2raw.grpc_headers(gateway, "/inference.GRPCInferenceService/ModelStreamInfer", key=OTHER_KEY)
        c.send(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1, block)
               + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, 1, h2raw.grpc_message(_stream_request())))
        conns.append(c)
    return conns


def _unread(mesh: Mesh, open_clients: Callable[[], Sequence[socket.socket | h2raw.RawH2]],
            what: str) -> Callable[[], Observation]:
    """The attack: CLIENTS clients (``open_clients``) ask for COUNT x 1 MiB each and read nothing;
    it lasts until the service has ended their requests (the backlog bound: refused)."""
    def attack() -> Observation:
        service = mesh.services[1].http
        before = _cancelled(service)
        clients = open_clients()
        t0 = time.monotonic()
        try:
            ended = _nobody_reads(service, before)
        finally:
            took = time.monotonic() - t0
            for c in clients:
                c.close()
        return Observation(f"{CLIENTS} {what} clients asked for {COUNT} x 1 MiB and read nothing: their requests "
                           f"{'ended' if ended else 'still running'} after {took:.1f} s", ended)
    return attack


def test_sse_client_that_never_reads(streaming_mesh: Mesh) -> None:
    gateway = streaming_mesh.gateway
    _warm(gateway.http)
    under_attack(streaming_mesh, gateway, "SSE clients that never read",
                 _unread(streaming_mesh, lambda: _never_read_sse(gateway.http), "generate_stream")).judge().check()


def test_grpc_stream_client_that_never_reads(streaming_mesh: Mesh) -> None:
    gateway = streaming_mesh.gateway
    _warm(gateway.http)
    under_attack(streaming_mesh, gateway, "gRPC stream clients that never read",
                 _unread(streaming_mesh, lambda: _never_read_grpc(gateway.grpc), "ModelStreamInfer")).judge().check()
