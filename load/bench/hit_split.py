"""Where a gRPC cache hit's instructions go in the gateway's HTTP/2 server: the server's frame loop
fed in process (no socket), one part of the path at a time (docs/perf/response-cache.md, section 9).

    python -m load.bench.hit_split [--batch 8] [-n 4000]   (every part, callgrind: ~1 min)
    python -m load.bench.hit_split --part door -n 4000      (one part, run as is: for a profiler)

A ``ServerConnection`` of ``meshserve/server/h2/server.py`` on uvloop with a transport that drops
what it is given; the bytes a client of ``meshserve/server/h2/client.py`` sends for ``--batch``
unary ModelInfer calls (HEADERS + DATA each, add_sub's FP32 [1,16] x 2, a ``grpc-timeout``), fed as
one read per batch, stream ids rising. The at-once hook is the gateway's ``FrontDoor.grpc`` over a
``CacheStage`` whose index holds the request (``door``), or a hook that answers the same bytes at
once (``const``: the server's part alone), or pieces called alone in a loop. Each part is run twice
under callgrind (``-n`` and ``2 -n`` requests) and the difference is divided by ``-n``: the
process's start, the imports and the set-up cancel out.
"""
from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from load.bench.h2_calls import _Transport  # (a transport that takes everything and keeps nothing)

PATH = "/inference.GRPCInferenceService/ModelInfer"
PARTS = ("loop", "const", "door", "door_alone", "key_alone", "reply_alone")


def _request() -> bytes:
    import numpy as np

    from meshserve._proto import grpc_service_pb2 as pb
    rng = np.random.default_rng(7)
    req = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        req.raw_input_contents.append(rng.standard_normal((1, 16), dtype=np.float32).tobytes())
    return req.SerializeToString()


async def _door(raw: bytes) -> Any:
    """A FrontDoor whose index holds ``raw`` (filled as the gateway fills it: the stage's first hit)."""
    from gateway.cache import CacheStage, FrontDoor, LocalCache
    from meshserve._proto import grpc_service_pb2 as pb
    from meshserve._proto import model_config_pb2 as mc
    from meshserve.server.core import InferResult, RequestContext

    config = mc.ModelConfig(name="add_sub")
    config.response_cache.enable = True
    stage = CacheStage(LocalCache(64 << 20), lambda name, version: config, lambda name: "1", None)

    class Rest:
        async def infer(self, request: pb.ModelInferRequest, ctx: RequestContext, sequence: str | None) -> InferResult:
            answer = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
            for name in ("OUTPUT0", "OUTPUT1"):
                answer.outputs.add(name=name, datatype="FP32", shape=[1, 16])
                answer.raw_output_contents.append(request.raw_input_contents[0])
            return InferResult(message=answer)

    stage.next = Rest()
    assert isinstance(stage.local, LocalCache)
    stage.front = FrontDoor(stage, stage.local, Counter())
    for _ in range(2):  # a miss, then the stage's hit, which indexes it
        await stage.infer(pb.ModelInferRequest.FromString(raw), RequestContext(protocol="grpc", raw=raw), None)
    assert stage.front.grpc(raw, None) is not None
    return stage.front


def _client_bytes(batch: int, first_sid: int, raw: bytes) -> bytes:
    """One read's worth of what meshserve's client sends for ``batch`` unary calls."""
    from meshserve.server.h2.client import _MESSAGE_HEAD, grpc_timeout
    from meshserve.server.h2.frames import DATA, END_HEADERS, END_STREAM, HEADERS, frame, literal

    block = (literal(b":method", b"POST") + literal(b":scheme", b"http") + literal(b":path", PATH.encode())
             + literal(b":authority", b"127.0.0.1:8001") + literal(b"content-type", b"application/grpc")
             + literal(b"te", b"trailers") + literal(b"grpc-timeout", grpc_timeout(30.0).encode()))
    n = len(raw)
    out = b""
    for i in range(batch):
        sid = first_sid + 2 * i
        out += frame(HEADERS, END_HEADERS, sid, block)
        out += _MESSAGE_HEAD.pack((n + 5) >> 16, (n + 5) & 0xFFFF, DATA, END_STREAM, sid, 0, n) + raw
    return out


