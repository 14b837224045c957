"""The gateway's merge check (coalesce.merge_key) on an mlp HTTP binary request as the HTTP front
end makes it from its template (http_codec.parse_infer: the request and its serialized bytes,
RequestContext.raw), ITER times per request of 9, with the bytes (WHAT=raw: what gateway/core.py
passes) or without (WHAT=message). Under callgrind the difference between ITER=N and ITER=0,
over N x 9, is the instructions per request.   python3 http_merge_micro.py WHAT ITER"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from google.protobuf import text_format

from gateway.upstream.coalesce import ModelShape, merge_key
from load.inputs import ModelInfo, TensorSpec, encode
from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol import http_codec

what, iters = sys.argv[1], int(sys.argv[2])
cfg = text_format.Parse(Path("/tmp/bench-models/onnx_repo/mlp/config.pbtxt").read_text(), mc.ModelConfig())
shape = ModelShape.of(cfg)
assert shape is not None
info = ModelInfo("mlp", 64, [TensorSpec("INPUT0", "FP32", [512])], ["OUTPUT0"])
rng = np.random.default_rng(0)
pairs = []
for i in range(10):
    p = encode("mlp", "", {"INPUT0": rng.uniform(-1, 1, (1, 512)).astype(np.float32)}, info)
    request, _, raw = http_codec.parse_infer(p.http_binary, p.http_binary_header_len, "mlp", "")
    if i:  # the first body makes the template (no bytes yet), as in the front end
        assert raw is not None
        pairs.append((request, raw if what == "raw" else None))
for _ in range(iters):
    for request, raw in pairs:
        merge_key(request, shape, raw)
