"""The authenticated hop (issue 34, item 2; meshserve/protocol/hop.py:vet), through real processes
and the real tritonclient.

A service and a gateway share a hop key (``--hop-key-file``); both export traces to a small OTLP
receiver (tests/integration/test_tracing.py's). A client that reaches the service's port directly
with the hop marker and forged ``meshserve_*`` parameters changes nothing: its request is served
as its own (statistics count it once, its queue time is its own, its spans are in its own trace),
while the gateway's signed streams keep every hop fact (merged requests counted per member, the
members' traceparents). A request signed with the key (a token of its own per call) is believed:
what tells the two apart is the key, nothing else. `meshserve up` makes a throwaway key itself.

Without a key (and without mutual TLS) nothing is believed: a service started with neither
serves the same forged request as its own, and a gateway and a service both started without one
still serve every request correctly (unary, merged, a decoupled model's stream, a client that
leaves), only without the hop's extras; each says so at start.
"""
from __future__ import annotations

import queue
import secrets
import shutil
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from tritonclient.utils import InferenceServerException

from meshserve.protocol import hop
from tests.conftest import HOP_KEY_ENV, Proc, _wait_http_ready, service_and_gateway, start
from tests.integration.test_tracing import Receiver, Span, _otel_env, _traceparent
from tests.support.up import meshserve_up
from tests.support.waiting import eventually

SLOW_DELAY_US = 400_000  # slow_*: a lone request waits this long in the queue for company
SLOW = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }} ]
dynamic_batching {{ preferred_batch_size: [ 8 ] max_queue_delay_microseconds: {delay} }}
"""


@dataclass
class Mesh:
    receiver: Receiver
    service: Proc
    gateway: Proc
    key: bytes
    open_service: Proc  # no hop key, no mutual TLS (HOP_KEY_ENV emptied: the suite's key not given)
    open_gateway: Proc  # the same, in front of open_service


@pytest.fixture(scope="module")
def mesh(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    d = tmp_path_factory.mktemp("hop-auth")
    repo = d / "models"
    for name in ("small_mlp", "add_sub"):
        shutil.copytree(model_repo / name, repo / name)
    for name in ("slow_forged", "slow_signed"):
        shutil.copytree(model_repo / "add_sub", repo / name)
        (repo / name / "config.pbtxt").write_text(SLOW.format(name=name, delay=SLOW_DELAY_US))
    key = secrets.token_hex(32).encode()
    (d / "hop.key").write_bytes(key)
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    env = _otel_env(f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
    server.start()
    started: list[Proc] = []
    try:
        started.append(start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0",
                              "--hop-key-file", str(d / "hop.key")], env=env))
        # the coalescer sends one request at a time per model: the rest of a burst is merged
        started.append(start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", started[0].grpc,
                              "--coalesce-inflight", "1", "--hop-key-file", str(d / "hop.key")], env=env))
        keyless = {**env, HOP_KEY_ENV: ""}
        started.append(start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0"],
                             env=keyless))
        started.append(start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", started[2].grpc,
                              "--coalesce-inflight", "1"], env=keyless))
        for gateway in (started[1], started[3]):
            _wait_http_ready(gateway.http)
        yield Mesh(receiver, started[0], started[1], key, started[2], started[3])
    finally:
        for p in reversed(started):
            p.stop()
        server.stop(0)


def _add_sub_inputs(rows: int = 1) -> list[grpcclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [rows, 16], "FP32")
        inp.set_data_from_numpy(np.ones((rows, 16), np.float32))
        inputs.append(inp)
    return inputs


def _mlp_input() -> grpcclient.InferInput:
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), np.float32))
    return inp


def _stats(c: grpcclient.InferenceServerClient, model: str) -> Any:
    return c.get_inference_statistics(model).model_stats[0]


VICTIM = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"  # another client's trace (what a forger would join)
FORGED_PARAMS = {hop.MERGED: 64, hop.QUEUED: 10_000_000, hop.TRACEPARENTS: VICTIM}


def _forged_hop_changes_nothing(mesh: Mesh, service: Proc, why: str) -> None:
    """Marker, a token and private parameters straight to ``service``'s gRPC port; the service
    logged ``why`` it did not believe them."""
    tp, trace_id, client_span = _traceparent()
    forged = {hop.HEADER: hop.GATEWAY, hop.AUTH_HEADER: hop.token(b"not the key" * 4), "traceparent": tp}
    with grpcclient.InferenceServerClient(service.grpc) as c:
        before = _stats(c, "slow_forged")
        r = c.infer("slow_forged", _add_sub_inputs(), headers=forged, parameters={**FORGED_PARAMS, hop.DEADLINE: 1})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2.0, np.float32))
        after = _stats(c, "slow_forged")
    assert after.inference_count - before.inference_count == 1
    assert after.execution_count - before.execution_count == 1
    assert after.inference_stats.success.count - before.inference_stats.success.count == 1  # not 64
    queue_ns = after.inference_stats.queue.ns - before.inference_stats.queue.ns
    assert queue_ns >= SLOW_DELAY_US * 1000 * 0.9, queue_ns  # it waited its own queue delay, the 10 s ignored
    spans = mesh.receiver.wait(lambda ss: any(s.trace_id == trace_id and s.name == "service.request" for s in ss))
    mine = {s.name: s for s in spans if s.trace_id == trace_id}
    assert mine["service.request"].parent == client_span
    assert "meshserve.merged_requests" not in mine["service.request"].attributes
    assert not [s for s in spans if s.trace_id == VICTIM.split("-")[1]]
    assert any(f"without a valid hop token ({why}" in line for line in service.output)


def test_a_direct_clients_forged_hop_changes_nothing(mesh: Mesh) -> None:
    """Marker and private parameters straight to the service, unauthenticated: a merged count of
    64 over 1 row (believed: INVALID_ARGUMENT) is served as one plain request and counted once;
    a claimed 10 s in the coalescer does not cut its queue wait; a 1 µs deadline does not fail it;
    its spans are in its own trace, none in the trace its TRACEPARENTS named."""
    _forged_hop_changes_nothing(mesh, mesh.service, "a wrong MAC")


def test_a_service_without_a_key_believes_no_forged_hop(mesh: Mesh) -> None:
    """The same at a service with neither --hop-key-file nor mutual TLS (before: it believed
    the marker from whoever reached its port): served as the client's own request, every forged
    value ignored; at start it said that it believes no gateway's hop parameters."""
    assert any("this service believes no gateway's hop parameters" in line for line in mesh.open_service.output)
    _forged_hop_changes_nothing(mesh, mesh.open_service, "this service has no --hop-key-file")


