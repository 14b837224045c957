"""The model mesh benchmark (`python -m load.bench --mesh`; docs/perf/model-mesh.md).

A repository of generated ONNX models of mixed sizes (load/bench/mesh_models.py) about
``--ratio`` (3) times the sum of the replicas' budgets, behind `meshserve up` with ``--replicas``
(3) onnx replicas, and ``--clients`` closed-loop clients (the real tritonclient, gRPC) asking for
models in a Zipf-like mix (weight 1/rank^s over a shuffled order) for ``--duration`` seconds.
Every answer is checked (model i answers INPUT0 + i).

Cases (``--cases``): ``mesh`` (`--model-control-mode lazy --memory-budget B`) and ``all`` (every
replica loads every model at start, under the same budget: what a node sized for the mesh's
budget does without it), ``all-unbounded`` (the same without a budget: the memory every
replica then needs), and ``triton`` (the real Triton in explicit mode asked to load the whole set
under the memory the mesh's replicas may use in all, then the same mix: load/bench/mesh_triton.py).

Reported per case: requests, failures (by error), warm and cold requests with their p50 / p99
(a request is warm when the gateway's placement showed its model served before it started and
no load of it happened until after it ended: GET /v2/placement polled every 0.25 s), loads and
evictions per minute (the services' counters, federated on the gateway's /metrics), each
replica's peak RSS against its budget, and the gateway's cold-start histogram.

``--smoke``: 24 models of 1-2 MiB, budgets of 4 + 6 MiB (about 5 of them each, 15 of the 24 in all:
as much room as the earlier smoke's 4 + 16 MiB left once onnxruntime's start was charged to it),
3 replicas, 6 s, the mesh case only (about 30 s on a quiet box).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from load.bench import mesh_models, procs

ROOT = Path(__file__).resolve().parents[2]
# A replica's RSS stays under budget + base + RSS_SLACK: the base is what the service measured of itself
# before its first load (meshserve_memory_base_bytes: interpreter, libraries, onnxruntime's one-time
# start), the slack what the models' measured sizes do not hold: allocator fragmentation and arenas,
# requests' tensors in flight, and a load's real size over its estimate until the next one settles
RSS_SLACK = 32 * 2**20
# the triton case's memory cap when no mesh case ran before it to measure a replica's base
TRITON_BASE_GUESS = 100 * 2**20


@dataclass
class Sample:
    start: float
    end: float
    model: str
    outcome: str  # "OK" or the error's status and first words


@dataclass
class Watch:
    """Placement snapshots and RSS peaks, sampled while the load runs."""

    snapshots: list[tuple[float, dict[str, tuple[int, int]]]] = field(default_factory=list)
    peak_rss: dict[int, int] = field(default_factory=dict)
    baseline_rss: dict[int, int] = field(default_factory=dict)  # before the first request
    stop: threading.Event = field(default_factory=threading.Event)


def build_repository(repo: Path, n: int, min_mib: float, max_mib: float, seed: int = 32) -> dict[str, int]:
    """``n`` models of sizes spread from ``min_mib`` to ``max_mib`` (log-uniform); their bytes by name."""
    rng = random.Random(seed)
    sizes: dict[str, int] = {}
    for i in range(n):
        mib = min_mib * (max_mib / min_mib) ** rng.random()
        rows = max(1, int(mib * 2**20 / (mesh_models.WIDTH * 4)))
        name = mesh_models.write(repo, i, rows)
        sizes[name] = rows * mesh_models.WIDTH * 4
    return sizes


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def _metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


class Up:
    """`meshserve up` for one case, its banner read for the ports, its output drained."""

    def __init__(self, repo: Path, flags: list[str], timeout: float = 300.0):
        # its group: `up`, the services, the gateway (procs.spawn)
        self.proc = procs.spawn([sys.executable, "-m", "meshserve", "up", "--repository", str(repo),
                                 "--http-port", "0", "--grpc-port", "0", "--metrics-port", "-1", *flags],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        banner = threading.Event()
        threading.Thread(target=self._drain, args=(banner,), daemon=True).start()
        if not banner.wait(timeout):
            self.stop()
            raise SystemExit("meshserve up did not start:\n" + "".join(self.log[-50:]))
        text = "".join(self.log)
        http = re.search(r"HTTP/REST\s+https?://\S+?:(\d+)/v2", text)
        grpc = re.search(r"gRPC\s+\S+?:(\d+)", text)
        if http is None or grpc is None:
            self.stop()
            raise SystemExit("meshserve up: no ports in its banner:\n" + text[-3000:])
        self.http, self.grpc = f"127.0.0.1:{http.group(1)}", f"127.0.0.1:{grpc.group(1)}"
        self.services = [p for p in _children(self.proc.pid) if " service " in _cmdline(p)]

    def _drain(self, banner: threading.Event) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if len(self.log) < 5000:
                self.log.append(line)
            if "Press Ctrl-C" in line or "did not become ready" in line:
                banner.set()
        banner.set()

    def stop(self) -> None:
        """Ctrl-C (SIGKILL after 60 s), then the rest of its process group waited out (procs.stop_process)."""
        procs.stop_process(self.proc, signal.SIGINT, 60)


def _watch(up: Up, watch: Watch, placement: bool) -> None:
    while not watch.stop.is_set():
        for pid in up.services:
            watch.peak_rss[pid] = max(watch.peak_rss.get(pid, 0), _rss(pid))
        if placement:
            try:
                view = json.loads(_get(f"http://{up.http}/v2/placement"))
                watch.snapshots.append((time.monotonic(), {m["name"]: (m["copies"], m["cold_starts"])
                                                           for m in view["models"]}))
            except (OSError, ValueError):
                pass
        watch.stop.wait(0.25)


def _client(url: str, names: list[str], weights: list[float], seed: int, until: float, out: list[Sample],
            lock: threading.Lock) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    rng = random.Random(seed)
    x = np.ones((1, mesh_models.WIDTH), np.float32)
    inp = grpcclient.InferInput("INPUT0", [1, mesh_models.WIDTH], "FP32")
    inp.set_data_from_numpy(x)
    with grpcclient.InferenceServerClient(url) as c:
        while time.monotonic() < until:
            name = rng.choices(names, weights)[0]
            t0 = time.monotonic()
            try:
                got = c.infer(name, [inp], client_timeout=120).as_numpy("OUTPUT0")
                want = mesh_models.expected(int(name.rsplit("_", 1)[1]), x)
                outcome = "OK" if got is not None and np.array_equal(got, want) else "WRONG ANSWER"
            except InferenceServerException as exc:
                outcome = f"{exc.status()} {str(exc.message())[:80]}"
            with lock:
                out.append(Sample(t0, time.monotonic(), name, outcome))


def mix(grpc: str, names: list[str], weights: list[float], clients: int, duration: float
        ) -> tuple[list[Sample], float]:
    """``clients`` closed-loop clients asking ``grpc`` for ``names`` by ``weights`` for ``duration``
    seconds: every request's sample, and the seconds it took."""
    samples: list[Sample] = []
    lock = threading.Lock()
    until = time.monotonic() + duration
    t0 = time.monotonic()
    threads = [threading.Thread(target=_client, args=(grpc, names, weights, n, until, samples, lock))
               for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.monotonic() - t0


def _warm(sample: Sample, snapshots: list[tuple[float, dict[str, tuple[int, int]]]]) -> bool | None:
    """Served before it started and not loaded until after it ended (None: no snapshots around it)."""
    before = next((s for t, s in reversed(snapshots) if t <= sample.start), None)
    after = next((s for t, s in snapshots if t >= sample.end), None)
    if before is None or after is None:
        return None
    copies, colds = before.get(sample.model, (0, 0))
    return copies > 0 and after.get(sample.model, (0, 0))[1] == colds


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    ordered = sorted(values)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2)}


