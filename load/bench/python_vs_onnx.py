"""Python-backend add_sub against ONNX add_sub: `python -m load.bench.python_vs_onnx`.

Starts the python service (py_add_sub: tests/models/python_models.py's model.py, 2 instances),
the ONNX service (add_sub, 2 instances, 1 intra-op thread) and one gateway in front of both, then
runs closed-loop gRPC cells (`python -m load`) at each concurrency for each model and reports
throughput and the CPU each request costs in the model's service (its process and, for python,
its worker processes) and in the gateway. Both models use the same dynamic batching settings.

`--ipc` instead measures the service<->worker transport alone: a batch's tensors handed to a
second process and its outputs back, through shared-memory regions (services/python/ipc.py) or
pickled over the same socket.

Long-ish (about models x concurrencies x (seconds + 2) s); run it on a quiet machine and say so
when it was not.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from load.bench import procs
from services.python.ipc import Channel, Region, RegionReader, RegionWriter, TensorRef, aligned, region_ref

ROOT = Path(__file__).resolve().parents[2]
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 2000 }\n"


def build_repo(repo: Path, instances: int) -> tuple[Path, Path]:
    """(python repository, onnx repository) with py_add_sub and add_sub."""
    from onnx import TensorProto

    from meshserve.examples import add_sub, save_onnx
    from tests.models import python_models

    py_repo, onnx_repo = repo / "python", repo / "onnx"
    python_models.write(py_repo, "py_add_sub", python_models.ADD_SUB, python_models.config(
        "py_add_sub", python_models.PAIR_IN, python_models.PAIR_OUT, 8,
        BATCHING + f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"))
    save_onnx(add_sub(TensorProto.FLOAT), onnx_repo / "add_sub" / "1" / "model.onnx")
    (onnx_repo / "add_sub" / "config.pbtxt").write_text(
        python_models.config("add_sub", python_models.PAIR_IN, python_models.PAIR_OUT, 8,
                             BATCHING + f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
                             'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n')
        .replace('backend: "python"', 'platform: "onnxruntime_onnx"'))
    return py_repo, onnx_repo


def cell(target: procs.Server | tuple[str, str], model: str, concurrency: int, seconds: float, out: Path) -> dict:
    http, grpc = (target.http, target.grpc) if isinstance(target, procs.Server) else target
    subprocess.run([sys.executable, "-m", "load", "--http", http, "--grpc", grpc, "-m", model,
                    "--protocol", "grpc", "-c", str(concurrency), "-d", str(seconds), "--warmup", "1", "--quiet",
                    "--json", str(out)], cwd=ROOT, capture_output=True, check=True)
    return json.loads(out.read_text())


def serving(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="python_vs_onnx-"))
    py_repo, onnx_repo = build_repo(tmp / "repo", args.instances)
    services = {
        "py_add_sub": procs.Server(["service", "python", "--repository", str(py_repo), "--grpc-port", "0",
                                    "--http-port", "0", "--log-level", "WARNING"], tmp / "python.log"),
        "add_sub": procs.Server(["service", "onnx", "--repository", str(onnx_repo), "--grpc-port", "0",
                                 "--http-port", "0", "--log-level", "WARNING"], tmp / "onnx.log"),
    }
    gateway = procs.gateway([s.grpc for s in services.values()], tmp / "gateway.log")
    # (row label, model, where the load goes, the server process tree, the gateway's or None)
    targets: list[tuple[str, str, procs.Server | tuple[str, str], int, int | None]] = [
        (model, model, gateway, svc.pid, gateway.pid) for model, svc in services.items()]
    if args.direct:
        targets.append(("py_add_sub, service direct", "py_add_sub", services["py_add_sub"],
                        services["py_add_sub"].pid, None))
    if args.triton:
        http, grpc, pid = args.triton.split(",")
        targets.append(("py_add_sub, Triton 2.51 direct", "py_add_sub", (http, grpc), int(pid), None))
    rows = []
    try:
        for c in args.concurrency:
            for label, model, target, pid, gw_pid in targets:
                svc_cpu = procs.proc_tree_cpu_s(pid)
                gw_cpu = procs.proc_tree_cpu_s(gw_pid) if gw_pid else 0.0
                result = cell(target, model, c, args.seconds, tmp / "cell.json")
                svc_cpu = procs.proc_tree_cpu_s(pid) - svc_cpu
                gw_cpu = procs.proc_tree_cpu_s(gw_pid) - gw_cpu if gw_pid else 0.0
                # the CPU window holds the 1 s warmup too, at about the measured rate
                done = max(1.0, result["goodput_rps"] * (args.seconds + 1))
                rows.append((label, c, result["goodput_rps"], result.get("latency_ms", {}).get("p50"),
                             1000 * svc_cpu / done, 1000 * gw_cpu / done if gw_pid else None, result["failed"]))
                print(f"{label} c{c}: {result['goodput_rps']:.0f}/s", flush=True)
    finally:
        gateway.stop()
        for svc in services.values():
            svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| model (path) | concurrency | inferences/s | p50 ms | service CPU ms/req | gateway CPU ms/req | errors |")
    print("|---|---|---|---|---|---|---|")
    for model, c, rps, p50, svc_ms, gw_ms, errors in rows:
        p50s = f"{p50:.2f}" if isinstance(p50, (int, float)) else "-"
        gws = f"{gw_ms:.3f}" if gw_ms is not None else "-"
        print(f"| {model} | {c} | {rps:.0f} | {p50s} | {svc_ms:.3f} | {gws} | {errors} |")


# ---- --ipc: the transport alone ----------------------------------------------------------------

def _echo_shm(sock: socket.socket) -> None:
    conn = Channel(sock)
    inputs, outputs = RegionReader(), RegionWriter("ipcbench-out")
    while (msg := conn.recv()) is not None:
        (generation, size, follows), refs = msg
        region = inputs.get(generation, size, conn.recv_fd() if follows else -1)
        arrays = [np.frombuffer(region.map, np.float32, r.nbytes // 4, r.offset) for r in refs]
        total = sum(aligned(a.nbytes) for a in arrays)
        out = outputs.ensure(total)
        back, off = [], 0
        for r, a in zip(refs, arrays, strict=True):
            out.write(off, a)  # the model's output: one array written per input
            back.append(TensorRef(r.name, "FP32", r.shape, off, a.nbytes))
            off += aligned(a.nbytes)
        del arrays
        conn.send(*_announced(out, back))
    outputs.close()
    inputs.close()


def _announced(region: Region, refs: list[TensorRef]) -> tuple[tuple, int]:
    ref, fd = region_ref(region)
    return (ref, refs), fd


def _echo_pickle(conn: Connection) -> None:
    while (msg := conn.recv()) is not None:
        conn.send({k: np.array(v) for k, v in msg.items()})


def ipc(args: argparse.Namespace) -> None:
    ctx = mp.get_context("fork")
    for nbytes in (64, 64 * 1024, 1 << 20, 8 << 20):
        arrays = {f"INPUT{i}": np.random.default_rng(i).random(nbytes // 4, dtype=np.float32) for i in range(2)}
        rounds = max(20, min(2000, (64 << 20) // nbytes))
        results = {}
        for label, target in (("shm", _echo_shm), ("pickle", _echo_pickle)):
            chan: Channel | None = None
            if label == "shm":  # messages on the channel's connection, region descriptors beside them
                here, there = socket.socketpair()
                chan = Channel(here)
                ours = chan.conn
                proc = ctx.Process(target=target, args=(there,))
            else:
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=target, args=(theirs,))
            proc.start()
            writer, reader = RegionWriter("ipcbench-in"), RegionReader()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(rounds):
                    if chan is not None:
                        region = writer.ensure(sum(aligned(a.nbytes) for a in arrays.values()))
                        refs, off = [], 0
                        for name, a in arrays.items():
                            region.write(off, a)
                            refs.append(TensorRef(name, "FP32", a.shape, off, a.nbytes))
                            off += aligned(a.nbytes)
                        chan.send(*_announced(region, refs))
                        (generation, size, follows), back = ours.recv()
                        out = reader.get(generation, size, chan.recv_fd() if follows else -1)
                        got = [bytes(out.view(r.offset, r.nbytes)) for r in back]  # the response's copy
                    else:
                        ours.send(arrays)
                        got = [a.tobytes() for a in ours.recv().values()]  # the response's copy
                    del got
                best = min(best, (time.perf_counter() - t0) / rounds)
            ours.send(None)
            proc.join()
            writer.close()
            reader.close()
            results[label] = best
        print(f"2 inputs + 2 outputs of {nbytes} B each: shared memory {results['shm'] * 1e6:.0f} us, "
              f"pickled {results['pickle'] * 1e6:.0f} us per round trip", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--instances", type=int, default=2, help="instances of each model")
    ap.add_argument("--direct", action="store_true", help="also load the python service directly (no gateway)")
    ap.add_argument("--triton", metavar="HTTP,GRPC,PID",
                    help="also load a Triton serving the same py_add_sub (e.g. ../shared/bench/start_triton.sh on "
                         "a repository from tests.models.python_models) directly; PID: its server process")
    ap.add_argument("--ipc", action="store_true", help="measure the service<->worker transport only")
    args = ap.parse_args()
    (ipc if args.ipc else serving)(args)


if __name__ == "__main__":
    procs.clean_exit()
    main()
