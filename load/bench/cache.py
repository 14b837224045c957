"""Triton's response cache, measured: a request mix with 90% repeats through the gateway with the
cache off and on, the same mix against the real Triton with its local cache off and on, side by
side in one run, and a mix with no repeat (what the cache costs a miss). docs/perf/response-cache.md.

    python -m load.bench --cache [-n 4000] [-c 16] [--rounds 3] [--no-triton] [--json PATH]
    python -m load.bench.cache ...   (the same)
    python -m load.bench --cache --hit-cost   (the stores alone: one process's vs the workers' shared one)
    python -m load.bench --cache --instructions -n 500   (the gateway's instructions per request, callgrind)
    python -m load.bench --cache --zero-ab off,on,nostore,hot -n 12000 --rounds 6   (the 0% mix, A/B)

The model is the team's bench add_sub (../shared/bench/gen_models.py: FP32 [1,16] INPUT0/INPUT1,
max_batch_size 64, dynamic batching; meshserve serves its ONNX graph, Triton its Python-backend
model.py) with ``response_cache { enable: true }`` added. meshserve: one service, a gateway without
--cache-config ("off") and one with ``--cache-config local,size=SIZE`` ("on"). Triton: one server
with ``--cache-config local,size=SIZE``, the model twice (``add_sub`` cached, ``add_sub_nc`` the same
without response_cache: "off").

A mix of ``-n`` requests: with probability ``--repeat`` a request repeats one of ``--hot`` inputs
(drawn per round), else its inputs are new. The client is meshserve's own HTTP/2 gRPC client
on uvloop (the cheapest client here, so the cells measure the servers; the same client for every cell,
meshserve's and Triton's): ``-c`` calls in flight over
``--connections`` connections, closed loop. A request is counted a *hit* when it repeats an input
whose first answer had come back before it was sent; "hit p99" is their p99, "uncached p99" the
p99 of every request of the same mix with the cache off. Each round runs every cell once, in turn,
with its own inputs; the table gives each cell's median over the rounds. CPU: the gateway's (and
service's, Triton's) seconds per request, and the foreign CPU (every other process on the
machine) while the cells ran.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from load.bench import procs
from meshserve._proto import grpc_service_pb2 as pb
from meshserve.server.h2.client import Channel

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
_INFER = "/inference.GRPCInferenceService/ModelInfer"
CACHED = "response_cache { enable: true }\n"


# ---- the request mix ---------------------------------------------------------------------------

def _payload(model: str, rng: np.random.Generator) -> bytes:
    req = pb.ModelInferRequest(model_name=model)
    for name in ("INPUT0", "INPUT1"):
        req.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        req.raw_input_contents.append(rng.standard_normal((1, 16), dtype=np.float32).tobytes())
    return req.SerializeToString()


def mix(model: str, n: int, repeat: float, hot: int, seed: int) -> list[tuple[int, bytes]]:
    """``n`` (input id, serialized request) pairs: a repeat of one of ``hot`` inputs with
    probability ``repeat``, else a new input (ids of new inputs are unique)."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    pool = [_payload(model, rng) for _ in range(hot)]
    out: list[tuple[int, bytes]] = []
    for i in range(n):
        if pick.random() < repeat:
            k = pick.randrange(hot)
            out.append((k, pool[k]))
        else:
            out.append((hot + i, _payload(model, rng)))
    return out


@dataclass
class Run:
    latencies: list[tuple[int, float, float]] = field(default_factory=list)  # (input id, sent, answered)
    errors: int = 0
    first_error: str = ""
    wall_s: float = 0.0


