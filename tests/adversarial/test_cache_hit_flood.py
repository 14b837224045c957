"""Cache hits answered in the gateway's frame loop to a client that does not read (session 10
review; docs/security.md, "Session 10 review").

A gateway with the response cache answers a repeat gRPC ModelInfer before any Task (the at-once
hook), so its stream closes at once and SETTINGS_MAX_CONCURRENT_STREAMS does not bound how many
answers one read makes. The attacker opens its windows wide, sends 3,000 repeats of a request
whose cached answer is 1 MiB (each with its own id: the answer is a fresh copy per request) in
one burst, and reads nothing. The send budget (--conn-send-buffer-bytes, here 16 MiB) now counts
what was written since the last flush: the connection is closed, the gateway's memory stays
within the suite's bound, and the good client (add_sub through the same gateway) is not hurt.
"""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshserve._proto import grpc_service_pb2 as pb
from tests.adversarial import h2raw
from tests.adversarial.h2raw import RawH2
from tests.adversarial.harness import LIMIT_FLAGS, GoodClient, Mesh, Observation, under_attack
from tests.conftest import Proc, _wait_http_ready, start

ANSWER_FLOATS = 1 << 18  # a 1 MiB answer to an 8-byte input
BURST = 3000
BUDGET = 16 << 20
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _expand_model(repo: Path) -> None:
    """``fan_out``: y[ANSWER_FLOATS] = x[0] repeated (ONNX Expand), its answers cached."""
    import onnx
    from onnx import TensorProto, helper

    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [ANSWER_FLOATS])
    graph = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "fan_out",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ANSWER_FLOATS])], [shape])
    (repo / "fan_out" / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(repo / "fan_out" / "1" / "model.onnx"))
    (repo / "fan_out" / "config.pbtxt").write_text(
        'name: "fan_out"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {ANSWER_FLOATS} ] }} ]\n'
        "response_cache { enable: true }\n")


@pytest.fixture(scope="module")
def cached(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    repo = tmp_path_factory.mktemp("fan_out")
    shutil.copytree(model_repo / "add_sub", repo / "add_sub")  # the good client's model
    _expand_model(repo)
    procs: list[Proc] = []
    good = None
    try:
        service = start(["service", "onnx", "--repository", str(repo), "--grpc-port", "0", "--http-port", "0",
                         *LIMIT_FLAGS])
        procs.append(service)
        gateway = start(["gateway", "--grpc-port", "0", "--http-port", "0", "--upstream", service.grpc,
                         "--cache-config", "local,size=67108864", "--conn-send-buffer-bytes", str(BUDGET),
                         *LIMIT_FLAGS])
        procs.append(gateway)
        for p in procs:
            _wait_http_ready(p.http)
        good = GoodClient(gateway)
        yield Mesh(gateway, [service], good, repo)
    finally:
        if good is not None:
            good.stop()
        for p in reversed(procs):
            p.stop()


def _request(rid: str) -> bytes:
    req = pb.ModelInferRequest(model_name="fan_out", id=rid)
    req.inputs.add(name="x", datatype="FP32", shape=[1])
    req.raw_input_contents.append(b"\x00\x00\x80\x3f")  # 1.0
    return req.SerializeToString()


def test_hits_to_a_peer_that_does_not_read_stay_within_the_send_budget(cached: Mesh) -> None:
    gateway = cached.gateway
    with grpc.insecure_channel(gateway.grpc) as channel:
        infer = channel.unary_unary(INFER)
        for i in range(3):  # a miss, a hit in the pipeline's stage (indexed at the front door), a hit there
            answer = pb.ModelInferResponse.FromString(infer(_request(f"warm-{i}"), timeout=30))
            assert answer.id == f"warm-{i}" and len(answer.raw_output_contents[0]) == 4 * ANSWER_FLOATS

    def attack() -> Observation:
        raw = RawH2(gateway.grpc, read=False,
                    client_settings={h2raw.INITIAL_WINDOW_SIZE: 0x7FFFFFFF, h2raw.MAX_FRAME_SIZE: (1 << 24) - 1})
        try:
            raw.send(h2raw.window_update(0, 0x7FFFFFFF - 65535))
            block = h2raw.grpc_headers(raw.authority)
            raw.send(b"".join(h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, sid, block)
                              + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid,
                                            h2raw.grpc_message(_request(f"flood-{sid:06d}")))
                              for sid in range(1, 2 * BURST, 2)))
            raw.wait_closed_unread(15)
            seen = raw.seen
            return Observation(f"{seen}; {len(seen.answered)} of {BURST} answered",
                               seen.eof or seen.goaway == h2raw.ENHANCE_YOUR_CALM)
        finally:
            raw.close()

    verdict = under_attack(cached, gateway, "cache hits to a peer that does not read", attack)
    print(verdict.summary())
    verdict.judge().check()
    # the gateway still answers hits to a client that reads
    with grpc.insecure_channel(gateway.grpc) as channel:
        answer = pb.ModelInferResponse.FromString(channel.unary_unary(INFER)(_request("after"), timeout=30))
    assert answer.id == "after" and len(answer.raw_output_contents[0]) == 4 * ANSWER_FLOATS
