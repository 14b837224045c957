"""The sequence service through the gateway: real processes, real tritonclient, perf_analyzer.

Models (tests/models/sequence.py): ``seq_accum`` (implicit state, oldest), ``seq_ctl``
(START/END/READY/CORRID controls + state, direct), ``seq_idle`` (300 ms idle timeout).
"""
from __future__ import annotations

import os
import queue
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import Proc, _wait_http_ready, start
from tests.support.waiting import eventually

TOOL = Path(__file__).resolve().parents[3] / "shared" / "tools" / "perf_analyzer"


@dataclass
class SeqStack:
    services: list[Proc]
    gateway: Proc


def _stack(repo: Path, replicas: int) -> SeqStack:
    services: list[Proc] = []
    try:
        for _ in range(replicas):
            services.append(start(["service", "sequence", "--repository", str(repo), "--grpc-port", "0",
                                   "--http-port", "0"]))
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0",
                         *sum((["--upstream", s.grpc] for s in services), [])])
    except Exception:
        for s in services:
            s.stop()
        raise
    _wait_http_ready(gateway.http)
    return SeqStack(services, gateway)


@pytest.fixture(scope="module")
def seq_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.sequence import build

    return build(tmp_path_factory.mktemp("seqmodels"))


@pytest.fixture(scope="module")
def seq(seq_repo: Path) -> Iterator[SeqStack]:
    stack = _stack(seq_repo, 1)
    yield stack
    stack.gateway.stop()
    for s in stack.services:
        s.stop()