async def _run(part: str, n: int, batch: int) -> None:
    from meshserve.server.h2 import H2GrpcServer, unary_unary
    from meshserve.server.h2.frames import (
        DEFAULT_WINDOW,
        LOCAL_CONN_WINDOW,
        LOCAL_HEADER_TABLE,
        LOCAL_MAX_FRAME,
        LOCAL_STREAM_WINDOW,
        PREFACE,
        SETTINGS,
        SETTINGS_ENABLE_PUSH,
        SETTINGS_HEADER_TABLE_SIZE,
        SETTINGS_INITIAL_WINDOW_SIZE,
        SETTINGS_MAX_FRAME_SIZE,
        U32,
        WINDOW_UPDATE,
        frame,
    )
    from meshserve.server.h2.server import ServerConnection, ServerStream

    raw = _request()
    door = await _door(raw) if part.startswith("door") else None
    answer = door.grpc(raw, None) if door is not None else b"\x00" * 160

    async def handler(request: bytes, call: Any) -> bytes:
        raise AssertionError("every call is answered at once here")

    server = H2GrpcServer()
    server.add_methods("inference.GRPCInferenceService", {"ModelInfer": unary_unary(handler)})
    if part == "const":
        server.at_once[PATH] = (lambda message, call: answer, False)
    elif part == "door":
        server.at_once[PATH] = (door.grpc, False)  # type: ignore[union-attr]
    conn = ServerConnection(server)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    # the client's preamble (H2Endpoint._preamble: its SETTINGS, a connection window of 1 GiB)
    settings = b"".join(struct.pack(">HI", k, v) for k, v in (
        (SETTINGS_HEADER_TABLE_SIZE, LOCAL_HEADER_TABLE), (SETTINGS_ENABLE_PUSH, 0),
        (SETTINGS_INITIAL_WINDOW_SIZE, LOCAL_STREAM_WINDOW), (SETTINGS_MAX_FRAME_SIZE, LOCAL_MAX_FRAME)))
    conn.data_received(PREFACE + frame(SETTINGS, 0, 0, settings)
                       + frame(WINDOW_UPDATE, 0, 0, U32.pack(LOCAL_CONN_WINDOW - DEFAULT_WINDOW)))
    sid = 1
    if part in ("const", "door"):
        reads = [_client_bytes(batch, 1 + 2 * batch * k, raw) for k in range(n // batch)]
        for data in reads:
            conn.data_received(data)
        assert not conn.streams and not conn.dead
    elif part == "loop":
        reads = [_client_bytes(batch, 1 + 2 * batch * k, raw) for k in range(n // batch)]
        for _data in reads:
            pass
    elif part == "door_alone":
        grpc = door.grpc  # type: ignore[union-attr]
        for _ in range(n):
            grpc(raw, None)
    elif part == "key_alone":
        from gateway.cache import front_key
        for _ in range(n):
            front_key(raw)
    elif part == "reply_alone":  # _reply of an answer to a stream (without the frame loop around it)
        for _ in range(n):
            st = ServerStream(sid, 65535)
            st.remote_ended = True
            conn.streams[sid] = st
            conn._reply(st, answer, None)
            sid += 2
        conn._flush()
    del sid


def _client(endpoint: str, n: int) -> None:
    """``n`` cache hits through the gateway at ``endpoint`` as ``python -m load.bench --cache``'s client
    sends them (``load/bench/cache.py:drive``: c16 over 2 connections, its event loop)."""
    from load.bench.cache import drive, mix, run_client

    run = run_client(drive(endpoint, mix("add_sub", n, 1.0, 10, 77), 16, 2))
    assert not run.errors, run.first_error


def client_instructions(n: int, work: Path) -> int:
    """The bench client's instructions per request (callgrind, ``n`` and ``2 n`` hits, the
    difference), against a gateway with the cache on that runs outside callgrind."""
    from load.bench import procs
    from load.bench.cache import bench_models, cached_copy, drive, mix, run_client

    (work / "mesh").mkdir()
    cached_copy(bench_models(Path("/tmp/bench-models")) / "onnx_repo" / "add_sub", work / "mesh", "add_sub", True)
    svc = procs.service(work / "mesh", work / "svc.log")
    try:
        gw = procs.gateway([svc.grpc], work / "gw.log", extra=["--cache-config", "local,size=67108864"])
        try:
            run_client(drive(gw.grpc, mix("add_sub", 200, 1.0, 10, 77), 16, 2))  # every hot input answered once
            counts = []
            for k in (n, 2 * n):
                out = work / f"cg-client-{k}.out"
                subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
                                "load.bench.hit_split", "--client", gw.grpc, "-n", str(k)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
                from load.bench import callgrind
                counts.append(callgrind.program_total(out))
            return (counts[1] - counts[0]) // n
        finally:
            gw.stop()
    finally:
        svc.stop()


def _count(part: str, n: int, batch: int, work: Path) -> int:
    out = work / f"cg-{part}-{n}.out"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
                    "load.bench.hit_split", "--part", part, "-n", str(n), "--batch", str(batch)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    from load.bench import callgrind
    return callgrind.program_total(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.hit_split", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--part", choices=PARTS, default=None, help="run one part (no callgrind)")
    ap.add_argument("-n", type=int, default=4000, help="requests (or calls) per run")
    ap.add_argument("--batch", type=int, default=8, help="calls per read (the --instructions bench: 8)")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts to count")
    ap.add_argument("--keep", type=Path, default=None, help="with --client: keep its callgrind dumps here")
    ap.add_argument("--client", nargs="?", const="", default=None, metavar="ENDPOINT",
                    help="instead: the bench client's instructions per hit (a gateway started here); with an "
                         "ENDPOINT: run that client once (no callgrind)")
    args = ap.parse_args(argv)
    if args.client:
        _client(args.client, args.n)
        return
    if args.client is not None:
        with tempfile.TemporaryDirectory(prefix="hit-split-client-") as tmp:
            work = Path(tmp) if args.keep is None else args.keep
            print(f"client: {client_instructions(args.n, work)} instructions per request")
        return
    if args.part is not None:
        import gc

        import uvloop
        gc.freeze()
        gc.set_threshold(20_000, *gc.get_threshold()[1:])  # as meshserve/server/process.py
        uvloop.run(_run(args.part, args.n, args.batch))
        return
    with tempfile.TemporaryDirectory(prefix="hit-split-") as tmp:
        counts = {}
        for part in args.parts.split(","):
            low, high = _count(part, args.n, args.batch, Path(tmp)), _count(part, 2 * args.n, args.batch, Path(tmp))
            counts[part] = (high - low) // args.n
            print(f"{part}: {counts[part]} instructions per request", flush=True)
    if "loop" in counts:
        print("(less the loop over the prepared reads:)")
        for part, count in counts.items():
            if part in ("const", "door"):
                print(f"{part}: {count - counts['loop']}")


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
