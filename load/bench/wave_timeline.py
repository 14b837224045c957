"""One c8 wave through the gateway, timed from the system calls; and the gateway's instructions
per request with perf_analyzer as the client (what the side by side sends).

    python -m load.bench.wave_timeline timeline [-m add_sub] [--protocol grpc] [-c 8]
    python -m load.bench.wave_timeline callgrind [-m add_sub] [--protocol grpc|http|http-json] [-c 8]

``timeline``: an ONNX service and a gateway (this tree) on the bench models, perf_analyzer
driving the gateway; after 3 s, ``perf record`` takes the read/write/sendmsg system calls of the
three processes for one second (syscall tracepoints: no ptrace stop per call). A wave runs
from one answer the service writes on the hop to the next; per wave: the service's answer to the
gateway's read of it (A), the gateway's read to its first answer written to a client (B) and its
last (B'), the first answer written to perf_analyzer's next send (C), that send to the gateway's
read of it (D), the gateway's first request read to its first and last hop send (E, E'), the last
hop send to the service's answer (F). Medians over the second's waves, and hop sends per wave.
The processes are reniced to -15 for the run (the machine is shared: a neighbour's CPU otherwise
decides the waits). Needs ``perf`` and root.

``callgrind``: the gateway under callgrind (instrumentation off), perf_analyzer for 3 s of
warm-up, then instrumentation on for two 4 s windows; instructions / the requests the service
counted meanwhile. ``python -m load.bench.per_request callgrind`` drives with ``python -m load``,
whose requests carry no parameters; perf_analyzer's gRPC requests carry
``triton_enable_empty_final_response``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from load.bench import callgrind, procs, sbs
from load.bench.hop_batches import bench_models

_SYSCALLS = ",".join(f"syscalls:{e}" for e in ("sys_enter_read", "sys_exit_read", "sys_enter_write",
                                                 "sys_enter_writev", "sys_enter_sendmsg"))
_PHASES = ["A service answer -> gateway reads it", "B gateway read -> 1st client answer written",
           "B' gateway read -> last client answer written", "C 1st answer written -> client's 1st send",
           "D client's send -> gateway reads it", "E gateway's 1st request read -> 1st hop send",
           "E' gateway's 1st request read -> last hop send", "F last hop send -> service answer", "wave"]


def _renice(pid: int, nice: int) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        subprocess.run(["renice", "-n", str(nice), "-p", task.name], capture_output=True, check=False)
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass


def _sockets(pid: int, port: int, local: bool) -> set[int]:
    """``pid``'s fds of established TCP connections whose local (``local``) or remote port is ``port``."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1 if local else 2].split(":")[1], 16) == port and f[3] == "01":
            inodes.add(f[9])
    fds = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            fds.add(int(fd.name))
    return fds


def _busiest(script: str, tid: int, candidates: set[int]) -> int:
    """Of ``candidates`` (the hop and the discovery's connection), the fd ``tid`` wrote to most."""
    counts = {fd: len(re.findall(rf"\s{tid}\s.*sys_enter_write\w*: fd: 0x{fd:08x}", script)) for fd in candidates}
    return max(counts, key=lambda fd: counts[fd]) if counts else -1


def waves(script: str, gw: int, svc: int, gw_hop: int, svc_hop: int) -> dict[str, Any]:
    """The phases of each wave in ``perf script``'s text (see the module's doc)."""
    last_fd: dict[str, int | None] = {}
    events: list[tuple[float, str]] = []
    for line in script.splitlines():
        m = re.match(r"\s*(.+?)\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+syscalls:(\w+): (.*)", line)
        if not m:
            continue
        _, tid, ts, name, args = m.groups()
        found = re.search(r"fd: 0x([0-9a-f]+)", args)
        fd = int(found.group(1), 16) if found else None
        if name == "sys_enter_read":
            last_fd[tid] = fd
            continue
        kind = None
        if name == "sys_exit_read":
            n = int(args.strip(), 16)
            if n <= 0 or n > 2**62:
                continue
            fd = last_fd.get(tid)
            if tid == str(gw):
                kind = "H_IN" if fd == gw_hop else "C_IN"
        elif name in ("sys_enter_write", "sys_enter_writev"):
            if tid == str(gw):
                kind = "H_OUT" if fd == gw_hop else "C_OUT"
            elif tid == str(svc) and fd == svc_hop:
                kind = "S_OUT"
        elif name == "sys_enter_sendmsg" and tid not in (str(gw), str(svc)):
            kind = "P_SEND"
        if kind:
            events.append((float(ts) * 1e6, kind))
    events.sort()
    answers = [i for i, (_, k) in enumerate(events) if k == "S_OUT"]
    rows = []
    for a, b in zip(answers, answers[1:], strict=False):
        seg = events[a:b + 1]
        t0, t5 = seg[0][0], seg[-1][0]

        def first(kind: str, after: float, seg: list[tuple[float, str]] = seg) -> float | None:
            return next((t for t, k in seg if k == kind and t >= after), None)
        t1 = first("H_IN", t0)
        t2 = first("C_OUT", t1) if t1 is not None else None
        t3 = first("C_IN", t2) if t2 is not None else None
        send = first("P_SEND", t2) if t2 is not None else None
        if t1 is None or t2 is None or t3 is None or send is None:
            continue
        hops = [t for t, k in seg if k == "H_OUT" and t >= t3]
        if not hops:
            continue
        t2_last = max(t for t, k in seg if k == "C_OUT" and t < hops[-1])
        rows.append((t1 - t0, t2 - t1, t2_last - t1, send - t2, t3 - send, hops[0] - t3, hops[-1] - t3,
                     t5 - hops[-1], t5 - t0, len(hops)))
    if not rows:
        return {"waves": 0}
    return {"waves": len(rows), "hop_sends_per_wave": round(statistics.mean(r[-1] for r in rows), 2),
            "median_us": {name: round(statistics.median(r[i] for r in rows)) for i, name in enumerate(_PHASES)}}