def _input(module: Any, value: float) -> Any:
    inp = module.InferInput("INPUT", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
    return inp


def _value(result: Any, name: str = "OUTPUT") -> float:
    return float(result.as_numpy(name).reshape(-1)[0])


# ---- gRPC streaming ------------------------------------------------------------------------

def test_grpc_stream_two_interleaved_sequences_keep_separate_state(seq: SeqStack) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(seq.gateway.grpc)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    a_values = [1.0, 2.0, 3.0, 4.0, 5.0]
    b_values = [10.0, 20.0, 30.0, 40.0, 50.0]
    n = len(a_values)
    try:
        for i in range(n):  # sent back to back, never waiting: the service must keep the order
            for sid, values in ((1001, a_values), (1002, b_values)):
                client.async_stream_infer("seq_accum", [_input(grpcclient, values[i])], request_id=f"{sid}-{i}",
                                          sequence_id=sid, sequence_start=i == 0, sequence_end=i == n - 1)
        got: dict[str, float] = {}
        for _ in range(2 * n):
            result, error = results.get(timeout=30)
            assert error is None, str(error)  # the exception's repr omits its message
            got[result.get_response().id] = _value(result)
    finally:
        client.stop_stream()
        client.close()
    assert [got[f"1001-{i}"] for i in range(n)] == list(np.cumsum(a_values))
    assert [got[f"1002-{i}"] for i in range(n)] == list(np.cumsum(b_values))


def test_grpc_stream_control_inputs_and_corrid(seq: SeqStack) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(seq.gateway.grpc)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    sids = (2**62 + 11, 12, 13)
    try:
        for i in range(4):
            for k, sid in enumerate(sids):
                client.async_stream_infer("seq_ctl", [_input(grpcclient, float(k + 1))], request_id=f"{sid}-{i}",
                                          sequence_id=sid, sequence_start=i == 0, sequence_end=i == 3)
        got = {}
        for _ in range(12):
            result, error = results.get(timeout=30)
            assert error is None, str(error)  # the exception's repr omits its message
            resp_id = result.get_response().id
            got[resp_id] = (_value(result), int(result.as_numpy("END_SEEN")[0, 0]),
                            int(result.as_numpy("CORRID_OUT")[0, 0]))
    finally:
        client.stop_stream()
        client.close()
    for k, sid in enumerate(sids):
        assert [got[f"{sid}-{i}"][0] for i in range(4)] == [(k + 1) * (i + 1) for i in range(4)]
        assert [got[f"{sid}-{i}"][1] for i in range(4)] == [0, 0, 0, 1]
        assert {got[f"{sid}-{i}"][2] for i in range(4)} == {sid}


def test_direct_filler_rows_leave_state_untouched(seq: SeqStack) -> None:
    """Sequences in slots 0 and 1; only slot 1 sends: slot 0 becomes a READY=0 row."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(seq.gateway.http)
    client.infer("seq_ctl", [_input(httpclient, 5.0)], sequence_id=31, sequence_start=True)
    client.infer("seq_ctl", [_input(httpclient, 7.0)], sequence_id=32, sequence_start=True)
    for _ in range(3):
        r = client.infer("seq_ctl", [_input(httpclient, 1.0)], sequence_id=32)
    assert _value(r) == 10.0
    r = client.infer("seq_ctl", [_input(httpclient, 1.0)], sequence_id=31, sequence_end=True)
    assert _value(r) == 6.0, "READY=0 filler executions must not change another sequence's state"
    client.infer("seq_ctl", [_input(httpclient, 0.0)], sequence_id=32, sequence_end=True)
    client.close()


# ---- HTTP unary, string ids, mixing protocols ------------------------------------------------

def test_http_unary_sequence_with_string_id_and_mixed_protocols(seq: SeqStack) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    http = httpclient.InferenceServerClient(seq.gateway.http)
    grpc = grpcclient.InferenceServerClient(seq.gateway.grpc)
    r = http.infer("seq_accum", [_input(httpclient, 2.0)], sequence_id="user-42", sequence_start=True)
    assert _value(r) == 2.0
    r = grpc.infer("seq_accum", [_input(grpcclient, 3.0)], sequence_id="user-42")
    assert _value(r) == 5.0
    r = http.infer("seq_accum", [_input(httpclient, 4.0)], sequence_id=42, sequence_start=True)
    assert _value(r) == 4.0, "string id 'user-42' and integer id 42 are different sequences"
    r = http.infer("seq_accum", [_input(httpclient, 5.0)], sequence_id="user-42", sequence_end=True)
    assert _value(r) == 10.0
    r = http.infer("seq_accum", [_input(httpclient, 1.0)], sequence_id=42, sequence_end=True)
    assert _value(r) == 5.0
    # A new START resets the state of a correlation id.
    r = http.infer("seq_accum", [_input(httpclient, 9.0)], sequence_id=42, sequence_start=True, sequence_end=True)
    assert _value(r) == 9.0
    http.close()
    grpc.close()


# ---- errors --------------------------------------------------------------------------------

def test_request_without_start_is_rejected(seq: SeqStack) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(seq.gateway.http)
    with pytest.raises(InferenceServerException) as info:
        http.infer("seq_accum", [_input(httpclient, 1.0)], sequence_id=777)
    assert info.value.status() == "400"
    assert "sequence 777" in info.value.message()
    assert "must specify the START flag on the first request of the sequence" in info.value.message()
    # ... also after the sequence ended.
    http.infer("seq_accum", [_input(httpclient, 1.0)], sequence_id=778, sequence_start=True, sequence_end=True)
    with pytest.raises(InferenceServerException, match="START flag"):
        http.infer("seq_accum", [_input(httpclient, 1.0)], sequence_id=778)
    http.close()
    grpc = grpcclient.InferenceServerClient(seq.gateway.grpc)
    with pytest.raises(InferenceServerException) as ginfo:
        grpc.infer("seq_accum", [_input(grpcclient, 1.0)], sequence_id="never-started")
    assert ginfo.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "sequence never-started" in ginfo.value.message()
    grpc.close()


def test_request_without_sequence_id_is_rejected(seq: SeqStack) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(seq.gateway.http)
    with pytest.raises(InferenceServerException) as info:
        http.infer("seq_accum", [_input(httpclient, 1.0)])
    assert info.value.status() == "400"
    assert "must specify a non-zero or non-empty correlation ID" in info.value.message()
    http.close()
    grpc = grpcclient.InferenceServerClient(seq.gateway.grpc)
    with pytest.raises(InferenceServerException) as ginfo:
        grpc.infer("seq_ctl", [_input(grpcclient, 1.0)], sequence_id=0, sequence_start=True)
    assert ginfo.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "correlation ID" in ginfo.value.message()
    grpc.close()


def test_a_string_sequence_id_is_at_most_its_bound(seq: SeqStack) -> None:
    """A string sequence id is kept while its sequence lives (the service's batcher, the gateway's
    tenant binding), so its length is bounded (infer_checks.SEQUENCE_ID_MAX): past it 400 /
    INVALID_ARGUMENT through the gateway (unary and streamed) and direct to the service, and
    nothing is started. The code before started each one (300 open sequences of 1 MB ids held
    ~290 MB of the service until they went idle)."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from meshserve.protocol.infer_checks import SEQUENCE_ID_MAX

    longest, past = "L" * SEQUENCE_ID_MAX, "P" * (SEQUENCE_ID_MAX + 1)
    said = f"a string sequence_id may have at most {SEQUENCE_ID_MAX} characters, this one has {SEQUENCE_ID_MAX + 1}"
    for where in (seq.gateway, seq.services[0]):
        http = httpclient.InferenceServerClient(where.http)
        with pytest.raises(InferenceServerException) as info:
            http.infer("seq_accum", [_input(httpclient, 1.0)], sequence_id=past, sequence_start=True)
        assert info.value.status() == "400" and said in info.value.message()
        grpc = grpcclient.InferenceServerClient(where.grpc)
        with pytest.raises(InferenceServerException) as ginfo:
            grpc.infer("seq_accum", [_input(grpcclient, 1.0)], sequence_id=past + "g", sequence_start=True)
        assert ginfo.value.status() == "StatusCode.INVALID_ARGUMENT" and "may have at most" in ginfo.value.message()
        answers: queue.Queue[Any] = queue.Queue()
        grpc.start_stream(lambda result, error, out=answers: out.put((result, error)))
        grpc.async_stream_infer("seq_accum", [_input(grpcclient, 1.0)], sequence_id=past, sequence_start=True)
        grpc.async_stream_infer("seq_accum", [_input(grpcclient, 2.0)], sequence_id=longest, sequence_start=True,
                                sequence_end=True)
        refused, served = answers.get(timeout=30), answers.get(timeout=30)
        grpc.stop_stream()
        assert refused[0] is None and said in refused[1].message()  # (in band: the stream goes on)
        assert served[1] is None and _value(served[0]) == 2.0
        r = http.infer("seq_accum", [_input(httpclient, 3.0)], sequence_id=longest, sequence_start=True,
                       sequence_end=True)
        assert _value(r) == 3.0
        http.close()
        grpc.close()


# (how seq_accum's config is changed, what Triton's rule makes of it: 2 sequences at once)
OLDEST_SLOTS = {
    # without max_candidate_sequences: max(1, max_batch_size) per instance
    "default": (("max_batch_size: 8", "max_batch_size: 2"), ("max_candidate_sequences: 16 ", "")),
    # max_candidate_sequences per instance: 1 x 2 instances
    "per instance": (("max_candidate_sequences: 16", "max_candidate_sequences: 1"), ("count: 1", "count: 2")),
}


@pytest.mark.parametrize("case", list(OLDEST_SLOTS))
def test_oldest_holds_triton_s_candidates(seq_repo: Path, tmp_path: Path, case: str) -> None:
    """oldest's candidates as Triton counts them (services/sequence/model.py:policy_from_config):
    per instance, max_candidate_sequences or without it max(1, max_batch_size). Both configs
    here hold 2 sequences at once; the next new sequence waits in the backlog until one ends.
    The code before took every sequence at once without max_candidate_sequences (each open one
    holding its id and state until it went idle), and 1 in all for 1 per instance x 2."""
    import shutil

    import grpc as grpc_core
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    shutil.copytree(seq_repo / "seq_accum", tmp_path / "seq_open")
    config = (tmp_path / "seq_open" / "config.pbtxt").read_text().replace('name: "seq_accum"', 'name: "seq_open"')
    # (an idle timeout longer than the test, however slow the machine: none of the two goes idle)
    for old, new in (("max_sequence_idle_microseconds: 5000000", "max_sequence_idle_microseconds: 600000000"),
                     *OLDEST_SLOTS[case]):
        assert old in config
        config = config.replace(old, new)
    (tmp_path / "seq_open" / "config.pbtxt").write_text(config)
    service = start(["service", "sequence", "--repository", str(tmp_path), "--grpc-port", "0", "--http-port", "0"])
    try:
        c = grpcclient.InferenceServerClient(service.grpc)
        for sid in (1, 2):  # the two places, left open
            assert _value(c.infer("seq_open", [_input(grpcclient, float(sid))], sequence_id=sid,
                                  sequence_start=True, client_timeout=30.0)) == float(sid)
        with pytest.raises(InferenceServerException) as info:  # a third waits for a place
            c.infer("seq_open", [_input(grpcclient, 3.0)], sequence_id=3, sequence_start=True, client_timeout=2.0)
        assert info.value.status() == str(grpc_core.StatusCode.DEADLINE_EXCEEDED), info.value
        assert _value(c.infer("seq_open", [_input(grpcclient, 1.0)], sequence_id=1, sequence_end=True)) == 2.0
        assert _value(c.infer("seq_open", [_input(grpcclient, 1.0)], sequence_id=2, sequence_end=True)) == 3.0
        c.close()
    finally:
        service.stop()


def test_control_and_state_inputs_are_not_client_visible(seq: SeqStack) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(seq.gateway.http)
    md = http.get_model_metadata("seq_ctl")
    assert [i["name"] for i in md["inputs"]] == ["INPUT"]
    assert [o["name"] for o in md["outputs"]] == ["OUTPUT", "END_SEEN", "CORRID_OUT"]
    assert "sequence" in http.get_server_metadata()["extensions"]
    config = http.get_model_config("seq_ctl")
    assert "sequence_batching" in config and "dynamic_batching" not in config
    start_in = httpclient.InferInput("START", [1, 1], "FP32")
    start_in.set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="unexpected inference input 'START'"):
        http.infer("seq_ctl", [_input(httpclient, 1.0), start_in], sequence_id=5, sequence_start=True)
    http.close()


