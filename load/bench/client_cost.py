"""What perf_analyzer (the client) pays per request when it talks to the gateway, and when it talks
to the ONNX service directly, and what each server writes to it (docs/perf/client-cost.md).

    python -m load.bench.client_cost [RESULTS_DIR] [--models add_sub] [--modes grpc,http]
        [--concurrency 8] [--repeats 3] [--window 4] [--tree-b DIR]

One ONNX service and one gateway in front of it (as the side by side starts them: load/bench/sbs.py),
and, with ``--tree-b DIR``, a second gateway in front of the same service run from another source
tree (``DIR``: a checkout with a change to compare; "gateway-b"). Per cell and repeat, each of
direct, gateway (and gateway-b) in turn: one perf_analyzer run (the binary ``sbs.perf_analyzer``
finds) with a window long enough for two samples taken in its middle, each divided by the requests
the service counted in the same seconds (its statistics extension):

1. ``--window`` seconds: CPU of the client, the gateway and the service from /proc (user and
   system apart for the client), and, where ``perf`` can read the syscall tracepoints, the client's
   and the servers' system calls and context switches (``perf stat -e syscalls:sys_enter_*``:
   counted in the kernel, nothing slows down);
2. 1.5 s: ``strace -f -e trace=write,writev,sendmsg,sendto`` on the process the client talks to,
   for its writes on the client's connections (sockets on its front port, from ``ss``): answers
   per write. (strace slows that process: this sample gives counts, never CPU.)

On a machine shared with other work, compare counts (system calls, writes, answers per write)
more than CPU seconds, and alternate (the repeats do) rather than trust one run.
Writes ``RESULTS_DIR/runs.jsonl`` and ``RESULTS_DIR/client_cost.md`` (printed).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from load.bench import procs, sbs

ROOT = Path(__file__).resolve().parents[2]
HZ = os.sysconf("SC_CLK_TCK")
SYSCALLS = ("recvmsg", "recvfrom", "read", "sendmsg", "sendto", "write", "writev",
            "epoll_wait", "epoll_pwait", "poll", "ppoll", "futex")
GROUPS = {"recv": ("recvmsg", "recvfrom", "read"), "send": ("sendmsg", "sendto", "write", "writev"),
          "wait": ("epoll_wait", "epoll_pwait", "poll", "ppoll"), "futex": ("futex",)}
STRACE_S = 1.5
_CALL = re.compile(r"^\d+\s+(?:\S+\s+)?(\w+)\((\d+),.*=\s+(-?\d+)")


def served(http: str, model: str) -> int:
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=5) as r:
        return sum(int(m.get("inference_count", 0)) for m in json.load(r).get("model_stats", []))


def cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``'s threads."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[11]) / HZ, int(f[12]) / HZ


def perf_stat(pids: dict[str, int], seconds: float, tmp: Path) -> dict[str, subprocess.Popen[bytes]]:
    if shutil.which("perf") is None or not Path("/sys/kernel/tracing/events/syscalls").exists():
        return {}
    events = ["context-switches"] + [f"syscalls:sys_enter_{c}" for c in SYSCALLS]
    return {name: subprocess.Popen(["perf", "stat", "-x", ",", "-e", ",".join(events), "-p", str(pid),
                                    "-o", str(tmp / f"{name}.perf"), "--", "sleep", str(seconds)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()}


def read_perf(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        f = line.split(",")
        if len(f) > 2 and f[0].isdigit():
            out[f[2].replace("syscalls:sys_enter_", "")] = int(f[0])
    return out


def front_fds(pid: int, port: str) -> set[str]:
    """The file descriptors of ``pid``'s connections accepted on ``port``."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True).stdout
    return set(re.findall(rf"pid={pid},fd=(\d+)", out))


def writes_sample(pid: int, port: str, http: str, model: str, tmp: Path) -> dict[str, Any]:
    """Writes (and bytes) on the client's connections per answer, over STRACE_S seconds."""
    if shutil.which("strace") is None:
        return {}
    fds = front_fds(pid, port)
    log = tmp / "strace.txt"
    n0 = served(http, model)
    subprocess.run(["timeout", str(STRACE_S), "strace", "-f", "-qq", "-e", "trace=write,writev,sendmsg,sendto",
                    "-e", "abbrev=all", "-s", "0", "-p", str(pid), "-o", str(log)], capture_output=True)
    n = served(http, model) - n0
    calls = nbytes = 0
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = _CALL.match(line)
        if m and m.group(2) in fds and int(m.group(3)) > 0:
            calls += 1
            nbytes += int(m.group(3))
    return {"answers_per_write": round(n / calls, 2) if calls else None,
            "bytes_per_answer": round(nbytes / n) if n else None, "connections": len(fds)}


