"""shm.uses_shared_memory on perf_analyzer's mlp gRPC request (1 x 512 FP32, OUTPUT0 named, no
region), ITER times, without (WHAT=message: what the front end did before) or with the
request's bytes (WHAT=raw). Under callgrind the difference between ITER=N and ITER=0, over N,
is the instructions per call.   python3 shm_micro.py WHAT ITER"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server.shm import uses_shared_memory

what, iters = sys.argv[1], int(sys.argv[2])
r = pb.ModelInferRequest(model_name="mlp", id="1")
r.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 512])
r.outputs.add(name="OUTPUT0")
r.raw_input_contents.append(np.random.default_rng(0).uniform(-1, 1, 512).astype(np.float32).tobytes())
raw = r.SerializeToString()
request = pb.ModelInferRequest.FromString(raw)
given = raw if what == "raw" else None
for _ in range(iters):
    uses_shared_memory(request, given)
