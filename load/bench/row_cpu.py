"""Where the ONNX service's CPU per served row goes, thread by thread, against raw onnxruntime at
the same rows per execution (issue 36's "within 1.5× of raw onnxruntime").

    python -m load.bench.row_cpu [-m mlp] [--protocol grpc] [-c 32] [-n 20000] [--via-gateway]
        [--bench-models /tmp/bench-models] [--param KEY=VALUE] [--service-env KEY=VALUE]
        [--perf FILE | --pyspy FILE]

An ONNX service on the bench models (and a gateway in front of it with ``--via-gateway``);
``python -m load`` sends 3000 requests (not counted), then ``-n`` more at ``-c``. Over those, every
thread of the service (from /proc/PID/task) and the gateway's process are read: CPU per row
(the service's inference_count). The threads are told apart by role: the event loop (the process's
main thread), the instance's worker thread (started by the first batch, so a thread that was not
there before the first request: joins the inputs, calls ``Session.run``, encodes the responses) and
onnxruntime's intra-op pools (the threads there at start, made when the sessions loaded).
Then the same graph runs alone at the measured rows per execution
(``load/bench/sbs.py:raw_ort_cpu_per_row``, the service's session options) and the ratios print;
the graph alone at onnxruntime's own thread default (``intra_op_thread_count`` 0, Triton's for a
config without it) as well. ``--param KEY=VALUE``: the model (and the raw reference) with that
config parameter (e.g. ``intra_op_thread_count=0``); ``--service-env KEY=VALUE``: the service's
environment (e.g. ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).
``--perf FILE``: ``perf record -g`` of the service over the measured requests as well (shared
objects and kernel symbols: ``perf report -i FILE --sort dso``). ``--pyspy FILE``: instead, py-spy's
samples of the thread holding the GIL (``--gil --native``, raw format) over the measured requests:
the Python (and C) the service runs per row (``python -m load.bench.pyspy_summary FILE``). py-spy
stops the process for each sample: read shares from that run, not its CPU per row.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load.bench import procs, sbs
from load.bench.hop_batches import bench_models, model_stats


def threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds) of every live thread of ``pid``."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(t.name)] = ((t / "comm").read_text().strip(), (int(f[11]) + int(f[12])) / sbs.HZ)
        except (OSError, IndexError, ValueError):
            pass
    return out


def roles(pid: int, at_start: set[int], before: dict[int, tuple[str, float]],
          after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role over the interval: event loop (``pid``), onnxruntime pool (the other
    threads of ``at_start``, before any request), worker (threads started since: the executor's)."""
    out = {"event loop": 0.0, "worker": 0.0, "onnxruntime pool": 0.0}
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        out["event loop" if tid == pid else "onnxruntime pool" if tid in at_start else "worker"] += d
    return out


def with_params(repo: Path, model: str, params: list[str], out: Path) -> Path:
    """A copy of ``repo`` at ``out`` whose ``model`` config carries the ``KEY=VALUE`` parameters
    (``--param intra_op_thread_count=1``: what a Triton user would write in config.pbtxt)."""
    shutil.copytree(repo, out, symlinks=True)
    config = out / model / "config.pbtxt"
    lines = [config.read_text()]
    for kv in params:
        key, _, value = kv.partition("=")
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n')
    config.write_text("".join(lines))
    return out


