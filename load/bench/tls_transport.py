"""The TLS transport of the HTTP/1.1 port, its own instructions per request, in one server process
under callgrind: docs/perf/tls-cost.md, "Session 10".

    python -m load.bench.tls_transport [--labels plain,tls] [-n 1000] [--base 300]

The server: meshserve's HTTP/1.1 server (meshserve/server/http1/server.py) on uvloop, plaintext
(``plain``) or behind this tree's TLS acceptor (``tls``: meshserve/server/tls.py:Acceptor), with a
handler that reads the body and answers ~600 bytes of JSON (an add_sub JSON answer's size). The
client: a plain Python process, not counted, that sends each request as perf_analyzer's libcurl
does, its head and its body in two writes (two TLS records in, one out), one request at a time.
Each label runs twice under callgrind, with --base requests and with --base + n; the difference of
the two totals over n is the server's instructions per request (start-up, imports and the handshake
are in both and cancel out). Runs of the same tree differ by up to ~3,000 instructions per request
(allocator and dict states); numpy's BLAS threads, which spin otherwise, are held to one.
Compare trees by running it in each (e.g. `git worktree add /tmp/base <rev>`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

from load.bench import callgrind

ANSWER = b'{"model_name":"add_sub","model_version":"1","outputs":[' + b"2.0," * 125 + b"2.0]}"
BODY = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,16],"data":[' + b"1.0," * 180 + b"1.0]}]}"
HEAD = (f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n").encode()


def _client(port: int, n: int, ca: str | None) -> None:
    raw = socket.create_connection(("127.0.0.1", port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s = ssl.create_default_context(cafile=ca).wrap_socket(raw, server_hostname="localhost") if ca else raw
    for _ in range(n):
        s.sendall(HEAD)  # (two writes: two TLS records, as libcurl sends a request)
        s.sendall(BODY)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                raise SystemExit("the server closed the connection")
            got += chunk
            end = got.find(b"\r\n\r\n")
            if end >= 0 and len(got) >= end + 4 + int(got[:end].lower().split(b"content-length: ")[1].split(b"\r\n")[0]):
                break
    s.close()


def _serve(label: str, n: int) -> None:
    """The server of one run: answers n requests of one client, then exits."""
    import uvloop

    from meshserve.server import certs, connections, tls
    from meshserve.server.http1.request import Answer, Request
    from meshserve.server.http1.server import Http1Server
    from meshserve.server.limits import ServerLimits

    connections.configure(1000, 0)

    async def handler(request: Request) -> Answer:
        await request.read_body()
        return Answer(ANSWER, {"Content-Type": "application/json"})

    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            ca = certs.authority(Path(tmp), "ca")
            server = ca.issue(Path(tmp), "server", server=True)
            acceptor = tls.Acceptor(tls.PortTls(str(server.cert), str(server.key)), "http", 10.0, 16) if label == "tls" else None
            srv = Http1Server(handler, ServerLimits(), acceptor)
            port = await srv.start("127.0.0.1", 0)
            client = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "load.bench.tls_transport", "--client", str(port), str(n),
                str(ca.cert) if acceptor else "")
            if await client.wait():
                raise SystemExit("the client failed")
            await srv.cleanup()

    uvloop.run(run())


def _count(label: str, n: int, out: Path) -> int:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    subprocess.run([*callgrind.command(out), sys.executable, "-m", "load.bench.tls_transport", "--serve", label, str(n)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return callgrind.totals(out)[0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.tls_transport", description=__doc__.splitlines()[0])
    ap.add_argument("--labels", default="plain,tls")
    ap.add_argument("-n", "--requests", type=int, default=1000, help="requests counted per label")
    ap.add_argument("--base", type=int, default=300, help="requests of the run subtracted")
    ap.add_argument("--serve", nargs=2, metavar=("LABEL", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--client", nargs=3, metavar=("PORT", "N", "CA"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.client:
        _client(int(a.client[0]), int(a.client[1]), a.client[2] or None)
        return
    if a.serve:
        _serve(a.serve[0], int(a.serve[1]))
        return
    if not callgrind.available():
        raise SystemExit("valgrind is needed (apt-get install valgrind)")
    labels = a.labels.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        from concurrent.futures import ThreadPoolExecutor

        jobs = [(label, count) for label in labels for count in (a.base, a.base + a.requests)]
        with ThreadPoolExecutor(len(jobs)) as pool:  # (counts do not depend on the machine's load)
            totals = list(pool.map(lambda job: _count(job[0], job[1], Path(tmp) / f"cg-{job[0]}-{job[1]}.out"), jobs))
    per = {label: (totals[2 * i + 1] - totals[2 * i]) / a.requests for i, label in enumerate(labels)}
    print(f"server instructions per request ({a.requests} requests: the difference of runs of {a.base} and "
          f"{a.base + a.requests})")
    for label in labels:
        extra = f" ({per[label] - per['plain']:+,.0f} over plain)" if "plain" in per and label != "plain" else ""
        print(f"  {label:6s} {per[label]:10,.0f}{extra}")


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