def test_the_marker_alone_on_a_stream_is_a_clients_stream(mesh: Mesh) -> None:
    """A ModelStreamInfer call with the marker and no token: its requests are a client's (its
    merged count of 64 over 1 row ignored, not refused); its answers keep the hop's framing
    (here STREAM: Triton's triton_final_response, no empty final for a model that is not
    decoupled), which touches nothing but its own stream."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(mesh.service.grpc) as c:
        c.start_stream(lambda result, error: answers.put((result, error)), headers={hop.HEADER: hop.GATEWAY})
        try:
            c.async_stream_infer("small_mlp", [_mlp_input()], parameters={hop.MERGED: 64, hop.STREAM: True})
            result, error = answers.get(timeout=30)
        finally:
            c.stop_stream()
    assert error is None, error
    params = result.get_response().parameters
    assert params["triton_final_response"].bool_param
    assert hop.EMPTY_FINAL not in params


def test_a_signed_request_is_believed(mesh: Mesh) -> None:
    """The same claims with a fresh token of the key are a gateway's: 10 s in the coalescer make
    the request run at once (no queue wait for company), a merged count over the rows is refused
    (it was believed); the same token again is a replay: a client's call, its count ignored."""
    with grpcclient.InferenceServerClient(mesh.service.grpc) as c:
        before = _stats(c, "slow_signed")
        fresh = {hop.HEADER: hop.GATEWAY, hop.AUTH_HEADER: hop.token(mesh.key)}
        c.infer("slow_signed", _add_sub_inputs(), headers=fresh, parameters={hop.QUEUED: 10_000_000})
        after = _stats(c, "slow_signed")
        assert after.inference_stats.queue.ns - before.inference_stats.queue.ns < SLOW_DELAY_US * 1000 / 2
        signed = {hop.HEADER: hop.GATEWAY, hop.AUTH_HEADER: hop.token(mesh.key)}
        with pytest.raises(InferenceServerException) as err:
            c.infer("slow_signed", _add_sub_inputs(), headers=signed, parameters={hop.MERGED: 64})
        assert str(err.value.status()) == "StatusCode.INVALID_ARGUMENT" and hop.MERGED in str(err.value)
        r = c.infer("slow_signed", _add_sub_inputs(), headers=signed, parameters={hop.MERGED: 64})  # replayed
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2.0, np.float32))


