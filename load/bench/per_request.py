"""One meshserve process's cost per request while the load generator drives it: instructions
(callgrind), system calls (strace), py-spy samples or CPU seconds.

    python -m load.bench.per_request callgrind|strace|pyspy|cpu [--target gateway|service]
        [-m add_sub] [--protocol grpc|http-binary|http-json] [-n 3000] [-c 32] [--warmup 300]
        [--repository DIR] [--port-base 0] [--out DIR] [--via-gateway] [--service-args "..."]
        [--gateway-args "..."]

An ONNX service on ``--repository`` (default: the team's bench models, generated into
``--bench-models`` if missing) and, for ``--target gateway``, a gateway in front of it. The
measured process (the gateway, or the service for ``--target service``) runs under the mode's
tool; ``python -m load`` sends ``--warmup`` requests, then the counters start, then it sends
``-n`` more at concurrency ``-c``:

- ``callgrind``: user-space instructions per request, every thread of the process, with the
  garbage collector's share apart (``gc_collect_main``, inclusive) and glibc's memcpy's
  (``callgrind.MEMCPY_FUNCTION``: valgrind counts its ``rep movsb`` a byte at a time, so a copy
  weighs far more in this count than in CPU time). The process runs with
  instrumentation off until the warm-up is done. A count that repeats on a busy machine.
- ``strace``: system calls per request (``strace -c -f`` attached for the measured requests).
- ``pyspy``: ``py-spy record -f raw --threads`` of the measured requests (2000 Hz) into ``--out``;
  ``python -m load.bench.pyspy_summary`` reads it.
- ``cpu``: the process's user + system seconds over the measured requests, per request (noisy on
  a shared machine; no tool needed).

Ports: free ones (``--port-base 0``), or the service on BASE+100/+101 and the gateway on
BASE/BASE+1 (HTTP/gRPC). Every interpreter is this one (``sys.executable``: valgrind does not
follow a pyenv shim). Prints one line and writes ``result.json`` (and the tool's raw output) into
``--out`` (default: a new temporary directory).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load.bench import callgrind, procs

MODES = ("callgrind", "strace", "pyspy", "cpu")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m load.bench.per_request", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--target", choices=("gateway", "service"), default="gateway")
    ap.add_argument("-m", "--model", default="add_sub")
    ap.add_argument("--protocol", choices=("grpc", "http-binary", "http-json"), default="grpc")
    ap.add_argument("-n", "--requests", type=int, default=3000, help="measured requests")
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=300, help="requests before the counters start")
    ap.add_argument("--repository", help="model repository (default: the bench models' onnx_repo)")
    ap.add_argument("--bench-models", default="/tmp/bench-models", help="gen_models.py output (made if missing)")
    ap.add_argument("--port-base", type=int, default=0, help="0: free ports")
    ap.add_argument("--out", help="output directory (default: a new temporary one)")
    ap.add_argument("--ready-timeout", type=float, default=300, help="seconds for a process to become ready")
    ap.add_argument("--via-gateway", action="store_true",
                    help="with --target service: the load goes through a gateway in front of it (the hop)")
    ap.add_argument("--service-args", default="", help="more flags for the service (one string, shell words)")
    ap.add_argument("--gateway-args", default="", help="more flags for the gateway (one string, shell words)")
    return ap.parse_args(argv)


def per_request_strace(text: str, n: int) -> dict[str, float]:
    """System calls per request from ``strace -c`` output (its ``calls`` column), ``total`` included."""
    out: dict[str, float] = {}
    for row in text.splitlines():
        words = row.split()  # % time, seconds, usecs/call, calls, [errors], syscall
        if len(words) >= 5 and words[0][0].isdigit() and words[3].isdigit() and words[-1] != "total":
            out[words[-1]] = int(words[3]) / n
    out["total"] = sum(out.values())
    return out


def _load(args: argparse.Namespace, target: procs.Server, requests: int, out: Path | None) -> dict[str, Any]:
    """``python -m load`` against ``target``: ``requests`` requests, no time-based warm-up."""
    argv = [sys.executable, "-m", "load", "--http", target.http, "--grpc", target.grpc, "-m", args.model,
            "--protocol", args.protocol, "-c", str(args.concurrency), "-n", str(requests), "--warmup", "0",
            "--quiet"]
    with tempfile.TemporaryDirectory() as tmp:
        report = out or Path(tmp) / "load.json"
        run = subprocess.run([*argv, "--json", str(report)], cwd=procs.ROOT, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"python -m load failed ({run.returncode}): {run.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(report.read_text())
    if result.get("setup_errors"):  # (requests built without the model's inputs: not the model measured)
        raise SystemExit(f"the load generator's setup failed: {result['setup_errors']}")
    if result.get("failed"):
        raise SystemExit(f"{result['failed']} of the load generator's requests failed: {result.get('errors')}")
    return result


def _start(args: argparse.Namespace, out: Path) -> tuple[procs.Server, procs.Server | None, procs.Server]:
    """(service, gateway or None, the measured one of them)."""
    repo = Path(args.repository) if args.repository else None
    if repo is None:
        from load.bench.hop_batches import bench_models

        repo = bench_models(args.bench_models) / "onnx_repo"
    base = args.port_base
    prefix = callgrind.command(out / "cg.out", instr_at_start=False) if args.mode == "callgrind" else None
    svc = procs.service(repo, out / "service.log", ports=(base + 100, base + 101) if base else (0, 0),
                        prefix=prefix if args.target == "service" else None, timeout=args.ready_timeout,
                        control=shlex.split(args.service_args))
    if args.target == "service" and not args.via_gateway:
        return svc, None, svc
    try:
        gw = procs.gateway([svc.grpc], out / "gateway.log", ports=(base, base + 1) if base else (0, 0),
                           prefix=prefix if args.target == "gateway" else None, timeout=args.ready_timeout,
                           extra=shlex.split(args.gateway_args))
    except Exception:
        svc.stop()
        raise
    return svc, gw, gw if args.target == "gateway" else svc


def measure(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="per-request-"))
    out.mkdir(parents=True, exist_ok=True)
    need = {"callgrind": "valgrind", "strace": "strace", "pyspy": "py-spy"}.get(args.mode)
    if need and not (callgrind.available() if args.mode == "callgrind" else shutil.which(need)):
        raise SystemExit(f"{args.mode} needs {need}, which is not installed")
    svc, gw, target = _start(args, out)
    result: dict[str, Any] = {"mode": args.mode, "target": args.target, "model": args.model,
                              "protocol": args.protocol, "concurrency": args.concurrency, "requests": args.requests,
                              "out": str(out)}
    driven = gw if gw is not None else target  # (the gateway in front of a measured service: --via-gateway)
    try:
        _load(args, driven, args.warmup, None)
        pid = target.pid
        monitor: subprocess.Popen[bytes] | None = None
        if args.mode == "callgrind":
            before = set(out.glob("cg.out*"))
            callgrind.control(pid, "--zero")
            callgrind.control(pid, "--instr=on")
        elif args.mode == "strace":
            monitor = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(out / "strace.txt")],
                                       stderr=subprocess.DEVNULL)
            time.sleep(1)  # (strace attaches to every thread before it counts)
        elif args.mode == "pyspy":
            monitor = subprocess.Popen(["py-spy", "record", "-r", "2000", "-f", "raw", "--threads", "--nonblocking",
                                        "-o", str(out / "pyspy.txt"), "-p", str(pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
        cpu0 = procs.cpu_seconds(pid)
        result["load"] = _load(args, driven, args.requests, out / "load.json").get("goodput_rps")
        cpu1 = procs.cpu_seconds(pid)
        if args.mode == "callgrind":
            callgrind.control(pid, "--instr=off")
            callgrind.control(pid, "--dump")
            dump = callgrind.wait_dump(out / "cg.out", before)
            total, gc = callgrind.totals(dump)
            copies = callgrind.totals(dump, callgrind.MEMCPY_FUNCTION)[1]
            result.update(instructions=total // args.requests, gc=gc // args.requests,
                          memcpy=copies // args.requests)
        elif monitor is not None:
            monitor.send_signal(signal.SIGINT)
            monitor.wait(60)
        if args.mode == "strace":
            result["syscalls"] = per_request_strace((out / "strace.txt").read_text(), args.requests)
        elif args.mode == "pyspy":
            result["profile"] = str(out / "pyspy.txt")
        result["cpu_us"] = round((cpu1 - cpu0) / args.requests * 1e6, 1)
    finally:
        if gw is not None:
            gw.stop()
        svc.stop()
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def line(r: dict[str, Any]) -> str:
    cell = f"{r['target']} {r['model']} {r['protocol']} c{r['concurrency']} (N={r['requests']})"
    if r["mode"] == "callgrind":
        return (f"{cell}: {r['instructions']} instructions per request, of which gc {r['gc']}, "
                f"memcpy {r['memcpy']} ({r['out']})")
    if r["mode"] == "strace":
        calls = sorted(r["syscalls"].items(), key=lambda kv: -kv[1])
        return f"{cell}: system calls per request: " + ", ".join(f"{k} {v:.2f}" for k, v in calls[:12])
    if r["mode"] == "pyspy":
        return f"{cell}: py-spy profile {r['profile']} (python -m load.bench.pyspy_summary FILE)"
    return f"{cell}: {r['cpu_us']} µs of CPU per request ({r['out']})"


def main(argv: list[str] | None = None) -> None:
    print(line(measure(parse_args(argv))), flush=True)


if __name__ == "__main__":
    procs.clean_exit()
    main()