IDLE_S = 0.3  # seq_idle's max_sequence_idle_microseconds


def test_idle_sequence_expires(seq: SeqStack) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    http = httpclient.InferenceServerClient(seq.gateway.http)
    # A request within the idle window continues the sequence. "Within" is what the client can
    # prove: the first request's send to the second's answer, an upper bound of the service's idle
    # gap. A busy machine may stretch it past 300 ms; such a try proves nothing and a new
    # sequence tries again (bounded), rather than the window being taken for granted.
    for corrid in range(55, 65):
        t0 = time.monotonic()
        assert _value(http.infer("seq_idle", [_input(httpclient, 1.0)], sequence_id=corrid,
                                 sequence_start=True)) == 1.0
        try:
            second: object = _value(http.infer("seq_idle", [_input(httpclient, 1.0)], sequence_id=corrid))
        except InferenceServerException as exc:
            second = exc
        if time.monotonic() - t0 < IDLE_S:
            assert second == 2.0, second
            break
    else:
        pytest.fail("no two requests of a sequence made it within 300 ms in 10 tries: the machine is too busy")
    # Idle past the window: the service releases it, by its own clock (its log line says after how
    # long, polled here rather than slept for), and a request without START is refused.
    service = seq.services[0]

    def released() -> float | None:
        said = f"sequence {corrid} idle for "
        for line in list(service.output):
            if said in line:
                return float(line.split(said, 1)[1].split(" ms", 1)[0])
        return None

    idle_ms = eventually(released, 20, f"the service's release of sequence {corrid}")
    assert idle_ms is not None
    assert idle_ms >= IDLE_S * 1000, idle_ms  # never released before its idle window
    with pytest.raises(InferenceServerException) as info:
        http.infer("seq_idle", [_input(httpclient, 1.0)], sequence_id=corrid, sequence_end=True)
    assert info.value.status() == "400" and "START flag" in info.value.message()
    # The id can start over, from a fresh state.
    assert _value(http.infer("seq_idle", [_input(httpclient, 4.0)], sequence_id=corrid, sequence_start=True,
                             sequence_end=True)) == 4.0
    http.close()