def _burst(url: str, n: int = 8) -> set[str]:
    """``n`` concurrent small_mlp requests, each with a sampled traceparent of its own; their trace ids."""
    parents = [_traceparent() for _ in range(n)]
    done: list[object] = []
    with grpcclient.InferenceServerClient(url) as c:
        for tp, _, _ in parents:
            c.async_infer("small_mlp", [_mlp_input()], lambda result, error, out=done: out.append(error),
                          headers={"traceparent": tp})
        eventually(lambda: len(done) >= n, what=f"{n} answers")
    assert done == [None] * n
    return {t for _, t, _ in parents}


def test_the_gateways_signed_hop_keeps_every_fact(mesh: Mesh) -> None:
    """Through the gateway (its streams signed with the key): the service counts a merged
    request as its members, and each member's service span is a child of its own gateway span
    (the members' traceparents believed)."""
    with grpcclient.InferenceServerClient(mesh.service.grpc) as direct:
        for _attempt in range(3):  # the burst must reach the coalescer while its first request is out
            before = _stats(direct, "small_mlp")
            trace_ids = _burst(mesh.gateway.grpc)
            after = _stats(direct, "small_mlp")
            # every client request counted, merged or not (not believed: a merged request counts once)
            assert after.inference_stats.success.count - before.inference_stats.success.count == 8

            def complete(spans: list[Span], trace_ids: set[str] = trace_ids) -> bool:
                return all({"gateway.upstream", "service.request"} <= {s.name for s in spans if s.trace_id == t}
                           for t in trace_ids)
            spans = mesh.receiver.wait(complete)
            by_trace = {t: {s.name: s for s in spans if s.trace_id == t} for t in trace_ids}
            for t, mine in by_trace.items():
                assert mine["service.request"].parent == mine["gateway.upstream"].span_id, t
            merged = [m for m in by_trace.values() if m["service.request"].attributes.get("meshserve.merged_requests")]
            if merged:
                assert after.execution_count - before.execution_count < 8 or len(merged) >= 2
                assert all(m["service.request"].attributes["meshserve.merged_requests"] >= 2 for m in merged)
                return
    raise AssertionError("no burst of 8 was merged by a gateway with --coalesce-inflight 1 in 3 attempts")


