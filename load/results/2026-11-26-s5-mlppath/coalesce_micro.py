"""The coalescer's per-member work on mlp requests (1 x 512 FP32): merge_key, merge (+ serialize),
split, for a chunk of 9 members (the mean merged send at mlp gRPC c32), ITER times. Under
callgrind the difference between ITER=N and ITER=0, over N x 9, is the instructions per member.
python3 coalesce_micro.py WHAT ITER    (WHAT: merge_key | merge_key_raw | merge | split)"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from google.protobuf import text_format

from gateway.upstream.coalesce import ModelShape, merge, merge_key, split
from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc

what, iters = sys.argv[1], int(sys.argv[2])
cfg = text_format.Parse(Path("/tmp/bench-models/onnx_repo/mlp/config.pbtxt").read_text(), mc.ModelConfig())
shape = ModelShape.of(cfg)
assert shape is not None
rng = np.random.default_rng(0)
reqs, raws = [], []
for i in range(9):
    r = pb.ModelInferRequest(model_name="mlp", id=str(i))
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 512])
    r.outputs.add(name="OUTPUT0")
    r.raw_input_contents.append(rng.uniform(-1, 1, 512).astype(np.float32).tobytes())
    raws.append(r.SerializeToString())
    reqs.append(pb.ModelInferRequest.FromString(raws[-1]))
rows = [1] * 9
resp = pb.ModelInferResponse(model_name="mlp", model_version="1")
resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=[9, 512])
resp.raw_output_contents.append(rng.uniform(-1, 1, (9, 512)).astype(np.float32).tobytes())
resp = pb.ModelInferResponse.FromString(resp.SerializeToString())
for _ in range(iters):
    if what == "merge_key":
        for r in reqs:
            merge_key(r, shape)
    elif what == "merge_key_raw":  # the gRPC path: the client's bytes at hand
        for r, raw in zip(reqs, raws, strict=True):
            merge_key(r, shape, raw)
    elif what == "merge":
        merge(reqs, rows, shape).SerializeToString()
    else:
        split(resp, reqs, rows)
