"""Sequence service pieces without a server: request parameters, controls, states, runtime config."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError
from services.sequence.core import with_hidden_tensors
from services.sequence.model import parse_controls, parse_states, policy_from_config, sequence_control

CONFIG = text_format.Parse("""
name: "acc" backend: "onnxruntime" max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 250000
  oldest { max_candidate_sequences: 3 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100 }
  control_input [
    { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "E" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "R" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [ { input_name: "SI" output_name: "SO" data_type: TYPE_FP32 dims: [ 2 ]
            initial_state: { data_type: TYPE_FP32 dims: [ 2 ] data_file: "init.bin" name: "init" } } ]
}
""", mc.ModelConfig())


def request(**params: tuple[str, object]) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="acc")
    for name, (field, value) in params.items():
        setattr(req.parameters[name], field, value)
    return req


def test_sequence_parameters_accept_every_member() -> None:
    assert sequence_control(request(sequence_id=("int64_param", 5), sequence_start=("bool_param", True)),
                            "acc").corrid == 5
    c = sequence_control(request(sequence_id=("uint64_param", 2**64 - 1), sequence_end=("int64_param", 1)), "acc")
    assert (c.corrid, c.start, c.end) == (2**64 - 1, False, True)
    assert sequence_control(request(sequence_id=("int64_param", -1)), "acc").corrid == 2**64 - 1
    c = sequence_control(request(sequence_id=("string_param", "abc"), sequence_start=("string_param", "true")), "acc")
    assert (c.corrid, c.start) == ("abc", True)
    assert sequence_control(request(sequence_id=("uint64_param", 3), sequence_start=("uint64_param", 1)), "acc").start


@pytest.mark.parametrize("params", [{}, {"sequence_id": ("int64_param", 0)}, {"sequence_id": ("string_param", "")}])
def test_missing_correlation_id(params: dict[str, tuple[str, object]]) -> None:
    with pytest.raises(InferError, match="must specify a non-zero or non-empty correlation ID"):
        sequence_control(request(**params), "acc")


def test_bad_parameter_types() -> None:
    with pytest.raises(InferError, match="sequence_id"):
        sequence_control(request(sequence_id=("bool_param", True)), "acc")
    with pytest.raises(InferError, match="sequence_start"):
        sequence_control(request(sequence_id=("int64_param", 1), sequence_start=("double_param", 0.5)), "acc")


def test_controls_states_and_policy(tmp_path: Path) -> None:
    controls = {c.name: c for c in parse_controls(CONFIG.sequence_batching)}
    assert controls["S"].dtype is np.int32 and controls["S"].false_true == (0, 1)
    assert controls["E"].dtype is np.float32
    assert controls["R"].dtype is np.bool_ and controls["R"].false_true == (False, True)
    assert controls["C"].dtype is np.object_
    with pytest.raises(InferError, match="initial state file"):
        parse_states(CONFIG.sequence_batching, tmp_path, "acc")
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "init.bin").write_bytes(np.array([1.5, -2], dtype=np.float32).tobytes())
    (state,) = parse_states(CONFIG.sequence_batching, tmp_path, "acc")
    assert (state.input_name, state.output_name) == ("SI", "SO")
    assert state.initial.tolist() == [1.5, -2.0]
    policy = policy_from_config(CONFIG, instance_count=2)
    assert (policy.strategy, policy.slots_per_instance, policy.instance_count) == ("oldest", 4, 2)
    # Triton's candidates are per instance: max_candidate_sequences 3 x 2 instances, shared here
    assert (policy.max_candidate_sequences, policy.preferred_batch_sizes) == (6, (2, 4))
    assert (policy.max_queue_delay_ns, policy.idle_ns) == (100_000, 250_000_000)
    # oldest without max_candidate_sequences: Triton's default, max(1, max_batch_size) per instance
    # (it was unbounded: every sequence left open held its id and state until it went idle)
    unset = mc.ModelConfig()
    unset.CopyFrom(CONFIG)
    unset.sequence_batching.oldest.ClearField("max_candidate_sequences")
    assert policy_from_config(unset, instance_count=2).capacity == 8
    unset.max_batch_size = 0
    assert policy_from_config(unset, instance_count=1).capacity == 1


def test_runtime_config_lists_hidden_tensors_but_the_client_config_does_not() -> None:
    runtime = with_hidden_tensors(CONFIG)
    assert [(t.name, t.data_type) for t in runtime.input] == [
        ("INPUT", mc.TYPE_FP32), ("S", mc.TYPE_INT32), ("E", mc.TYPE_FP32), ("R", mc.TYPE_BOOL),
        ("C", mc.TYPE_STRING), ("SI", mc.TYPE_FP32)]
    assert [t.name for t in runtime.output] == ["OUTPUT", "SO"]
    assert [t.name for t in CONFIG.input] == ["INPUT"]