def raw_cpu(repo: Path, data: Path, model: str, batch: float, runs: int) -> dict[str, Any]:
    """The same graph alone at ``batch`` rows per run, with ``repo``'s config (sbs.RawOrt)."""
    raw_ort = sbs.RawOrt(repo, data, None)
    try:
        return raw_ort.measure(model, batch, runs)
    finally:
        raw_ort.stop()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    models = bench_models(args.bench_models)
    work = Path(tempfile.mkdtemp(prefix="row-cpu-"))
    repo = models / "onnx_repo"
    if args.param:
        repo = with_params(repo, args.model, args.param, work / "repo")
    env = dict(kv.partition("=")[::2] for kv in args.service_env)
    svc = procs.service(repo, work / "service.log", env=env or None)
    gw = None
    try:
        if args.via_gateway:
            gw = procs.gateway([svc.grpc], work / "gateway.log")
        front = gw or svc
        at_start = set(threads(svc.pid))
        load = [sys.executable, "-m", "load", "--http", front.http, "--grpc", front.grpc, "-m", args.model,
                "--protocol", args.protocol, "-c", str(args.concurrency), "--warmup", "0", "--quiet"]
        subprocess.run([*load, "-n", "3000"], check=True, capture_output=True, cwd=procs.ROOT)
        rec = None
        if args.perf or args.pyspy:
            tool = (["perf", "record", "-F", "499", "-g", "-p", str(svc.pid), "-o", args.perf] if args.perf else
                    ["py-spy", "record", "-r", "500", "--native", "--gil", "--threads", "-f", "raw",
                     "-o", args.pyspy, "-p", str(svc.pid)])
            rec = subprocess.Popen(tool, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)  # (attached to every thread before the requests)
        rows0, execs0 = model_stats(svc.http, args.model)
        t0, g0, w0 = threads(svc.pid), procs.proc_tree_cpu_s(gw.pid) if gw else 0.0, time.monotonic()
        subprocess.run([*load, "-n", str(args.requests)], check=True, capture_output=True, cwd=procs.ROOT)
        t1, g1, wall = threads(svc.pid), procs.proc_tree_cpu_s(gw.pid) if gw else 0.0, time.monotonic() - w0
        rows1, execs1 = model_stats(svc.http, args.model)
        if rec is not None:
            rec.send_signal(signal.SIGINT)
            rec.wait(60)
    finally:
        if gw is not None:
            gw.stop()
        svc.stop()
    rows = rows1 - rows0
    batch = rows / max(1, execs1 - execs0)
    per_row = {role: round(1e6 * s / rows, 1) for role, s in roles(svc.pid, at_start, t0, t1).items()}
    raw = raw_cpu(repo, models / "perf_data", args.model, batch, args.raw_runs)
    service = sum(per_row.values())
    gateway = round(1e6 * (g1 - g0) / rows, 1) if gw else None
    out: dict[str, Any] = {
        "model": args.model, "params": args.param, "service_env": args.service_env, "protocol": args.protocol, "concurrency": args.concurrency,
        "via_gateway": bool(gw), "rows": rows, "rows_per_s": round(rows / wall), "rows_per_exec": round(batch, 2),
        "service_us_per_row": per_row, "gateway_us_per_row": gateway, "raw_ort": raw,
        "service_vs_raw": round(service / raw["cpu_us_per_row"], 2),
        "onnxruntime_threads_vs_raw": round((per_row["worker"] + per_row["onnxruntime pool"]) / raw["cpu_us_per_row"], 2),
        "load_avg": os.getloadavg()[0]}
    # (and at onnxruntime's own thread default, what Triton runs a config without the parameter with)
    ort_default = with_params(models / "onnx_repo", args.model, ["intra_op_thread_count=0"], work / "repo-ort-default")
    out["raw_ort_default_threads"] = raw_cpu(ort_default, models / "perf_data", args.model, batch, args.raw_runs)
    if gateway is not None:
        out["gateway_path_vs_raw"] = round((service + gateway) / raw["cpu_us_per_row"], 2)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.row_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="mlp")
    ap.add_argument("--protocol", choices=("grpc", "http-binary", "http-json"), default="grpc")
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("-n", "--requests", type=int, default=20000)
    ap.add_argument("--via-gateway", action="store_true")
    ap.add_argument("--bench-models", default="/tmp/bench-models", help="gen_models.py output (made if missing)")
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="a config parameter for the model (and the raw reference's session), e.g. "
                         "intra_op_thread_count=1; repeatable")
    ap.add_argument("--service-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the service (e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1); "
                         "repeatable")
    ap.add_argument("--raw-runs", type=int, default=1000, help="onnxruntime runs of the raw reference")
    tool = ap.add_mutually_exclusive_group()
    tool.add_argument("--perf", default=None, metavar="FILE", help="also perf record the service into FILE")
    tool.add_argument("--pyspy", default=None, metavar="FILE", help="also py-spy (--gil) the service into FILE")
    print(json.dumps(measure(ap.parse_args(argv)), indent=1), flush=True)


if __name__ == "__main__":
    procs.clean_exit()
    main()
