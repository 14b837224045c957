"""The service's own work per mlp batch around onnxruntime, without onnxruntime: validation of
each request (prepare), batching.feeds (joining the inputs) and ResponseEncoder.encode (one
serialized response per request), on ROWS one-row requests, ITER times. Under callgrind, the
difference between ITER=N and ITER=0 over N is the instructions per batch.

    python3 batch_path.py ROWS ITER [run]   (run: also time onnxruntime's Session.run on the feeds)
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from google.protobuf import text_format

from meshserve._proto import grpc_service_pb2 as pb
from meshserve._proto import model_config_pb2 as mc
from meshserve.server.core import NO_HOP
from services.base import batching
from services.base.serialization import ResponseEncoder
from services.base.validation import ModelTensors, prepare

REPO = Path("/tmp/bench-models/onnx_repo/mlp")
rows, iters = int(sys.argv[1]), int(sys.argv[2])
config = text_format.Parse((REPO / "config.pbtxt").read_text(), mc.ModelConfig())
tensors = ModelTensors.from_config(config)
encoder = ResponseEncoder(tensors, "1", REPO)
rng = np.random.default_rng(0)
requests = []
for i in range(rows):
    r = pb.ModelInferRequest(model_name="mlp", id=str(i))
    r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 512])
    r.raw_input_contents.append(rng.uniform(-1, 1, 512).astype(np.float32).tobytes())
    requests.append(pb.ModelInferRequest.FromString(r.SerializeToString()))
out = {"OUTPUT0": rng.uniform(-1, 1, (rows, 512)).astype(np.float32)}
t0 = time.perf_counter()
for _ in range(iters):
    payloads = [prepare(tensors, r, NO_HOP) for r in requests]
    feeds = batching.feeds(tensors, payloads, rows)
    bodies = encoder.encode(payloads, out)
dt = time.perf_counter() - t0
if iters:
    print(f"rows {rows}: {dt / iters * 1e6:.1f} us per batch (prepare+feeds+encode), {len(bodies[0])} bytes per response")
