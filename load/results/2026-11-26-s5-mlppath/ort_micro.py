"""onnxruntime alone on the bench mlp: wall and CPU (this process, all threads) per call, spinning
on/off, plain run vs io_binding with a preallocated output. python3 ort_micro.py [seconds]"""
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

MODEL = "/tmp/bench-models/onnx_repo/mlp/1/model.onnx"
SECS = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0


def session(spin: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    so.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return ort.InferenceSession(MODEL, so, providers=["CPUExecutionProvider"])


def measure(fn):
    fn()
    walls = []
    c0, w0 = time.process_time(), time.perf_counter()
    end = w0 + SECS
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    cpu = time.process_time() - c0
    return statistics.median(walls) * 1e3, min(walls) * 1e3, cpu / len(walls) * 1e3, len(walls)


print("| spinning | how | batch | ms/call median | ms/call min | CPU ms/call | calls |")
print("|---|---|---|---|---|---|---|")
for spin in ("0", "1"):
    s = session(spin)
    for b in (8, 16, 32, 64):
        x = np.random.default_rng(0).uniform(-1, 1, (b, 512)).astype(np.float32)
        r = measure(lambda s=s, x=x: s.run(["OUTPUT0"], {"INPUT0": x}))
        print(f"| {spin} | run | {b} | {r[0]:.3f} | {r[1]:.3f} | {r[2]:.3f} | {r[3]} |", flush=True)
        io = s.io_binding()
        out = np.empty((b, 512), np.float32)
        io.bind_cpu_input("INPUT0", x)
        io.bind_output("OUTPUT0", "cpu", 0, np.float32, out.shape, out.ctypes.data)
        r = measure(lambda s=s, io=io: s.run_with_iobinding(io))
        print(f"| {spin} | iobinding | {b} | {r[0]:.3f} | {r[1]:.3f} | {r[2]:.3f} | {r[3]} |", flush=True)