def _perf_analyzer(url: str, args: argparse.Namespace, window_ms: int, trials: int,
                   data: Path) -> subprocess.Popen[bytes]:
    tool, env = sbs.perf_analyzer()
    json_formats = ["--input-tensor-format=json", "--output-tensor-format=json"] if args.protocol == "http-json" else []
    return subprocess.Popen([tool, "-m", args.model, "-u", url, "-i", "grpc" if args.protocol == "grpc" else "http",
                             *json_formats,
                             "--concurrency-range", str(args.concurrency), "--measurement-interval", str(window_ms),
                             "--max-trials", str(trials), "--input-data", str(data), "--stability-percentage", "999"],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["timeline", "callgrind"])
    ap.add_argument("-m", "--model", default="add_sub")
    ap.add_argument("--protocol", choices=["grpc", "http", "http-json"], default="grpc")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--bench-models", default="/tmp/bench-models", help="gen_models.py output (made if missing)")
    ap.add_argument("--out", help="output directory (default: a new temporary one)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="wave-"))
    out.mkdir(parents=True, exist_ok=True)
    models = bench_models(args.bench_models)
    data = models / "perf_data" / f"{args.model}.json"
    svc = procs.service(models / "onnx_repo", out / "service.log")
    prefix = callgrind.command(out / "cg.out", instr_at_start=False) if args.mode == "callgrind" else None
    try:
        gw = procs.gateway([svc.grpc], out / "gateway.log", prefix=prefix, timeout=300)
    except Exception:
        svc.stop()
        raise
    url = gw.grpc if args.protocol == "grpc" else gw.http

    def served() -> tuple[int, int]:  # (requests, executions) the service counted
        with urllib.request.urlopen(f"http://{svc.http}/v2/models/{args.model}/stats") as r:
            stats = json.load(r)["model_stats"][0]
        return int(stats["inference_count"]), int(stats["execution_count"])
    result: dict[str, Any] = {"mode": args.mode, "model": args.model, "protocol": args.protocol,
                              "concurrency": args.concurrency, "out": str(out)}
    try:
        if args.mode == "timeline":
            for pid in (gw.pid, svc.pid):
                _renice(pid, -15)
            pa = _perf_analyzer(url, args, 2000, 3, data)
            time.sleep(0.5)
            _renice(pa.pid, -15)
            time.sleep(2.5)
            subprocess.run(["timeout", "-s", "INT", "1", "perf", "record", "-q", "-e", _SYSCALLS, "-p",
                            f"{gw.pid},{svc.pid},{pa.pid}", "-o", str(out / "perf.data")], capture_output=True)
            pa.wait(120)
            hop_port = int(svc.grpc.rsplit(":", 1)[1])
            gw_fds, svc_fds = _sockets(gw.pid, hop_port, False), _sockets(svc.pid, hop_port, True)
            script = subprocess.run(["perf", "script", "-i", str(out / "perf.data")], capture_output=True,
                                    text=True).stdout
            result.update(waves(script, gw.pid, svc.pid, _busiest(script, gw.pid, gw_fds),
                                 _busiest(script, svc.pid, svc_fds)))
        else:
            pa = _perf_analyzer(url, args, 3000, 1, data)
            pa.wait(600)
            before = set(out.glob("cg.out*"))
            n0 = served()
            callgrind.control(gw.pid, "--zero")
            callgrind.control(gw.pid, "--instr=on")
            t0 = time.monotonic()
            _perf_analyzer(url, args, 4000, 2, data).wait(600)
            callgrind.control(gw.pid, "--instr=off")
            n1 = served()
            n, runs = n1[0] - n0[0], n1[1] - n0[1]
            seconds = time.monotonic() - t0
            callgrind.control(gw.pid, "--dump")
            total, _ = callgrind.totals(callgrind.wait_dump(out / "cg.out", before))
            result.update(instructions=total // max(1, n), requests=n, rps=round(n / seconds, 1),
                          rows_per_execution=round(n / max(1, runs), 2))
    finally:
        gw.stop()
        svc.stop()
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    procs.clean_exit()
    main()