def run_case(case: str, repo: Path, names: list[str], weights: list[float], args: argparse.Namespace,
             budget: int) -> dict[str, Any]:
    flags = ["--replicas", str(args.replicas)]
    if case != "all-unbounded":  # (that one: each service's default budget, a share of the machine's memory)
        flags += ["--memory-budget", str(budget)]
    if case == "mesh":
        flags += ["--model-control-mode", "lazy"]
    started = time.monotonic()
    up = Up(repo, flags)
    result: dict[str, Any] = {"case": case, "start_s": round(time.monotonic() - started, 1)}
    watch = Watch()
    try:
        before = _get(f"http://{up.http}/metrics").decode()
        bases = [int(float(m.group(1))) for m in
                 re.finditer(r"^meshserve_memory_base_bytes(?:\{[^}]*\})? (\S+)$", before, re.M)]
        watch.baseline_rss = {pid: _rss(pid) for pid in up.services}
        watcher = threading.Thread(target=_watch, args=(up, watch, case == "mesh"), daemon=True)
        watcher.start()
        samples, elapsed = mix(up.grpc, names, weights, args.clients, args.duration)
        watch.stop.set()
        watcher.join()
        after = _get(f"http://{up.http}/metrics").decode()
    finally:
        up.stop()
    outcomes = Counter(s.outcome for s in samples)
    ok = [s for s in samples if s.outcome == "OK"]
    warmth = [(s, _warm(s, watch.snapshots)) for s in ok] if case == "mesh" else [(s, True) for s in ok]
    warm = [s.end - s.start for s, w in warmth if w]
    cold = [s.end - s.start for s, w in warmth if not w]
    minutes = elapsed / 60
    result.update({
        "requests": len(samples), "ok": len(ok), "failed": len(samples) - len(ok),
        "failures": dict(Counter(o for o in outcomes.elements() if o != "OK")),
        "throughput_rps": round(len(samples) / elapsed, 1),
        "warm": len(warm), "cold": len(cold), "warm_share": round(len(warm) / len(ok), 4) if ok else None,
        "warm_latency": _percentiles(warm), "cold_latency": _percentiles(cold),
        "loads_per_min": round((_metric_sum(after, "meshserve_model_loads_total")
                                - _metric_sum(before, "meshserve_model_loads_total")) / minutes, 1),
        "evictions_per_min": round((_metric_sum(after, "meshserve_model_evictions_total")
                                    - _metric_sum(before, "meshserve_model_evictions_total")) / minutes, 1),
        "budget_bytes": budget, "rss_slack_bytes": RSS_SLACK, "base_bytes": bases,
        # the bound: the budget this case ran under + the largest base the replicas report + the slack
        "rss_bound_bytes": budget + max(bases, default=0) + RSS_SLACK if case != "all-unbounded" else None,
        "peak_rss_bytes": [watch.peak_rss.get(p, 0) for p in up.services],
        "baseline_rss_bytes": [watch.baseline_rss.get(p, 0) for p in up.services],
        "peak_over_baseline_bytes": [watch.peak_rss.get(p, 0) - watch.baseline_rss.get(p, 0) for p in up.services],
        "models_used_bytes_at_end": _metric_sum(after, "meshserve_memory_used_bytes"),
        "gateway_cold_starts": _metric_sum(after, "meshserve_gateway_model_cold_start_seconds_count"),
        "duration_s": round(elapsed, 1),
    })
    bound = result["rss_bound_bytes"]
    result["rss_within_bound"] = None if bound is None else all(p <= bound for p in result["peak_rss_bytes"])
    return result


