"""The well-behaved client of the adversarial suite, in a process of its own (so the attacker's
threads in the pytest process cannot slow it through the GIL and count as the server's fault).

Sends add_sub requests with the real tritonclient, alternating gRPC and HTTP (with --compress,
every other pair gzip-compressed: `grpc-encoding` / `Content-Encoding`), paced at --rate per
second, each with a timeout, and prints one line per request on stdout:
``<send time (time.monotonic, shared by every process)> <latency s> <status>``, status "ok" or
the error. It stops when stdin closes (the suite ends it) or after --max-s (bounded).

Run: python -m tests.adversarial.good_client --grpc H:P --http H:P --key KEY
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grpc", required=True)
    ap.add_argument("--http", required=True)
    ap.add_argument("--key", default="")
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--max-s", type=float, default=900.0)
    ap.add_argument("--root-cert", default=None, help="TLS on both ports, trusting this CA (PEM)")
    ap.add_argument("--compress", action="store_true", help="every other gRPC and HTTP request gzip-compressed")
    args = ap.parse_args()
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    headers = {"x-api-key": args.key} if args.key else None
    a = np.ones((1, 16), np.float32)
    clients = []
    for m, url in ((grpcclient, args.grpc), (httpclient, args.http)):
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = m.InferInput(name, [1, 16], "FP32")
            inp.set_data_from_numpy(a)
            inputs.append(inp)
        kw: dict[str, object] = {"network_timeout": args.timeout_s, "connection_timeout": args.timeout_s} \
            if m is httpclient else {}
        if args.root_cert:
            kw.update({"ssl": True, "ssl_options": {"ca_certs": args.root_cert}} if m is httpclient
                      else {"ssl": True, "root_certificates": args.root_cert})
        clients.append((m, m.InferenceServerClient(url, **kw), inputs))
    # (gRPC plain, HTTP plain[, gRPC gzip, HTTP gzip]): the keyword that compresses a request
    ways = [(m, c, inputs, {}) for m, c, inputs in clients]
    if args.compress:
        ways += [(m, c, inputs, {"compression_algorithm" if m is grpcclient else "request_compression_algorithm": "gzip"})
                 for m, c, inputs in clients]
    period = 1.0 / args.rate
    end = time.monotonic() + args.max_s
    nxt = time.monotonic()
    i = 0
    out = sys.stdout
    while not stop.is_set() and time.monotonic() < end:
        m, client, inputs, compress = ways[i % len(ways)]
        i += 1
        t0 = time.monotonic()
        try:
            kw = {"client_timeout": args.timeout_s, **compress} if m is grpcclient else dict(compress)
            # a fresh dict each call: tritonclient.http adds its own headers (ints) to the one it gets
            res = client.infer("add_sub", inputs, headers=dict(headers) if headers else None, **kw)
            status = "ok" if res.as_numpy("OUTPUT0") is not None else "no-output"
        except InferenceServerException as exc:
            status = f"{'grpc' if m is grpcclient else 'http'}{'+gzip' if compress else ''}:{exc.status()}:" \
                     f"{(exc.message() or '')[:80]}"
        except Exception as exc:  # a connection error is a failure the suite must see
            where = traceback.extract_tb(exc.__traceback__)[-1]
            status = (f"{'grpc' if m is grpcclient else 'http'}:{type(exc).__name__}:{str(exc)[:80]} "
                      f"at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}")
        t1 = time.monotonic()
        out.write(f"{t0:.6f} {t1 - t0:.6f} {status.replace(chr(10), ' ')}\n")
        out.flush()
        nxt = max(nxt + period, t1)
        stop.wait(max(0.0, nxt - time.monotonic()))
    for _, client, _ in clients:
        client.close()


if __name__ == "__main__":
    main()
