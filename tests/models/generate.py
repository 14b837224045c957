"""Build the test model repository: real ONNX models (tests/support/models.py) + Triton configs.

    python -m tests.models.generate OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

from onnx import TensorProto

from tests.support.models import add_sub, fixed_add, identity, scale, small_mlp
from tests.support.models import write as _write

# v2 datatype -> (ONNX element type, config data_type): ONNX and the config name each type as
# the v2 protocol does (TensorProto.INT8, TYPE_INT8), but for the few in _ONNX_NAMES / _CONFIG_NAMES
_ONNX_NAMES = {"FP16": "FLOAT16", "FP32": "FLOAT", "FP64": "DOUBLE", "BYTES": "STRING"}
_CONFIG_NAMES = {"BYTES": "STRING"}
DATATYPES: dict[str, tuple[int, str]] = {
    dt: (TensorProto.DataType.Value(_ONNX_NAMES.get(dt, dt)), f"TYPE_{_CONFIG_NAMES.get(dt, dt)}")
    for dt in ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
               "FP16", "FP32", "FP64", "BYTES")
}
MAX_BATCH = 8


def build(repo: Path) -> Path:
    repo.mkdir(parents=True, exist_ok=True)
    _write(repo, "add_sub", f"""name: "add_sub"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }}, {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
""", {1: add_sub(TensorProto.FLOAT)})
    for dt, (elem, cfg_type) in DATATYPES.items():
        _write(repo, f"identity_{dt.lower()}", f"""name: "identity_{dt.lower()}"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: {cfg_type} dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {cfg_type} dims: [ -1 ] }} ]
dynamic_batching {{ }}
""", {1: identity(elem)})
    _write(repo, "small_mlp", """name: "small_mlp"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
dynamic_batching { max_queue_delay_microseconds: 5000 }
""", {1: small_mlp()})
    _write(repo, "fixed_add", """name: "fixed_add"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""", {1: fixed_add()})
    _write(repo, "scale", """name: "scale"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { all { } }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
""", {1: scale(1.0), 2: scale(2.0)})
    # auto-completed from the ONNX file: no inputs/outputs in the config
    _write(repo, "autocomplete", 'name: "autocomplete"\nbackend: "onnxruntime"\n',
           {1: add_sub(TensorProto.INT32)})
    return repo


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/meshserve-test-models")))