def triton_cap(args: argparse.Namespace, budget: int, done: list[dict[str, Any]]) -> int:
    """The triton case's memory: what the mesh's replicas may hold in all (budget + base + slack each,
    the base measured by a case run before, else TRITON_BASE_GUESS), or --triton-memory-mib."""
    if args.triton_memory_mib is not None:
        return int(args.triton_memory_mib * 2**20)
    bases = [b for r in done for b in r.get("base_bytes", []) if b]
    return args.replicas * (budget + (max(bases) if bases else TRITON_BASE_GUESS) + RSS_SLACK)


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"Model mesh benchmark, {doc['started']} ({doc['host_load']})", "",
             f"{doc['models']} models, {doc['repository_mib']:.0f} MiB of weights; {doc['replicas']} onnx replicas with "
             f"{doc['budget_bytes'] / 2**20:.0f} MiB budgets each ({doc['ratio']:.1f}x their sum); "
             f"{doc['clients']} clients, Zipf s={doc['zipf']}, {doc['duration']} s per case.", "",
             "| case | requests | failed | warm share | warm p50 / p99 ms | cold p50 / p99 ms | loads/min | "
             "evictions/min | peak RSS per replica, MiB (over its idle start) | bound: budget + base + slack, MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for r in doc["cases"]:
        if r["case"] == "triton":
            continue
        rss = ", ".join(f"{b / mib:.0f} ({d / mib:+.0f})"
                        for b, d in zip(r["peak_rss_bytes"], r["peak_over_baseline_bytes"], strict=True))
        bound = ("–" if r.get("rss_bound_bytes") is None else
                 f"{r['rss_bound_bytes'] / mib:.0f} ({'held' if r['rss_within_bound'] else '**passed**'})")
        lines.append(f"| {r['case']} | {r['requests']} | {r['failed']} | {r['warm_share']} | "
                     f"{r['warm_latency']['p50_ms']} / {r['warm_latency']['p99_ms']} | "
                     f"{r['cold_latency']['p50_ms']} / {r['cold_latency']['p99_ms']} | {r['loads_per_min']} | "
                     f"{r['evictions_per_min']} | {rss} | {bound} |")
        if r["failures"]:
            lines.append(f"|  | failures: {json.dumps(r['failures'])[:300]} |  |  |  |  |  |  |  |  |")
    for r in (r for r in doc["cases"] if r["case"] == "triton"):
        peak = r["peak_cgroup_bytes"] or r["peak_tree_rss_bytes"]
        lines += ["", f"Triton 2.51, explicit mode, python backend over onnxruntime, memory cap "
                      f"{r['memory_cap_bytes'] / mib:.0f} MiB ({r['cap_by']}): **{r['outcome']}**", "",
                  "| models loaded (attempted) | load time s (p50 per model) | READY after loads / after mix | "
                  "peak memory MiB (cap) | tree RSS / PSS after loads MiB | OOM kills | requests | failed |",
                  "|---|---|---|---|---|---|---|---|",
                  f"| {r.get('loads_ok')} ({r.get('load_attempts')}) | {r.get('load_seconds')} "
                  f"({r.get('load_p50_s')}) | {r.get('ready_after_loads')} / {r.get('ready_after_mix')} | "
                  f"{peak / mib:.0f} ({r['memory_cap_bytes'] / mib:.0f}) | "
                  f"{r.get('tree_rss_bytes_after_loads', 0) / mib:.0f} / {r.get('tree_pss_bytes_after_loads', 0) / mib:.0f} | "
                  f"{r.get('oom_kills_after_mix')} | {r.get('requests')} | {r.get('failed')} |"]
        for why, n in sorted(r.get("failures", {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"- {n} requests: {why}")
        for why, n in sorted(r.get("load_errors", {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"- {n} loads failed: {why}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench --mesh", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="24 small models, 6 s, the mesh case (about 30 s)")
    ap.add_argument("--models", type=int, default=200)
    ap.add_argument("--min-mib", type=float, default=0.5)
    ap.add_argument("--max-mib", type=float, default=8.0)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--ratio", type=float, default=3.0, help="the models' bytes over the sum of the budgets")
    ap.add_argument("--budget-extra-mib", type=float, default=0.0,
                    help="added to each replica's budget (onnxruntime's one-time start is in the services' base, "
                         "not in a model's size: no need to add room for it)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--duration", type=float, default=180.0, metavar="SECONDS", help="per case")
    ap.add_argument("--cases", default="mesh,all", help="comma list of mesh, all, all-unbounded, triton")
    ap.add_argument("--triton-venv", type=Path, default=Path(os.environ.get("TRITON_VENV", "/tmp/bench-venvs/triton")))
    ap.add_argument("--triton-memory-mib", type=float, default=None,
                    help="the triton case's memory cap (default: the replicas' budgets + bases + slack, in all)")
    ap.add_argument("--triton-duration", type=float, default=30.0, metavar="SECONDS",
                    help="the triton case's mix (after its loads)")
    ap.add_argument("--triton-load-limit", type=float, default=420.0, metavar="SECONDS",
                    help="the triton case stops loading after this long")
    ap.add_argument("--repository", type=Path, default=None, help="where the models go (default: a temp dir)")
    ap.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-results")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.min_mib, args.max_mib, args.duration, args.clients = 24, 1.0, 2.0, 6.0, 4
        args.cases, args.budget_extra_mib = "mesh", 6.0
    repo = args.repository or Path(tempfile.mkdtemp(prefix="mesh-bench-"))
    repo.mkdir(parents=True, exist_ok=True)
    sizes = build_repository(repo, args.models, args.min_mib, args.max_mib)
    total = sum(sizes.values())
    # the services measure a model at about its weight's bytes, at least: budgets for 1/ratio of them
    budget = int(total / args.ratio / args.replicas + args.budget_extra_mib * 2**20)
    names = sorted(sizes)
    order = names[:]
    random.Random(7).shuffle(order)
    weights_by_name = {n: 1.0 / (rank + 1) ** args.zipf for rank, n in enumerate(order)}
    weights = [weights_by_name[n] for n in names]
    doc: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "host_load": "load average " + " ".join(f"{v:.1f}" for v in os.getloadavg()),
                           "models": args.models, "repository_mib": total / 2**20, "replicas": args.replicas,
                           "budget_bytes": budget, "ratio": args.ratio, "clients": args.clients,
                           "zipf": args.zipf, "duration": args.duration, "cases": []}
    for case in [c for c in args.cases.split(",") if c]:
        print(f"[mesh bench] {case}: {args.models} models, {args.replicas} replicas, budget {budget} bytes each",
              file=sys.stderr, flush=True)
        if case == "triton":
            from load.bench import mesh_triton

            cap = triton_cap(args, budget, doc["cases"])
            print(f"[mesh bench] triton: memory cap {cap} bytes", file=sys.stderr, flush=True)
            doc["cases"].append(mesh_triton.run(repo, names, weights, args, cap,
                                                Path(tempfile.mkdtemp(prefix="mesh-triton-"))))
            continue
        doc["cases"].append(run_case(case, repo, names, weights, args, budget))
    doc["finished_load"] = "load average " + " ".join(f"{v:.1f}" for v in os.getloadavg())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"mesh-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    text = markdown(doc)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"[mesh bench] wrote {stem}.json and .md", file=sys.stderr)
    over = [r["case"] for r in doc["cases"] if r["case"] == "mesh" and r.get("rss_within_bound") is False]
    if over:  # the policy's promise: a replica's RSS never above its budget + base + slack
        raise SystemExit(f"[mesh bench] peak RSS above budget + base + slack in: {', '.join(over)}")
