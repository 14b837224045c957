"""Does the event loop's Python delay the end of an onnxruntime run? A worker thread runs the
mlp (batch ROWS) in a loop, as the service's instance thread does, while the main thread runs an
event loop that is kept busy with Python callbacks of CHUNK_US each (BUSY: fraction of the time;
0 = idle loop). Per run: wall time, and the time from onnxruntime's end (its last intra-op
thread's end is not visible, so: the run's wall minus the same run's wall with an idle loop)
python3 gil_wait.py ROWS BUSY CHUNK_US SWITCH_MS"""
import asyncio
import statistics
import sys
import threading
import time

import numpy as np
import onnxruntime as ort

rows, busy, chunk_us, switch_ms = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
sys.setswitchinterval(switch_ms / 1000)
so = ort.SessionOptions()
so.intra_op_num_threads = 2
so.inter_op_num_threads = 1
so.add_session_config_entry("session.intra_op.allow_spinning", "0")
sess = ort.InferenceSession("/tmp/bench-models/onnx_repo/mlp/1/model.onnx", so, providers=["CPUExecutionProvider"])
x = np.random.default_rng(0).uniform(-1, 1, (rows, 512)).astype(np.float32)
walls: list[float] = []
stop = threading.Event()


def worker() -> None:
    sess.run(["OUTPUT0"], {"INPUT0": x})
    while not stop.is_set():
        t = time.perf_counter()
        sess.run(["OUTPUT0"], {"INPUT0": x})
        walls.append(time.perf_counter() - t)
        time.sleep(0.0005)  # the batch's answers and the next batch's forming


def spin_python(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    n = 0
    while time.perf_counter() < end:
        n += 1


async def main() -> None:
    loop = asyncio.get_running_loop()
    th = threading.Thread(target=worker)
    th.start()
    end = time.perf_counter() + 3
    while time.perf_counter() < end:
        if busy:
            spin_python(chunk_us)
            await asyncio.sleep(chunk_us / 1e6 * (1 - busy) / busy if busy < 1 else 0)
        else:
            await asyncio.sleep(0.01)
    stop.set()
    await loop.run_in_executor(None, th.join)


asyncio.run(main())
print(f"rows {rows} busy {busy} chunk {chunk_us:.0f} us switch {switch_ms} ms: run wall median "
      f"{statistics.median(walls) * 1e3:.3f} ms p90 {sorted(walls)[int(len(walls) * 0.9)] * 1e3:.3f} ms over {len(walls)}")