async def drive(endpoint: str, requests: list[tuple[int, bytes]], concurrency: int, connections: int,
                timeout: float = 30.0) -> Run:
    """Every request, ``concurrency`` in flight over ``connections`` connections (closed loop)."""
    channels = [Channel(endpoint, 10.0) for _ in range(connections)]
    run = Run()
    at = [0]

    async def worker(channel: Channel) -> None:
        conn = await channel.get()
        while at[0] < len(requests):
            key, payload = requests[at[0]]
            at[0] += 1
            sent = time.perf_counter()
            try:
                await conn.unary(_INFER, payload, (), timeout)
            except Exception as exc:  # (counted: a benchmark reports its failures)
                run.errors += 1
                run.first_error = run.first_error or repr(exc)[:300]
                conn = await channel.get()
                continue
            run.latencies.append((key, sent, time.perf_counter()))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(channels[i % connections]) for i in range(concurrency)))
    finally:
        for ch in channels:
            ch.close()
    run.wall_s = time.perf_counter() - t0
    return run


def run_client(coroutine: Coroutine[Any, Any, Run]) -> Run:
    """The client's calls on uvloop, as meshserve's processes and load/cli.py run theirs (the
    stdlib loop cost the client ~35,000 more instructions per call: docs/perf/response-cache.md, section 9)."""
    import uvloop
    return uvloop.run(coroutine)


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3


def summarize(run: Run) -> dict[str, Any]:
    """rows/s and latency percentiles, with the hits (see the module docstring) apart."""
    first: dict[int, float] = {}
    for key, _, done in run.latencies:
        first[key] = min(done, first.get(key, done))
    hits = [done - sent for key, sent, done in run.latencies if first[key] < sent]
    every = [done - sent for _, sent, done in run.latencies]
    return {"rows_s": len(run.latencies) / run.wall_s, "errors": run.errors, "first_error": run.first_error,
            "requests": len(run.latencies),
            "p50_ms": _p(every, 0.5), "p99_ms": _p(every, 0.99), "repeats": len(hits),
            "hit_p50_ms": _p(hits, 0.5), "hit_p99_ms": _p(hits, 0.99)}


# ---- machine load ------------------------------------------------------------------------------

