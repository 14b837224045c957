"""A second well-behaved client for the adversarial suite (in a process of its own, as
good_client.py): identity_fp32 over HTTP with the real tritonclient, its input as a JSON list
(``binary_data=False``) of --elements values, so that each body's JSON is larger than
`meshserve/server/body_worker.py:OFFLOAD_BYTES` and is decoded in the process's body worker.
Prints good_client.py's lines (``<send time> <latency s> <status>``) until stdin closes.

Run: python -m tests.adversarial.json_client --http H:P --key KEY
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def _stop_at_eof(stopped: threading.Event) -> None:
    sys.stdin.read()  # (the suite closes it)
    stopped.set()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--elements", type=int, default=20_000)  # ~100 KB of JSON: offloaded
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--max-s", type=float, default=900.0)
    args = ap.parse_args()
    stopped = threading.Event()
    threading.Thread(target=_stop_at_eof, args=(stopped,), daemon=True).start()
    values = np.ones((1, args.elements), np.float32)
    tensor = httpclient.InferInput("INPUT0", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values, binary_data=False)
    wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    client = httpclient.InferenceServerClient(args.http, network_timeout=args.timeout_s,
                                              connection_timeout=args.timeout_s)
    period, end = 1.0 / args.rate, time.monotonic() + args.max_s
    due = time.monotonic()
    while not stopped.is_set() and time.monotonic() < end:
        t0 = time.monotonic()
        try:
            got = client.infer("identity_fp32", [tensor], outputs=wanted, headers={"x-api-key": args.key})
            out = got.as_numpy("OUTPUT0")
            status = "ok" if out is not None and np.array_equal(out, values) else "wrong-output"
        except InferenceServerException as exc:
            status = f"http:{exc.status()}:{(exc.message() or '')[:80]}"
        except Exception as exc:  # a connection error is a failure the suite must see
            status = f"http:{type(exc).__name__}:{str(exc)[:80]}"
        t1 = time.monotonic()
        sys.stdout.write(f"{t0:.6f} {t1 - t0:.6f} {status.replace(chr(10), ' ')}\n")
        sys.stdout.flush()
        due = max(due + period, t1)
        stopped.wait(max(0.0, due - time.monotonic()))
    client.close()


if __name__ == "__main__":
    main()