# ---- TorchScript -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["KIND_CPU", "KIND_GPU"])
def test_torchscript_sequence_model(tmp_path: Path, kind: str) -> None:
    """The state round trip through a TorchScript model; KIND_GPU (where CUDA is) moves the
    state to the device and back at every step."""
    torch = pytest.importorskip("torch")
    if kind == "KIND_GPU" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import tritonclient.grpc as grpcclient

    from tests.models.sequence import build_torch

    stack = _stack(build_torch(tmp_path / "models", kind), 1)
    try:
        client = grpcclient.InferenceServerClient(stack.gateway.grpc)
        outs = []
        for sid in (1, 2):
            for i, v in enumerate((1.0, 2.0, 3.0)):
                r = client.infer("seq_accum_pt", [_input(grpcclient, v * sid)], sequence_id=sid,
                                 sequence_start=i == 0, sequence_end=i == 2)
                outs.append(_value(r))
        assert outs == [1.0, 3.0, 6.0, 2.0, 6.0, 12.0]
        client.close()
    finally:
        stack.gateway.stop()
        for s in stack.services:
            s.stop()


# ---- tracing -------------------------------------------------------------------------------

def test_sequence_batches_are_traced(seq_repo: Path) -> None:
    pytest.importorskip("opentelemetry.proto")
    import secrets
    from concurrent import futures

    import grpc
    import tritonclient.grpc as grpcclient
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from tests.integration.test_tracing import Receiver

    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_SAMPLER": "parentbased_always_off",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": ""}
    service = start(["service", "sequence", "--repository", str(seq_repo), "--grpc-port", "0"], env=env)
    try:
        trace_id = secrets.token_hex(16)
        with grpcclient.InferenceServerClient(service.grpc) as c:
            r = c.infer("seq_accum", [_input(grpcclient, 2.0)], sequence_id=9, sequence_start=True,
                        sequence_end=True, headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        assert _value(r) == 2.0
        want = {"service.queue", "service.batch", "service.compute"}
        spans = receiver.wait(lambda spans: want <= {s.name for s in spans if s.trace_id == trace_id})
        assert want <= {s.name for s in spans if s.trace_id == trace_id}
    finally:
        service.stop()
        server.stop(0)


# ---- pinning across replicas ---------------------------------------------------------------

def test_gateway_pins_each_sequence_to_one_replica(seq_repo: Path) -> None:
    import tritonclient.grpc as grpcclient

    stack = _stack(seq_repo, 2)
    try:
        client = grpcclient.InferenceServerClient(stack.gateway.grpc)
        direct = [grpcclient.InferenceServerClient(s.grpc) for s in stack.services]

        def successes() -> list[int]:
            return [c.get_inference_statistics("seq_accum").model_stats[0].inference_stats.success.count
                    for c in direct]

        used = set()
        for sid in range(5000, 5012):
            before = successes()
            total = 0.0
            for i in range(6):
                r = client.infer("seq_accum", [_input(grpcclient, float(i))], sequence_id=sid,
                                 sequence_start=i == 0, sequence_end=i == 5)
                total += i
                assert _value(r) == total
            delta = [a - b for a, b in zip(successes(), before, strict=True)]
            assert sorted(delta) == [0, 6], f"sequence {sid} was split across replicas: {delta}"
            used.add(delta.index(6))
        assert used == {0, 1}, "12 sequences all hashed to one replica"
        for c in (client, *direct):
            c.close()
    finally:
        stack.gateway.stop()
        for s in stack.services:
            s.stop()


# ---- perf_analyzer -------------------------------------------------------------------------

@pytest.mark.skipif(not TOOL.exists() and not os.environ.get("CI"), reason=f"perf_analyzer not found at {TOOL}")
@pytest.mark.parametrize("streaming", [False, True], ids=["grpc", "grpc-streaming"])
def test_perf_analyzer_sequences(seq: SeqStack, streaming: bool, tmp_path: Path) -> None:
    cmd = [str(TOOL), "-m", "seq_accum", "-u", seq.gateway.grpc, "-i", "grpc", "--sequence-length", "20",
           "--concurrency-range", "4", "--measurement-interval", "500", "--stability-percentage", "999",
           "--max-trials", "6", "-f", str(tmp_path / "pa.csv")]
    if streaming:
        cmd.append("--streaming")
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(seq.gateway.grpc)
    failed_before = client.get_inference_statistics("seq_accum").model_stats[0].inference_stats.fail.count
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Inferences/Second" in (tmp_path / "pa.csv").read_text()
    stats = client.get_inference_statistics("seq_accum").model_stats[0]
    client.close()
    assert stats.inference_stats.fail.count == failed_before and stats.inference_stats.success.count >= 20