def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    busy = sum(vals[:8]) - vals[3] - (vals[4] if len(vals) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _ours_s(pids: list[int]) -> float:
    return sum(procs.proc_tree_cpu_s(p) for p in pids) + time.process_time()


# ---- the servers -------------------------------------------------------------------------------

def bench_models(models: Path) -> Path:
    if not (models / "onnx_repo" / "add_sub").is_dir() or not (models / "triton_repo" / "add_sub").is_dir():
        subprocess.run([sys.executable, str(SHARED / "bench" / "gen_models.py"), str(models)], check=True,
                       stdout=subprocess.DEVNULL)
    return models


def cached_copy(src: Path, dst: Path, name: str, cached: bool) -> None:
    """``src`` (a model directory) as ``dst/name``, its config naming it, response_cache on or off."""
    shutil.copytree(src, dst / name, symlinks=True)
    config = dst / name / "config.pbtxt"
    text = config.read_text().replace(f'name: "{src.name}"', f'name: "{name}"', 1)
    config.write_text(text + (CACHED if cached else ""))


class Triton(procs.Endpoints):
    """The real tritonserver of ../shared/bench (start_triton.sh's setup, plus the cache flags)."""

    def __init__(self, repo: Path, work: Path, size: int, venv: Path):
        py = venv / "bin" / "python"
        version = subprocess.run([str(py), "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        sp = Path(subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
        ts = sp / "pytriton" / "tritonserver"
        backends = work / "backends" / "python"
        backends.mkdir(parents=True)
        for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
            (backends / f).symlink_to(ts / "backends" / "python" / f)
        shutil.copy(ts / "python_backend_stubs" / version / "triton_python_backend_stub", backends)
        from tests.support.net import free_port

        self.ports = {"http": free_port(), "grpc": free_port()}
        env = {**os.environ, "LD_LIBRARY_PATH": f"{sp}/nvidia_pytriton.libs:{os.environ.get('LD_LIBRARY_PATH', '')}",
               "PYTHONPATH": str(sp), "PATH": f"{venv}/bin:{os.environ['PATH']}"}
        self.log = open(work / "tritonserver.log", "w")
        self.proc = procs.spawn(
            [str(ts / "bin" / "tritonserver"), f"--model-repository={repo}", f"--backend-directory={work / 'backends'}",
             f"--cache-directory={ts / 'caches'}", f"--cache-config=local,size={size}",
             "--http-address=127.0.0.1", f"--http-port={self.ports['http']}",
             "--grpc-address=127.0.0.1", f"--grpc-port={self.ports['grpc']}", "--allow-metrics=false",
             "--log-verbose=0"], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            procs.wait_ready(self.http, 180)
        except RuntimeError:
            self.stop()
            raise
        with urllib.request.urlopen(f"http://{self.http}/v2", timeout=5) as r:
            self.version = json.loads(r.read())["version"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        procs.stop_process(self.proc, signal.SIGTERM, 30)
        self.log.close()


def executions(http: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of ``model`` in the server's statistics: rows, model runs."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def merged(http: str) -> tuple[int, int]:
    """(merged requests sent to the services, client requests inside them) from a gateway's /metrics."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.partition("{")[0]  # (rendered with its labels, here none: "{}")
        if name in ("meshserve_gateway_merged_sends_total", "meshserve_gateway_merged_requests_total"):
            found[name] = int(float(value))
    return found.get("meshserve_gateway_merged_sends_total", 0), found.get("meshserve_gateway_merged_requests_total", 0)


def cache_counts(http: str, model: str) -> tuple[int, int]:
    """(cache_hit, cache_miss) counts of ``model`` in the server's statistics."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.loads(r.read())["model_stats"][0]["inference_stats"]
    return int(stats["cache_hit"].get("count", 0)), int(stats["cache_miss"].get("count", 0))


# ---- what a hit costs in the store: one process's LocalCache vs the workers' SharedCache ---------

def hit_cost(sizes: tuple[int, ...] = (160, 4096, 65536), keys: int = 1000, repeats: int = 20) -> str:
    """CPU µs per lookup + hit count (process time: the machine's other load does not count),
    best of 5, for answers of each size (gateway/shared_cache.py's choice, docs/perf/response-cache.md)."""
    from gateway.cache import CacheCounts, LocalCache
    from gateway.shared_cache import SharedCache
    from meshserve._proto import model_config_pb2 as mc

    config = mc.ModelConfig(name="m")
    lines = ["| answer bytes | in-process µs | shared (--workers) µs |", "|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="bench-hit-cost-") as tmp:
        for size in sizes:
            answer = os.urandom(size)
            ids = [os.urandom(16) for _ in range(min(keys, (16 << 20) // size))]  # (all fit in either)
            local, shared = LocalCache(64 << 20), SharedCache(os.path.join(tmp, f"c{size}"), 64 << 20, 0)
            row = []
            for store, counts in ((local, CacheCounts()), (shared, shared.counts)):
                for key in ids:
                    store.put(key, "m", answer, config, 0)
                best = float("inf")
                for _ in range(5):
                    t0 = time.process_time_ns()
                    for _ in range(repeats):
                        for key in ids:
                            assert store.get(key, config, "m") is not None
                            counts.hit(("m", "1"), 1)
                    best = min(best, (time.process_time_ns() - t0) / (repeats * len(ids)) / 1000)
                row.append(best)
            shared.close()
            lines.append(f"| {size} | {row[0]:.2f} | {row[1]:.2f} |")
    return "\n".join(lines)


# ---- instructions per request in the gateway (callgrind: repeats on a busy machine) --------------

def instructions(args: argparse.Namespace, repo: Path, out: Path) -> str:
    """The gateway's user-space instructions per request (every thread, callgrind) with the cache
    off, on with no repeat (a miss's cost), and on with every request a hit."""
    from load.bench import callgrind

    if not callgrind.available():
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    n = args.requests
    rows: list[tuple[str, int, float]] = []
    svc = procs.service(repo, out / "svc.log")
    try:
        for name, extra, cells in (("off", [], [("cache off, 0% repeats", 0.0)]),
                                   ("on", ["--cache-config", f"local,size={args.size}"],
                                    [("cache on, 0% repeats (every request a miss)", 0.0),
                                     ("cache on, 100% repeats (every request a hit)", 1.0),
                                     # (as the bench's 0% cell runs: after the 90% cell's hits)
                                     ("cache on, 0% repeats, the front door's index filled", 0.0)])):
            dump = out / f"cg-{name}.out"
            # (discovery's health calls from a gateway under callgrind are slow: not every 2 s)
            gw = procs.gateway([svc.grpc], out / f"gw-{name}.log", extra=[*extra, "--discovery-interval", "60",
                                                                        "--metrics-port", "0", *shlex.split(args.gateway_args)],
                               timeout=600, prefix=callgrind.command(dump, instr_at_start=False))
            try:
                for label, repeat in cells:
                    seed = 77 + len(rows)
                    hot = 10
                    # warm-up: new inputs, or (for hits) the hot inputs, every one of them answered once
                    warm = mix("add_sub", 20 * hot, 1.0, hot, seed) if repeat else \
                        mix("add_sub", args.warmup, 0.0, 1, seed + 9)
                    run_client(drive(gw.grpc, warm, args.concurrency, args.connections, 600.0))
                    before = set(out.glob(dump.name + "*"))
                    calls0 = hop_calls(gw)
                    callgrind.control(gw.pid, "--zero")
                    callgrind.control(gw.pid, "--instr=on")
                    run = run_client(drive(gw.grpc, mix("add_sub", n, repeat, hot, seed), args.concurrency,
                                            args.connections, 600.0))  # (a gateway under callgrind is slow)
                    callgrind.control(gw.pid, "--instr=off")
                    callgrind.control(gw.pid, "--dump")
                    total, _ = callgrind.totals(callgrind.wait_dump(dump, before))
                    if run.errors:
                        raise SystemExit(f"{label}: {run.errors} requests failed, the first: {run.first_error}")
                    calls = hop_calls(gw)
                    merged, sends = calls[0] - calls0[0], calls[1] - calls0[1]
                    hops = n - merged + sends if repeat < 1 else 0  # (the requests that crossed the hop)
                    rows.append((label, total // n, n / hops if hops else 0.0))
                    print(f"{label}: {total // n} instructions per request, {n / hops if hops else 0:.2f} "
                          f"requests per hop call ({merged} merged into {sends} calls)", flush=True)
            finally:
                gw.stop()
    finally:
        svc.stop()
    base = rows[0][1]
    return "\n".join(["| gateway | instructions per request | vs cache off | requests per hop call |",
                      "|---|---:|---:|---:|",
                      *(f"| {label} | {count} | {100 * (count / base - 1):+.1f}% | {per:.2f} |"
                        for label, count, per in rows)])


def hop_calls(gw: procs.Server) -> tuple[int, int]:
    """(requests merged so far, the merged calls that carried them): the gateway's
    meshserve_gateway_merged_* counters."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.ports['metrics']}/metrics", timeout=60) as r:
        text = r.read().decode()

    def total(family: str) -> int:
        return sum(int(float(v)) for v in re.findall(rf"^{family}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return total("meshserve_gateway_merged_requests_total"), total("meshserve_gateway_merged_sends_total")


# ---- the 0% mix, A/B: what a miss costs beyond the instructions (docs/perf/response-cache.md, 12) --

ZERO_AB_GATEWAYS = {
    "off": [],
    "on": ["--cache-config", "local,size=SIZE"],
    # every request a miss, nothing kept: an answer is over 1/8 of 1,000 bytes (the miss's work without the store)
    "nostore": ["--cache-config", "local,size=1000"],
    # as the bench's 0% cell finds it: after hits, the front door's index filled
    "hot": ["--cache-config", "local,size=SIZE"],
}


def _task_cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` in ns resolution (/proc/PID/task/*/schedstat), where
    /proc/PID/stat counts 10 ms ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _faults_rss(pid: int) -> tuple[int, int]:
    """(minor page faults so far, resident bytes) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


def zero_ab(args: argparse.Namespace, repo: Path, out: Path) -> str:
    """The 0% mix against gateways side by side (``--zero-ab off,on,nostore,hot``): each round
    drives every gateway in turn (the order reversed every other round), so the machine's other load
    falls on all alike; per gateway the medians of its CPU µs per request (every thread, schedstat),
    minor page faults per request (a new entry's memory) and the RSS after the last round."""
    names = args.zero_ab.split(",")
    unknown = [n for n in names if n not in ZERO_AB_GATEWAYS]
    if unknown:
        raise SystemExit(f"--zero-ab: unknown gateway {unknown[0]} (known: {', '.join(ZERO_AB_GATEWAYS)})")
    svc = procs.service(repo, out / "svc.log")
    gws: dict[str, procs.Server] = {}
    rows: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    try:
        for n in names:
            extra = [a.replace("SIZE", str(args.size)) for a in ZERO_AB_GATEWAYS[n]]
            gws[n] = procs.gateway([svc.grpc], out / f"gw-{n}.log", extra=[*extra, *shlex.split(args.gateway_args)])
            if n == "hot":
                run_client(drive(gws[n].grpc, mix("add_sub", 20 * 10, 1.0, 10, 4242), args.concurrency, args.connections))
        for rnd in range(args.rounds):
            for i, n in enumerate(names if rnd % 2 == 0 else names[::-1]):
                gw = gws[n]
                run_client(drive(gw.grpc, mix("add_sub", args.warmup, 0.0, 1, 7000 + rnd), args.concurrency, args.connections))
                requests = mix("add_sub", args.requests, 0.0, 1, 1000 * rnd + 10 * i + 8)
                cpu0, (faults0, _) = _task_cpu_s(gw.pid), _faults_rss(gw.pid)
                run = run_client(drive(gw.grpc, requests, args.concurrency, args.connections))
                cpu1, (faults1, _) = _task_cpu_s(gw.pid), _faults_rss(gw.pid)
                if run.errors:
                    raise SystemExit(f"{n}: {run.errors} requests failed, the first: {run.first_error}")
                k = len(requests)
                rows[n].append((k / run.wall_s, (cpu1 - cpu0) / k * 1e6, (faults1 - faults0) / k))
                print(f"round {rnd + 1} {n}: {rows[n][-1][0]:.0f} rows/s, {rows[n][-1][1]:.2f} µs, "
                      f"{rows[n][-1][2]:.3f} faults per request", flush=True)
        rss = {n: _faults_rss(gws[n].pid)[1] for n in names}
    finally:
        for gw in gws.values():
            gw.stop()
        svc.stop()
    base = statistics.median(r[1] for r in rows[names[0]])
    lines = [f"-n {args.requests} per gateway and round, {args.rounds} rounds, c{args.concurrency}, "
             f"medians; load average {os.getloadavg()[0]:.1f} at the end", "",
             f"| gateway | rows/s | gateway CPU µs/req | vs {names[0]} | minor faults/req | RSS MiB at the end |",
             "|---|---:|---:|---:|---:|---:|"]
    for n in names:
        cpu = statistics.median(r[1] for r in rows[n])
        lines.append(f"| {n} | {statistics.median(r[0] for r in rows[n]):.0f} | {cpu:.2f} | "
                     f"{100 * (cpu / base - 1):+.1f}% | {statistics.median(r[2] for r in rows[n]):.3f} | {rss[n] >> 20} |")
    return "\n".join(lines)


# ---- the run -----------------------------------------------------------------------------------

@dataclass
class Cell:
    name: str
    endpoint: str
    model: str
    repeat: float
    pids: list[int]  # the server processes whose CPU it reports
    stats_http: str | None = None  # where its cache counts are read (None: not cached)
    service_http: str | None = None  # meshserve: the service, whose rows per model execution are read
    gateway_http: str | None = None  # meshserve: the gateway, whose merged hop requests are read
    rows: list[dict[str, Any]] = field(default_factory=list)


def measure(cell: Cell, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    run_client(drive(cell.endpoint, mix(cell.model, args.warmup, 0.0, 1, seed + 1_000_000),
                      args.concurrency, args.connections))
    requests = mix(cell.model, args.requests, cell.repeat, args.hot, seed)
    before = cache_counts(cell.stats_http, cell.model) if cell.stats_http else None
    runs0 = executions(cell.service_http, cell.model) if cell.service_http else None
    merged0 = merged(cell.gateway_http) if cell.gateway_http else None
    cpu0, machine0, ours0 = [procs.proc_tree_cpu_s(p) for p in cell.pids], _machine_busy_s(), _ours_s(cell.pids)
    client0 = time.process_time()
    run = run_client(drive(cell.endpoint, requests, args.concurrency, args.connections))
    client1 = time.process_time()
    cpu1, machine1, ours1 = [procs.proc_tree_cpu_s(p) for p in cell.pids], _machine_busy_s(), _ours_s(cell.pids)
    row = summarize(run)
    row["server_us_per_req"] = [round((b - a) / max(1, row["requests"]) * 1e6, 1) for a, b in zip(cpu0, cpu1, strict=True)]
    row["client_us_per_req"] = round((client1 - client0) / max(1, row["requests"]) * 1e6, 1)
    row["foreign_cores"] = round(max(0.0, (machine1 - machine0) - (ours1 - ours0)) / run.wall_s, 2)
    if before is not None and cell.stats_http:
        after = cache_counts(cell.stats_http, cell.model)
        row["server_hits"], row["server_misses"] = after[0] - before[0], after[1] - before[1]
    if runs0 is not None and cell.service_http:  # the requests that reached the service: how they ran
        runs1 = executions(cell.service_http, cell.model)
        row["service_rows"], row["service_executions"] = runs1[0] - runs0[0], runs1[1] - runs0[1]
    if merged0 is not None and cell.gateway_http:
        merged1 = merged(cell.gateway_http)
        row["hop_merged_sends"], row["hop_merged_requests"] = merged1[0] - merged0[0], merged1[1] - merged0[1]
    return row


def _hop(rows: list[dict[str, Any]]) -> str:
    """"rows per model execution / client requests per hop send" of a meshserve cell's rounds (all
    requests that reached the service: one hop send carries one, or a merge of several)."""
    if not rows or "service_rows" not in rows[0]:
        return "-"
    reached = sum(r["service_rows"] for r in rows)
    sends = reached - sum(r.get("hop_merged_requests", 0) for r in rows) + sum(r.get("hop_merged_sends", 0) for r in rows)
    per_run = reached / max(1, sum(r["service_executions"] for r in rows))
    return f"{per_run:.2f} / {reached / max(1, sends):.2f}"


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.median(values) if values else float("nan")


def report(cells: list[Cell], args: argparse.Namespace, env: dict[str, Any]) -> str:
    med = {c.name: {k: _median(c.rows, k) for k in ("rows_s", "p99_ms", "hit_p99_ms", "p50_ms", "hit_p50_ms",
                                                    "foreign_cores")} for c in cells}
    lines = [f"-n {args.requests} per cell, c{args.concurrency} over {args.connections} connections, "
             f"{args.rounds} round(s), median per cell; repeats {args.repeat:.0%} of {args.hot} inputs; "
             f"cache size {args.size} bytes", "",
             "| cell | rows/s | p50 ms | p99 ms | hit p50 ms | hit p99 ms | server CPU µs/req | client CPU µs/req "
             "| hits / misses (server) | rows per run / requests per hop send (service) | foreign cores | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        m = med[c.name]
        cpu = "+".join(f"{statistics.median(r['server_us_per_req'][i] for r in c.rows):.0f}"
                       for i in range(len(c.pids)))
        counts = "-" if not c.stats_http else \
            f"{sum(r.get('server_hits', 0) for r in c.rows)} / {sum(r.get('server_misses', 0) for r in c.rows)}"
        hit = f"{m['hit_p50_ms']:.2f} | {m['hit_p99_ms']:.2f}" if c.repeat > 0 and c.stats_http else "- | -"
        client = statistics.median(r.get("client_us_per_req", float("nan")) for r in c.rows)
        lines.append(f"| {c.name} | {m['rows_s']:.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {hit} | {cpu} | "
                     f"{client:.0f} | {counts} | {_hop(c.rows)} | {m['foreign_cores']:.2f} | {sum(r['errors'] for r in c.rows)} |")
    by = {c.name: med[c.name] for c in cells}
    lines.append("")

    def ratio(on: str, off: str) -> None:
        if on in by and off in by:
            lines.append(f"- {on} / {off}: rows/s **{by[on]['rows_s'] / by[off]['rows_s']:.2f}x**, "
                         f"hit p99 {by[on]['hit_p99_ms']:.2f} ms vs uncached p99 {by[off]['p99_ms']:.2f} ms")

    ratio("meshserve 90% on", "meshserve 90% off")
    ratio("Triton 90% on", "Triton 90% off")
    if "meshserve 0% on" in by:
        on, off = by["meshserve 0% on"], by["meshserve 0% off"]
        gw = {c.name: statistics.median(r["server_us_per_req"][0] for r in c.rows) for c in cells}
        # (CPU time comes in clock ticks: a small run may see none in a cell)
        cpu = f"{100 * (gw['meshserve 0% on'] / gw['meshserve 0% off'] - 1):+.1f}%" if gw["meshserve 0% off"] else "n/a"
        lines.append(f"- meshserve 0% on vs off: rows/s {100 * (on['rows_s'] / off['rows_s'] - 1):+.1f}%, "
                     f"gateway CPU per request {cpu}")
    lines += ["", f"machine: {env['cpus']} CPUs, load average {env['loadavg_start']} at start, "
              f"{env['loadavg_end']} at end; Triton {env.get('triton', '(not run)')}; python {sys.version.split()[0]}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench --cache", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-n", "--requests", type=int, default=4000, help="requests per cell and round")
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--connections", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=float, default=0.9, help="the repeating mix's share of repeats")
    ap.add_argument("--hot", type=int, default=100, help="inputs the repeats are drawn from (per round)")
    ap.add_argument("--size", type=int, default=64 << 20, help="--cache-config local,size= of both servers")
    ap.add_argument("--models", type=Path, default=Path("/tmp/bench-models"),
                    help="../shared/bench/gen_models.py's output (generated if missing)")
    ap.add_argument("--repository", type=Path, default=None,
                    help="an ONNX repository with add_sub (default: MODELS/onnx_repo)")
    ap.add_argument("--no-triton", action="store_true", help="meshserve's cells only")
    ap.add_argument("--triton-venv", type=Path, default=Path(os.environ.get("TRITON_VENV", "/tmp/bench-venvs/triton")))
    ap.add_argument("--no-zero", action="store_true", help="skip the 0%% repeat cells")
    ap.add_argument("--json", type=Path, default=None, help="every round's numbers")
    ap.add_argument("--hit-cost", action="store_true",
                    help="instead: CPU per hit in one process's cache vs the cache --workers share (no servers)")
    ap.add_argument("--instructions", action="store_true",
                    help="instead: the gateway's instructions per request under callgrind (cache off, on with "
                         "no repeat, on with every request a hit); use a small -n (e.g. 500)")
    ap.add_argument("--gateway-args", default="",
                    help="with --instructions or --zero-ab: more flags for every gateway (one string, shell words), e.g. "
                         "\"--coalesce-inflight 0\" (no merging: the count no longer moves with batching)")
    ap.add_argument("--zero-ab", default="", metavar="GATEWAYS",
                    help="instead: the 0%% mix against gateways side by side, alternating (off, on, nostore: "
                         "nothing kept, hot: the front door's index filled first), e.g. off,on,nostore,hot")
    ap.add_argument("--keep", type=Path, default=None,
                    help="with --instructions: keep the callgrind dumps (cg-off.out*, cg-on.out*) in this directory")
    args = ap.parse_args(argv)
    if args.hit_cost:
        print(hit_cost())
        return
    if args.zero_ab:
        with tempfile.TemporaryDirectory(prefix="bench-cache-ab-") as tmp:
            d = Path(tmp)
            (d / "mesh").mkdir()
            cached_copy((args.repository or bench_models(args.models) / "onnx_repo") / "add_sub", d / "mesh",
                        "add_sub", True)
            print(zero_ab(args, d / "mesh", d))
        return
    if args.instructions:
        with tempfile.TemporaryDirectory(prefix="bench-cache-cg-") as tmp:
            d = Path(tmp) if args.keep is None else args.keep
            d.mkdir(parents=True, exist_ok=True)
            (d / "mesh").mkdir()
            cached_copy((args.repository or bench_models(args.models) / "onnx_repo") / "add_sub", d / "mesh",
                        "add_sub", True)
            print(instructions(args, d / "mesh", d))
        return
    env: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        d = Path(tmp)
        onnx = args.repository or bench_models(args.models) / "onnx_repo"
        (d / "mesh").mkdir()
        cached_copy(onnx / "add_sub", d / "mesh", "add_sub", True)
        started: list[Any] = []
        cells: list[Cell] = []
        try:
            svc = procs.service(d / "mesh", d / "svc.log")
            started.append(svc)
            off = procs.gateway([svc.grpc], d / "gw-off.log")
            started.append(off)
            on = procs.gateway([svc.grpc], d / "gw-on.log", extra=["--cache-config", f"local,size={args.size}"])
            started.append(on)
            cells += [Cell("meshserve 90% off", off.grpc, "add_sub", args.repeat, [off.pid, svc.pid], None,
                           svc.http, off.http),
                      Cell("meshserve 90% on", on.grpc, "add_sub", args.repeat, [on.pid, svc.pid], on.http,
                           svc.http, on.http)]
            if not args.no_triton:
                (d / "triton").mkdir()
                src = bench_models(args.models) / "triton_repo" / "add_sub"
                cached_copy(src, d / "triton", "add_sub", True)
                cached_copy(src, d / "triton", "add_sub_nc", False)
                triton = Triton(d / "triton", d / "triton-work", args.size, args.triton_venv)
                started.append(triton)
                env["triton"] = triton.version
                cells += [Cell("Triton 90% off", triton.grpc, "add_sub_nc", args.repeat, [triton.pid]),
                          Cell("Triton 90% on", triton.grpc, "add_sub", args.repeat, [triton.pid], triton.http)]
            if not args.no_zero:
                cells += [Cell("meshserve 0% off", off.grpc, "add_sub", 0.0, [off.pid, svc.pid], None, svc.http,
                               off.http),
                          Cell("meshserve 0% on", on.grpc, "add_sub", 0.0, [on.pid, svc.pid], on.http, svc.http,
                               on.http)]
            for rnd in range(args.rounds):
                for cell in cells:
                    # (a cell's own inputs: the 0% cells never repeat an input of the 90% cells)
                    cell.rows.append(measure(cell, args, seed=1000 * rnd + (7 if cell.repeat else 8)))
                    print(f"round {rnd + 1} {cell.name}: {json.dumps(cell.rows[-1])}", flush=True)
        finally:
            for p in reversed(started):
                p.stop()
    env["loadavg_end"] = os.getloadavg()[0]
    print(report(cells, args, env))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "env": env,
                                         "cells": {c.name: c.rows for c in cells}}, indent=1))


if __name__ == "__main__":
    procs.clean_exit()
    main()
