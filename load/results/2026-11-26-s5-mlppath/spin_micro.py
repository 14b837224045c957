"""onnxruntime alone on the bench mlp with the service's rhythm (a pause between runs, as while the
next batch forms): wall and CPU (process, all threads) per run for spinning off, spinning on (ORT's
default), and spinning on for at most N us (session.intra_op.spin_duration_us).
python3 spin_micro.py SECONDS GAP_MS ROWS[,ROWS..]"""
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort

secs, gap_ms, sizes = float(sys.argv[1]), float(sys.argv[2]), [int(r) for r in sys.argv[3].split(",")]
VARIANTS = {"off": {"session.intra_op.allow_spinning": "0"}, "on": {"session.intra_op.allow_spinning": "1"}}
for us in sys.argv[4].split(",") if len(sys.argv) > 4 else ["50", "200"]:
    VARIANTS[f"on {us}us"] = {"session.intra_op.allow_spinning": "1", "session.intra_op.spin_duration_us": us}
sessions = {}
for name, entries in VARIANTS.items():
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    for k, v in entries.items():
        so.add_session_config_entry(k, v)
    sessions[name] = ort.InferenceSession("/tmp/bench-models/onnx_repo/mlp/1/model.onnx", so,
                                          providers=["CPUExecutionProvider"])
print(f"gap {gap_ms} ms between runs")
print("| rows | spinning | wall ms median | wall ms min | CPU ms per run (incl. the gap) | runs |")
print("|---|---|---|---|---|---|")
for rows in sizes:
    x = np.random.default_rng(0).uniform(-1, 1, (rows, 512)).astype(np.float32)
    for _round in range(2):  # interleaved twice: the machine is shared
        for name, s in sessions.items():
            s.run(["OUTPUT0"], {"INPUT0": x})
            walls = []
            c0 = time.process_time()
            end = time.perf_counter() + secs
            while time.perf_counter() < end:
                t = time.perf_counter()
                s.run(["OUTPUT0"], {"INPUT0": x})
                walls.append(time.perf_counter() - t)
                time.sleep(gap_ms / 1000)
            cpu = (time.process_time() - c0) / len(walls)
            print(f"| {rows} | {name} | {statistics.median(walls) * 1e3:.3f} | {min(walls) * 1e3:.3f} | "
                  f"{cpu * 1e3:.3f} | {len(walls)} |", flush=True)