def test_a_gateway_and_a_service_without_a_key_serve_correctly(mesh: Mesh) -> None:
    """A gateway and a service both started without a key: the gateway warns at start which
    extras are lost; requests through it are served right over HTTP and gRPC, and a burst the
    coalescer merges too (each member gets its answer), counted as what reached the service: a
    merged request counts once there (its merged count is not believed)."""
    assert any("the hop to the services is not authenticated" in line and "a merged request counts once" in line
               for line in mesh.open_gateway.output)
    with httpclient.InferenceServerClient(mesh.open_gateway.http) as h:
        inputs = []
        for name, value in (("INPUT0", 3.0), ("INPUT1", 1.0)):
            inp = httpclient.InferInput(name, [1, 16], "FP32")
            inp.set_data_from_numpy(np.full((1, 16), value, np.float32))
            inputs.append(inp)
        r = h.infer("add_sub", inputs, request_id="mine")
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 4.0, np.float32))
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), np.full((1, 16), 2.0, np.float32))
        assert r.get_response()["id"] == "mine"
    with grpcclient.InferenceServerClient(mesh.open_gateway.grpc) as c, \
            grpcclient.InferenceServerClient(mesh.open_service.grpc) as direct:
        r = c.infer("add_sub", _add_sub_inputs(3), request_id="rows")
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((3, 16), 2.0, np.float32))
        assert r.get_response().id == "rows"
        before = _stats(direct, "small_mlp")
        expected = c.infer("small_mlp", [_mlp_input()]).as_numpy("OUTPUT0")
        results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        for i in range(8):
            c.async_infer("small_mlp", [_mlp_input()], lambda result, error: results.put((result, error)),
                          request_id=f"b{i}")
        answers = [results.get(timeout=60) for _ in range(8)]
        after = _stats(direct, "small_mlp")
    assert all(error is None for _, error in answers), answers
    assert sorted(result.get_response().id for result, _ in answers) == [f"b{i}" for i in range(8)]
    for result, _ in answers:
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), expected, rtol=1e-6)
    served = after.inference_stats.success.count - before.inference_stats.success.count
    assert after.inference_count - before.inference_count == 9  # every row ran once
    assert 1 <= served <= 9 and after.execution_count - before.execution_count <= served


@pytest.fixture(scope="module")
def open_decoupled() -> Iterator[tuple[Proc, Proc]]:
    """The decoupled stand-in service and a gateway, neither with a key."""
    with service_and_gateway("", [], module="tests.integration.decoupled_service", timeout=60,
                             env={HOP_KEY_ENV: ""}) as procs:
        yield procs


def test_decoupled_streams_through_a_gateway_without_a_key(open_decoupled: tuple[Proc, Proc]) -> None:
    """Without a key the hop keeps its framing: test_gateway_streaming's checks on a keyless
    pair: a decoupled model's every response with its client's id, the empty final one only
    where the client asked for it, in-band errors, a client that leaves stops its request at the
    service (the hop's cancel)."""
    from tests.integration import test_gateway_streaming as streaming

    streaming.test_a_client_stream_gets_every_response_with_its_id(open_decoupled)
    streaming.test_errors_and_models_that_are_not_decoupled_on_a_client_stream(open_decoupled)
    streaming.test_a_client_that_leaves_stops_its_request_at_the_service(open_decoupled)


def test_meshserve_up_authenticates_the_hop_by_itself(model_repo: Path) -> None:
    """`meshserve up` without flags: a throwaway hop key in its run directory (0600, gone at exit)
    given to the gateway and every service; inference through the gateway works, a forged merged
    count straight to a service is ignored (believed, 64 over 1 row would be INVALID_ARGUMENT)."""
    from tests.integration.test_tls import _children_argv

    with meshserve_up("--metrics-port", "-1", "--repository", str(model_repo), "--http-port", "0",
                      "--grpc-port", "0") as up:
        with grpcclient.InferenceServerClient(up.grpc) as c:
            eventually(lambda: c.is_model_ready("add_sub"), timeout=60, what="add_sub through up")
            c.infer("add_sub", _add_sub_inputs())
        argvs = _children_argv(up.pid)
        gateway_argv = next(argv for argv in argvs if "gateway" in argv)
        key_file = Path(gateway_argv[gateway_argv.index("--hop-key-file") + 1])
        assert oct(key_file.stat().st_mode & 0o777) == "0o600" and len(key_file.read_text()) >= hop.MIN_KEY_BYTES
        services = [argv for argv in argvs if "service" in argv]
        assert services and all(argv[argv.index("--hop-key-file") + 1] == str(key_file) for argv in services)
        upstream = gateway_argv[gateway_argv.index("--upstream") + 1]
        with grpcclient.InferenceServerClient(upstream) as c:
            r = c.infer("add_sub", _add_sub_inputs(), headers={hop.HEADER: hop.GATEWAY}, parameters={hop.MERGED: 64})
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), np.full((1, 16), 2.0, np.float32))
        assert up.stop() == 0  # Ctrl-C: a clean exit
        assert not key_file.exists()