def one_run(label: str, pids: dict[str, int], front: sbs.Server, svc_http: str, pa: str, pa_env: dict[str, str],
            key: tuple[str, str, int], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model, mode, c = key
    proto = {"grpc": ["-i", "grpc"], "http": ["-i", "http"],
             "http-json": ["-i", "http", "--input-tensor-format=json", "--output-tensor-format=json"]}[mode]
    url = front.grpc if mode == "grpc" else front.http
    settle = 2.5
    total_ms = int((settle + args.window + STRACE_S + 3) * 1000)
    out_csv = tmp / "pa.csv"
    out_csv.unlink(missing_ok=True)
    client = subprocess.Popen([pa, "-m", model, "-u", url, *proto, "--concurrency-range", str(c),
                               "--measurement-interval", str(total_ms // 3), "--max-trials", "3",
                               "--stability-percentage", "999", "-f", str(out_csv),
                               "--input-data", str(args.models_dir / "perf_data" / f"{model}.json")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **pa_env})
    for name in ("client", *pids):
        (tmp / f"{name}.perf").unlink(missing_ok=True)
    rec: dict[str, Any] = {"label": label, "model": model, "mode": mode, "concurrency": c,
                           "load_avg": sbs.load_average()}
    try:
        time.sleep(settle)
        watched = {"client": client.pid, **pids}
        stats = perf_stat(watched, args.window, tmp)
        t0, n0, c0 = time.monotonic(), served(svc_http, model), {k: cpu(p) for k, p in watched.items()}
        for p in stats.values():
            p.wait()
        if not stats:
            time.sleep(args.window)
        t1, n1, c1 = time.monotonic(), served(svc_http, model), {k: cpu(p) for k, p in watched.items()}
        n = max(1, n1 - n0)
        rec["infer_per_s"] = round(n / (t1 - t0))
        rec["cpu_us_per_req"] = {k: round(1e6 * (sum(c1[k]) - sum(c0[k])) / n, 1) for k in watched}
        rec["client_user_sys_us"] = [round(1e6 * (c1["client"][i] - c0["client"][i]) / n, 1) for i in (0, 1)]
        rec["per_req"] = {}
        # perf counts over its own `sleep` (--window seconds from its start, a moment after
        # Popen on a busy machine): divided by the requests of that many seconds at this rate
        reqs = max(1.0, args.window * n / (t1 - t0))
        for k in stats:
            counts = read_perf(tmp / f"{k}.perf")
            row = {g: round(sum(counts.get(s, 0) for s in names) / reqs, 3) for g, names in GROUPS.items()}
            row["context_switches"] = round(counts.get("context-switches", 0) / reqs, 3)
            rec["per_req"][k] = row
        front_pid = pids["gateway"] if "gateway" in pids else pids["service"]
        rec["writes"] = writes_sample(front_pid, (url if mode == "grpc" else front.http).rsplit(":", 1)[1],
                                      svc_http, model, tmp)
    finally:
        client.wait(timeout=total_ms / 1000 * 3 + 60)
    if out_csv.exists():
        rows = list(csv.DictReader(out_csv.open()))
        if rows:
            rec["p50_us"], rec["p99_us"] = int(rows[0]["p50 latency"]), int(rows[0]["p99 latency"])
    return rec


def _med(given: list[float | None]) -> str:
    vals = [v for v in given if v is not None]
    if not vals:
        return "–"
    m = statistics.median(vals)

    def f(v: float) -> str:
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f(m) if len(vals) == 1 else f"{f(m)} ({f(min(vals))}–{f(max(vals))})"


def report(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Client cost per request ({meta['when']})", "",
             f"command: `{meta['command']}`  ", f"commit: {meta['commit']}{meta['tree_b']}  ",
             f"load average at start {meta['load_start']}, at end {meta.get('load_end', '?')}", "",
             "Median (min–max) over the repeats. Per request: CPU µs from /proc, system calls and context "
             "switches from `perf stat` (recv = read/recvmsg/recvfrom, send = write/writev/sendmsg/sendto, "
             "wait = epoll/poll), answers per write on the client's connections of the server it talks to "
             "(strace).", "",
             "| model | proto | c | server | infer/s | p50 µs | client µs (user / sys) | client recv / send / wait / futex "
             "| client cs | server writes: answers per write | gateway µs | service µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["model"], r["mode"], r["concurrency"]) for r in records))
    labels = list(dict.fromkeys(r["label"] for r in records))
    for k in keys:
        for label in labels:
            rs = [r for r in records if (r["model"], r["mode"], r["concurrency"]) == k and r["label"] == label
                  and "cpu_us_per_req" in r]
            if not rs:
                continue

            def get(*path: str, rs: list[dict[str, Any]] = rs) -> list[Any]:
                out = []
                for r in rs:
                    v: Any = r
                    for p in path:
                        v = v.get(p) if isinstance(v, dict) else None
                    out.append(v)
                return out
            us = [r["client_user_sys_us"] for r in rs]
            calls = " / ".join(_med(get("per_req", "client", g)) for g in GROUPS)
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {label} | {_med(get('infer_per_s'))} | {_med(get('p50_us'))} "
                         f"| {_med(get('cpu_us_per_req', 'client'))} ({_med([u[0] for u in us])} / "
                         f"{_med([u[1] for u in us])}) | {calls} | {_med(get('per_req', 'client', 'context_switches'))} "
                         f"| {_med(get('writes', 'answers_per_write'))} | {_med(get('cpu_us_per_req', 'gateway'))} "
                         f"| {_med(get('cpu_us_per_req', 'service'))} |")
    return "\n".join(lines) + "\n"


def start_gateway(label: str, tree: Path, svc_grpc: int, repo: str, res: Path) -> sbs.Server:
    http, grpc = sbs.free_port(), sbs.free_port()
    log = res / f"{label}.log"
    env = {"MESHSERVE_HOP_KEY_FILE": str(res / "hop.key"), **os.environ, "PYTHONPATH": str(tree)}
    proc = procs.spawn([sys.executable, "-m", "meshserve", "gateway", "--host", "127.0.0.1", "--http-port", str(http),
                        "--grpc-port", str(grpc), "--log-level", "WARNING", "--repository", repo,
                        "--federate-metrics", "--workers", "1", "--metrics-port", "0",
                        "--upstream", f"127.0.0.1:{svc_grpc}"], cwd=tree, env=env,
                       stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return sbs.Server(label, proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m load.bench.client_cost", description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", type=Path, default=None)
    ap.add_argument("--models", default="add_sub")
    ap.add_argument("--modes", default="grpc,http")
    ap.add_argument("--concurrency", default="8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=float, default=4.0, help="seconds of the CPU and system-call sample")
    ap.add_argument("--tree-b", type=Path, default=None, help="a second gateway run from this source tree")
    ap.add_argument("--models-dir", type=Path, default=None, help="generated bench models (default: into RESULTS_DIR)")
    args = ap.parse_args(argv)
    res = (args.results or Path(tempfile.mkdtemp(prefix="client-cost-"))).resolve()
    res.mkdir(parents=True, exist_ok=True)
    tmp = res / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ.setdefault("BENCH_ORT_THREADS", "2")
    if args.models_dir is None:
        args.models_dir = res / "models"
        if not (args.models_dir / "onnx_repo").exists():
            subprocess.run([sys.executable, str(sbs.BENCH / "gen_models.py"), str(args.models_dir)], check=True,
                           capture_output=True)
    pa, pa_env = sbs.perf_analyzer()
    repo = str(args.models_dir / "onnx_repo")
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": sbs.load_average(),
            "command": "python -m load.bench.client_cost " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip(),
            "tree_b": f"; gateway-b from {args.tree_b}" if args.tree_b else ""}
    servers: list[sbs.Server] = []
    records: list[dict[str, Any]] = []
    try:
        svc_grpc, svc_http = sbs.free_port(), sbs.free_port()
        svc = sbs.start_meshserve("direct", ["service", "onnx", "--repository", repo, "--host", "127.0.0.1",
                                             "--grpc-port", str(svc_grpc), "--http-port", str(svc_http),
                                             "--model-control-mode", "explicit", "--load-model", "*",
                                             "--log-level", "WARNING"], svc_http, svc_grpc, res)
        servers.append(svc)
        sbs.wait_ready(svc, 120)
        fronts = {"direct": (svc, {"service": svc.proc.pid})}
        for label, tree in (("gateway", ROOT), ("gateway-b", args.tree_b)):
            if tree is not None:
                gw = start_gateway(label, tree.resolve(), svc_grpc, repo, res)
                servers.append(gw)
                sbs.wait_ready(gw, 120)
                fronts[label] = (gw, {"gateway": gw.proc.pid, "service": svc.proc.pid})
        keys = [(m, mode, int(c)) for m in args.models.split(",") for mode in args.modes.split(",")
                for c in args.concurrency.split(",")]
        for key in keys:  # a warm-up run per server first (a fresh process's first requests cost more)
            for label, (front, pids) in fronts.items():
                one_run(label, pids, front, svc.http, pa, pa_env, key, argparse.Namespace(**{**vars(args), "window": 1}),
                        tmp)
        for key in keys:
            for rep in range(args.repeats):
                for label, (front, pids) in fronts.items():
                    rec = one_run(label, pids, front, svc.http, pa, pa_env, key, args, tmp)
                    rec["repeat"] = rep
                    records.append(rec)
                    with (res / "runs.jsonl").open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(json.dumps(rec), flush=True)
        meta["load_end"] = sbs.load_average()
        text = report(records, meta)
        (res / "client_cost.md").write_text(text)
        print(text)
        return 0
    finally:
        for s in reversed(servers):
            s.stop()


if __name__ == "__main__":
    procs.clean_exit()
    raise SystemExit(main())
