"""Stateful (sequence_batching) ONNX test models, generated with onnx.helper.

* ``seq_accum``: implicit state, oldest strategy. OUTPUT = STATE_IN + INPUT; STATE_OUT = OUTPUT.
* ``seq_ctl``: START / END / READY / CORRID control inputs and implicit state, direct strategy.
  ACC = READY ? INPUT + (1 - START) * STATE_IN : STATE_IN; OUTPUT = STATE_OUT = ACC;
  END_SEEN = END; CORRID_OUT = CORRID.
* ``seq_idle``: ``seq_accum`` with a 300 ms ``max_sequence_idle_microseconds``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.models import onnx_model as _model
from tests.support.models import write

ACCUM_CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  oldest {{ max_candidate_sequences: 16 max_queue_delay_microseconds: 0 }}
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state: {{ data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zeros" }} }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

CTL_CONFIG = """name: "seq_ctl"
platform: "onnxruntime_onnx"
max_batch_size: 4
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "END_SEEN" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "CORRID_OUT" data_type: TYPE_UINT64 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def _save(repo: Path, name: str, config: str, model: Any) -> None:
    write(repo, name, config, {1: model})


def build(repo: Path) -> Path:
    from onnx import TensorProto, helper

    fp32, int32, u64, boolean = TensorProto.FLOAT, TensorProto.INT32, TensorProto.UINT64, TensorProto.BOOL

    def vi(name: str, t: int) -> Any:
        return helper.make_tensor_value_info(name, t, ["batch", 1])

    accum = _model([helper.make_node("Add", ["STATE_IN", "INPUT"], ["OUTPUT"]),
                    helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"])], "seq_accum",
                   [vi("INPUT", fp32), vi("STATE_IN", fp32)], [vi("OUTPUT", fp32), vi("STATE_OUT", fp32)])
    repo.mkdir(parents=True, exist_ok=True)
    _save(repo, "seq_accum", ACCUM_CONFIG.format(name="seq_accum", idle_us=5_000_000), accum)
    _save(repo, "seq_idle", ACCUM_CONFIG.format(name="seq_idle", idle_us=300_000), accum)

    ctl = _model([
        helper.make_node("Cast", ["READY"], ["ready_f"], to=fp32),
        helper.make_node("Sub", ["ONE", "START"], ["not_start"]),
        helper.make_node("Mul", ["STATE_IN", "not_start"], ["kept"]),
        helper.make_node("Add", ["INPUT", "kept"], ["summed"]),
        helper.make_node("Sub", ["summed", "STATE_IN"], ["delta"]),
        helper.make_node("Mul", ["delta", "ready_f"], ["gated"]),
        helper.make_node("Add", ["STATE_IN", "gated"], ["OUTPUT"]),  # READY ? summed : STATE_IN
        helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        helper.make_node("Identity", ["END"], ["END_SEEN"]),
        helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"]),
    ], "seq_ctl",
        [vi("INPUT", fp32), vi("START", fp32), vi("END", int32), vi("READY", boolean), vi("CORRID", u64),
         vi("STATE_IN", fp32)],
        [vi("OUTPUT", fp32), vi("STATE_OUT", fp32), vi("END_SEEN", int32), vi("CORRID_OUT", u64)])
    ctl.graph.initializer.append(helper.make_tensor("ONE", fp32, [1], [1.0]))
    _save(repo, "seq_ctl", CTL_CONFIG, ctl)
    return repo


TORCH_CONFIG = """name: "seq_accum_pt"
platform: "pytorch_libtorch"
max_batch_size: 8
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
}
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def build_torch(repo: Path, kind: str = "KIND_CPU") -> Path:
    """``seq_accum_pt`` (TorchScript): OUTPUT = STATE_OUT = INPUT + (1 - START) * STATE_IN.
    Control and state tensors reach forward() by argument name; its one instance is of ``kind``.
    Needs torch."""
    import torch

    class Accumulate(torch.nn.Module):  # type: ignore[misc,name-defined]
        def forward(self, INPUT: Any, START: Any, STATE_IN: Any) -> tuple[Any, Any]:
            acc = INPUT + (1 - START) * STATE_IN
            return acc, acc

    example = (torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1))
    write(repo, "seq_accum_pt", TORCH_CONFIG.replace("KIND_CPU", kind),
          {1: lambda path: torch.jit.trace(Accumulate(), example).save(str(path))}, "model.pt")
    return repo
