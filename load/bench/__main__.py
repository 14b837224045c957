"""Benchmark suite: `python -m load.bench [--quick]` writes OUT_DIR/<date>-<host>.md (+ .json).
`python -m load.bench --mesh [--smoke]`: the model mesh benchmark instead (load/bench/mesh.py).

Sections: generator ceiling, serving efficiency (raw onnxruntime vs direct vs gateway), hop cost,
batching, quotas (noisy neighbour), scale-out, and the same hop/efficiency cells with Triton's
perf_analyzer. Models: the team's bench models (`../shared/bench/gen_models.py`, BENCH_ORT_THREADS=2).
Long (minutes): never part of the test suite. Run it on a quiet machine (`uptime` load < 1).
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from load.bench import procs
from load.cli import run_scenario, run_sync
from load.scenario import Scenario, Target

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
PA = SHARED / "tools" / "perf_analyzer"


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.step = min(2.0, args.step_s) if args.quick else args.step_s
        self.warm = 0.5
        stamp = dt.datetime.now(dt.UTC)
        self.out_md = Path(args.out_dir) / f"{stamp:%Y-%m-%d}-{socket.gethostname()}.md"
        self.out_json = self.out_md.with_suffix(".json")
        self.logdir = Path(tempfile.mkdtemp(prefix="load-bench-"))
        self.doc: dict[str, Any] = {"started": stamp.isoformat(timespec="seconds"), "sections": {}}
        self.md: list[str] = []
        self.servers: list[procs.Server] = []

    # ---- helpers ---------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def start(self, srv: procs.Server) -> procs.Server:
        self.servers.append(srv)
        return srv

    def stop_all(self) -> None:
        for s in reversed(self.servers):
            s.stop()
        self.servers.clear()

    def cell(self, name: str, http: str, grpc: str, model: str, protocol: str, conc: int, batch: int = 1,
             pids: list[int] | None = None, mode: str = "closed", rate: float | None = None,
             http_client: str = "raw") -> dict[str, Any]:
        sc = Scenario(name=name, http=http, grpc=grpc, mode=mode, rate=rate, concurrency=conc,  # type: ignore[arg-type]
                      http_client=http_client,  # type: ignore[arg-type]
                      duration_s=self.step, warmup_s=self.warm,
                      targets=[Target(model=model, protocol=protocol, batch=batch)])  # type: ignore[arg-type]
        cpu0 = sum(procs.proc_tree_cpu_s(p) for p in pids or [])
        t0 = time.perf_counter()
        res = run_sync(sc)
        wall = time.perf_counter() - t0
        cpu1 = sum(procs.proc_tree_cpu_s(p) for p in pids or [])
        return summarize_cell(res, (cpu1 - cpu0) / wall if pids else None)

    def wait_quiet(self) -> float:
        deadline = time.monotonic() + self.a.quiet_wait
        load = os.getloadavg()[0]
        while load >= 1.0 and time.monotonic() < deadline:
            time.sleep(5)
            load = os.getloadavg()[0]
        return load

    def section(self, key: str, title: str, body: list[str], data: Any) -> None:
        self.doc["sections"][key] = data
        self.md += [f"## {title}", "", *body, ""]
        self.flush()

    def flush(self) -> None:
        self.out_md.parent.mkdir(parents=True, exist_ok=True)
        self.out_md.write_text("\n".join(self.header() + self.md) + "\n")
        self.out_json.write_text(json.dumps(self.doc, indent=1))

    def header(self) -> list[str]:
        env = self.doc.get("env", {})
        return [f"# Load benchmark: {self.doc['started']} on {socket.gethostname()}", "",
                "Written by `python -m load.bench" + (" --quick" if self.a.quick else "") + "` (load/README.md "
                "explains every figure). Client = meshserve's Python load generator unless a table says "
                "perf_analyzer. Client and servers share the same machine: every throughput is "
                "*server + load generator on these cores*, not server capacity alone.", "",
                f"- machine: {env.get('cpus')} CPUs, load average at start {env.get('loadavg_start')}, "
                f"at end {env.get('loadavg_end', '(running)')}; python {sys.version.split()[0]}",
                f"- models: {env.get('models')} (BENCH_ORT_THREADS={env.get('ort_threads')}), "
                f"{self.step:g} s measured + {self.warm:g} s warm-up per cell", ""]

    # ---- sections --------------------------------------------------------------------------
    def models(self) -> Path:
        models = Path(self.a.models)
        if not (models / "onnx_repo" / "mlp").is_dir():
            self.log(f"generating bench models into {models}")
            subprocess.run([sys.executable, str(SHARED / "bench" / "gen_models.py"), str(models)], check=True,
                           env={**os.environ, "BENCH_ORT_THREADS": "2"}, stdout=subprocess.DEVNULL)
        threads = "?"
        cfg = (models / "onnx_repo" / "mlp" / "config.pbtxt").read_text()
        if '"intra_op_thread_count" value: { string_value: "' in cfg:
            threads = cfg.split('"intra_op_thread_count" value: { string_value: "')[1].split('"')[0]
        self.doc["env"] = {"cpus": os.cpu_count(), "loadavg_start": round(self.wait_quiet(), 2),
                           "models": str(models / "onnx_repo"), "ort_threads": threads}
        return models

    def raw_ort(self, models: Path, batches: list[int]) -> dict[int, dict[str, float]]:
        import numpy as np
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(models / "onnx_repo" / "mlp" / "1" / "model.onnx"), so,
                                    providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        out = {}
        for b in batches:
            x = np.random.default_rng(0).uniform(-1, 1, (b, 512)).astype(np.float32)
            times = []
            end = time.perf_counter() + (0.5 if self.a.quick else 1.5)
            sess.run(None, {name: x})
            while time.perf_counter() < end:
                t = time.perf_counter()
                sess.run(None, {name: x})
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            out[b] = {"ms_per_call": round(med * 1e3, 3), "rows_per_s": round(b / med, 1)}
        return out

    def generator_ceiling(self, svc: procs.Server) -> None:
        self.log("generator ceiling")
        rows = []
        for proto in ("grpc", "grpc-stream", "http-binary", "http-json"):
            c = self.cell(f"gen-{proto}", svc.http, svc.grpc, "add_sub", proto, 64, pids=[svc.pid])
            rows.append({"protocol": proto, **c})
        a = self.cell("gen-aiohttp", svc.http, svc.grpc, "add_sub", "http-binary", 64, pids=[svc.pid],
                      http_client="aiohttp")
        rows.append({"protocol": "http-binary (aiohttp client)", **a})
        o = self.cell("gen-open", svc.http, svc.grpc, "add_sub", "grpc", 1, pids=[svc.pid], mode="open",
                      rate=3000)
        rows.append({"protocol": "grpc open 3000/s", **o})
        body = ["add_sub direct to the ONNX service, closed loop c=64 (and open loop at 3000/s): how fast the "
                "Python generator itself can go on this box. `client µs/req` is the generator's own CPU per "
                "request (os.times); `1e6/µs` is the rate one fully used client core could drive if the server "
                "were free. Compare with perf_analyzer's own µs/req in the perf_analyzer section.", "",
                "| protocol | goodput /s | p50 ms | p99 ms | client cores | client µs/req | ≈ max req/s per client core | server cores |",
                "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            us = r["client_us_per_req"]
            body.append(f"| {r['protocol']} | {r['goodput']} | {r['p50']} | {r['p99']} | {r['client_cores']} | "
                        f"{us} | {int(1e6 / us) if us else '-'} | {r['server_cores']} |")
        if "send_lag_p99" in o:
            body.append(f"\nOpen loop at 3000/s: achieved {o['achieved_rate']}/s, send lag p99 {o['send_lag_p99']} ms.")
        self.section("generator", "Generator ceiling", body, rows)

    def efficiency(self, models: Path, svc: procs.Server, gw: procs.Server) -> None:
        batches = [1, 8, 64] if self.a.quick else [1, 2, 4, 8, 16, 32, 64]
        self.log("raw onnxruntime")
        raw = self.raw_ort(models, batches)
        rows: list[dict[str, Any]] = []
        for b in batches:
            for conc in (1, 4):
                d = self.cell(f"eff-direct-b{b}-c{conc}", svc.http, svc.grpc, "mlp", "grpc", conc, b, [svc.pid])
                g = self.cell(f"eff-gw-b{b}-c{conc}", gw.http, gw.grpc, "mlp", "grpc", conc, b,
                              [svc.pid, gw.pid])
                rows.append({"batch": b, "conc": conc, "raw": raw[b], "direct": d, "gateway": g})
                self.log(f"efficiency b{b} c{conc}: raw {raw[b]['rows_per_s']} direct {d['rows_s']} gw {g['rows_s']}")
        body = ["mlp (512→…→512, FP32), gRPC, each request carries `batch` rows; c = client concurrency. "
                "raw = one onnxruntime session in this process (2 intra-op threads), median call; direct = the "
                "ONNX service; gateway = through the gateway to the same service (same run). rows/s of the "
                "served paths over raw rows/s at the same request batch = fraction of the physical limit "
                "(at c=4 the server can merge requests into larger batches than `batch`, so >1 is possible).",
                "", "| batch | c | raw ms/call | raw rows/s | direct rows/s | direct p50 ms | gateway rows/s | "
                "gateway p50 ms | direct/raw | gateway/raw | gateway/direct |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            raw_r, d, g = r["raw"]["rows_per_s"], r["direct"]["rows_s"], r["gateway"]["rows_s"]
            body.append(f"| {r['batch']} | {r['conc']} | {r['raw']['ms_per_call']} | {raw_r} | {d} | {r['direct']['p50']} | "
                        f"{g} | {r['gateway']['p50']} | {ratio(d, raw_r)} | {ratio(g, raw_r)} | {ratio(g, d)} |")
        self.section("efficiency", "Serving efficiency (mlp)", body, rows)

    def hop(self, svc: procs.Server, gw: procs.Server) -> None:
        rows: list[dict[str, Any]] = []
        for proto in ("http-binary", "grpc"):
            for conc in (1, 8, 16, 32):
                d = self.cell(f"hop-direct-{proto}-c{conc}", svc.http, svc.grpc, "add_sub", proto, conc,
                              pids=[svc.pid])
                g = self.cell(f"hop-gw-{proto}-c{conc}", gw.http, gw.grpc, "add_sub", proto, conc,
                              pids=[svc.pid, gw.pid])
                rows.append({"protocol": proto, "conc": conc, "direct": d, "gateway": g})
                self.log(f"hop {proto} c{conc}: direct p50 {d['p50']} gw p50 {g['p50']}")
        body = ["add_sub, batch 1, closed loop. `added` = gateway − direct: the cost of one extra hop (client → "
                "gateway → service vs client → service), measured back to back in the same run.", "",
                "| protocol | c | direct /s | gateway /s | direct p50 | gateway p50 | added p50 ms | direct p99 | "
                "gateway p99 | added p99 ms | server cores direct / gw path |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            d, g = r["direct"], r["gateway"]
            body.append(f"| {r['protocol']} | {r['conc']} | {d['goodput']} | {g['goodput']} | {d['p50']} | {g['p50']} | "
                        f"{diff(g['p50'], d['p50'])} | {d['p99']} | {g['p99']} | {diff(g['p99'], d['p99'])} | "
                        f"{d['server_cores']} / {g['server_cores']} |")
        self.section("hop", "Hop cost (add_sub, gateway vs direct)", body, rows)

    def batching(self, svc: procs.Server) -> None:
        import aiohttp

        from load.tune import _get, _post_load

        async def reload(delay: int | None) -> None:
            async with aiohttp.ClientSession() as s:
                if delay is None:
                    await _post_load(s, svc.http, "mlp", None)
                    return
                cfg = await _get(s, f"http://{svc.http}/v2/models/mlp/config")
                cfg.setdefault("dynamic_batching", {})["max_queue_delay_microseconds"] = delay
                await _post_load(s, svc.http, "mlp", cfg)

        rows = []
        try:
            asyncio.run(reload(1000))
        except SystemExit as exc:
            self.section("batching", "Batching (mlp: queue delay × concurrency)", [f"not run: {exc}"], {})
            return
        for delay in (0, 500, 1000, 4000):
            asyncio.run(reload(delay))
            for conc in (1, 8, 32):
                c = self.cell(f"batch-d{delay}-c{conc}", svc.http, svc.grpc, "mlp", "grpc", conc, pids=[svc.pid])
                rows.append({"delay_us": delay, "conc": conc, **c})
                self.log(f"batching d{delay} c{conc}: {c['goodput']}/s p99 {c['p99']} rows/exec {c['rows_exec']}")
        asyncio.run(reload(None))
        body = ["mlp direct to the ONNX service over gRPC, batch 1 per request; `max_queue_delay_microseconds` set "
                "per row by reloading the model with a config override (repository extension), max_batch_size 64. "
                "Batch sizes: executions per batch size from the statistics extension (`batch_stats`), warm-up included.",
                "", "| queue delay µs | c | goodput /s | p50 ms | p99 ms | rows/exec | batch sizes (size:executions) |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            bs = " ".join(f"{k}:{v}" for k, v in sorted(r["batch_sizes"].items(), key=lambda kv: int(kv[0])))
            body.append(f"| {r['delay_us']} | {r['conc']} | {r['goodput']} | {r['p50']} | {r['p99']} | {r['rows_exec']} | {bs} |")
        self.section("batching", "Batching (mlp: queue delay × concurrency)", body, rows)

    def tracing(self, models: Path) -> None:
        """Issue #5's overhead figure: add_sub over gRPC at c=16 through gateway + service, tracing
        off vs on with 10% sampling (OTLP/gRPC to a local sink). Both stacks run side by side, idle
        while the other is measured, and the cells alternate (off/on, then on/off, ...) so that
        this VM's drift falls on both alike; the cost is taken per adjacent pair. Both stacks are
        started afresh for every two pairs: one process pair can run a few % faster or slower than
        another (memory layout, hash seeds), and that must not count as tracing's cost."""
        self.log("tracing overhead")
        sink = procs.OtlpSink()
        traced = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink.port}",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                  "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        generations = 2 if self.a.quick else 8
        pairs_n = 2 * generations
        rows = []
        try:
            for gen in range(generations):
                stacks = {}
                try:
                    for label, env in (("off", {"OTEL_TRACES_EXPORTER": "none"}), ("10% sampled", traced)):
                        svc = self.start(procs.service(models / "onnx_repo", self.logdir / f"svc-trace-{label}.log",
                                                       env=env))
                        gw = self.start(procs.gateway([svc.grpc], self.logdir / f"gw-trace-{label}.log", env=env))
                        stacks[label] = (svc, gw)
                    for i in (2 * gen + 1, 2 * gen + 2):
                        order = ("off", "10% sampled") if i % 2 else ("10% sampled", "off")
                        for label in order:
                            svc, gw = stacks[label]
                            c = self.cell(f"trace-{label}-{i}", gw.http, gw.grpc, "add_sub", "grpc", 16,
                                          pids=[svc.pid, gw.pid])
                            rows.append({"tracing": label, "repeat": i, **c})
                            self.log(f"tracing {label} ({i}): {c['goodput']}/s")
                finally:
                    for svc, gw in stacks.values():
                        for proc in (gw, svc):
                            proc.stop()
                            self.servers.remove(proc)
        finally:
            sink.stop()
        off = [r["goodput"] for r in rows if r["tracing"] == "off"]
        on = [r["goodput"] for r in rows if r["tracing"] != "off"]
        cost = 1 - (sum(on) / len(on)) / (sum(off) / len(off)) if off and on and all(off) else None
        pairs = [1 - b / a for a, b in zip(off, on, strict=False) if a]
        body = ["add_sub over gRPC, concurrency 16, through gateway + ONNX service; two stacks started once, "
                "tracing off (`OTEL_TRACES_EXPORTER=none`) and on with `parentbased_traceidratio` 0.1, OTLP/gRPC "
                "to a bare sink in its own process (on the same cores; not counted in server cores). The stacks take "
                f"turns ({pairs_n} pairs, order alternating), {self.step:g} s per cell, so that the drift of this VM "
                f"falls on both alike; both are started afresh every two pairs ({generations} times), so that one "
                "process pair's own speed does not count as tracing's cost.", "",
                "| tracing | pair | goodput /s | p50 ms | p99 ms | server cores | server µs/req |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            us = round(r["server_cores"] / r["goodput"] * 1e6) if r["goodput"] and r["server_cores"] else "-"
            body.append(f"| {r['tracing']} | {r['repeat']} | {r['goodput']} | {r['p50']} | {r['p99']} | "
                        f"{r['server_cores']} | {us} |")
        error = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else None
        if cost is not None:
            body.append(f"\nThroughput cost of 10% sampling: **{cost:.1%}** (mean throughput on vs off); median of "
                        f"the per-pair costs {statistics.median(pairs):.1%} (pairs: {', '.join(f'{c:.1%}' for c in pairs)}; "
                        f"OTLP bytes received by the sink: {sink.spans_bytes}).")
            if error is not None:
                body.append(f"Mean of the per-pair costs {statistics.mean(pairs):.1%}, standard error {error:.1%}: "
                            f"one run's figure is good to about ±{1.96 * error:.1%} (95%); pool several runs to "
                            "compare with a threshold.")
        self.section("tracing", "Tracing overhead (10% sampling)", body,
                     {"rows": rows, "cost": cost, "pairs": pairs, "pair_standard_error": error})

    def profile(self, svc: procs.Server, gw: procs.Server) -> None:
        """Where the time goes: py-spy on each server process during one cell (self time by area)."""
        pyspy = shutil.which("py-spy")
        if pyspy is None:
            self.section("profile", "Where the time goes (py-spy)",
                         ["not run: py-spy is not installed (`pip install py-spy`, part of the [load] extra)"], {})
            return
        cells = [("gateway", gw, "add_sub gRPC c=16 through the gateway", gw, "add_sub", 16, 1),
                 ("service", svc, "add_sub gRPC c=16 through the gateway", gw, "add_sub", 16, 1),
                 ("service", svc, "mlp gRPC batch 64 c=2 direct", svc, "mlp", 2, 64)]
        rows = []
        for who, proc, what, via, model, conc, batch in cells:
            out = self.logdir / f"profile-{who}-{model}.txt"
            spy = subprocess.Popen([pyspy, "record", "-p", str(proc.pid), "-d", str(max(2, int(self.step))),
                                    "-r", "200", "-f", "raw", "-o", str(out), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            c = self.cell(f"profile-{who}-{model}", via.http, via.grpc, model, "grpc", conc, batch, [proc.pid])
            spy.wait(timeout=60)
            areas, top = summarize_profile(out) if out.exists() else ({}, [])
            rows.append({"process": who, "load": what, "goodput": c["goodput"], "areas": areas, "top": top})
        body = ["py-spy (`record -r 200 --nonblocking`, raw stacks) on one process while the load in the second "
                "column runs; each sample is charged to the innermost frame (self time), grouped by area. "
                "`event loop (native)` is uvloop + sockets (syscalls) seen from Python; `runtime` is "
                "onnxruntime's run call; `ingress` is meshserve's HTTP/2 gRPC server/client.", ""]
        for r in rows:
            body += [f"**{r['process']}** under {r['load']} ({r['goodput']}/s):", "",
                     "| area | share of samples |", "|---|---|"]
            body += [f"| {k} | {v:.1%} |" for k, v in r["areas"].items()]
            body += ["", "Top frames: " + "; ".join(f"`{f}` {v:.1%}" for f, v in r["top"]), ""]
        self.section("profile", "Where the time goes (py-spy)", body, rows)

    def quotas(self, svc: procs.Server) -> None:
        helptext = subprocess.run([sys.executable, "-m", "meshserve", "gateway", "--help"], capture_output=True,
                                  text=True, cwd=ROOT).stdout
        scen = ROOT / "load" / "scenarios" / "noisy_neighbour.yaml"
        if "--tenants" not in helptext:
            self.section("quotas", "Quotas (noisy neighbour)", [
                f"**not available: issue #4** (the gateway has no tenants/quotas). Scenario ready: `{scen.relative_to(ROOT)}`."],
                {"available": False})
            return
        try:
            rows = self._noisy_neighbour(svc)
        except Exception as exc:  # the tenants feature is in flux (issue #4)
            self.section("quotas", "Quotas (noisy neighbour)", [
                f"not available: issue #4 — the gateway has `--tenants` but the run failed: `{exc}`. "
                f"Scenario: `{scen.relative_to(ROOT)}`."], {"available": False, "error": str(exc)})
            return
        body = ["add_sub over gRPC through one gateway with per-tenant quotas (`--tenants`): the quiet tenant "
                "sends 100/s (open loop) alone, then while the noisy tenant, from a separate client process, floods at 10x "
                "its quota (open loop 2000/s, rate-limited to 200/s by its quota); the quiet tenant measures only once "
                "the gateway counts the flood's rejections at full rate. After a first pair that is not counted "
                "(warm-up), the two phases alternate three times, so the spread between repeats shows the noise. "
                "Noisy rejections are the quota at work.", "",
                "| phase | quiet goodput /s | quiet p50 ms | quiet p99 ms | quiet errors | noisy goodput /s | noisy errors |",
                "|---|---|---|---|---|---|---|"]
        for r in rows:
            q, n = r["quiet"], r.get("noisy")
            body.append(f"| {r['phase']} | {q['goodput']} | {q['p50']} | {q['p99']} | {q['errors'] or 0} | "
                        f"{n['goodput'] if n else '-'} | {fmt_errors(n) if n else '-'} |")
        alone = [r["quiet"]["p99"] for r in rows if not r.get("warmup") and "noisy" not in r and r["quiet"]["p99"]]
        flood = [r["quiet"]["p99"] for r in rows if not r.get("warmup") and "noisy" in r and r["quiet"]["p99"]]
        summary = {}
        if alone and flood:
            summary = {"p99_alone_median": statistics.median(alone), "p99_flood_median": statistics.median(flood),
                       "p99_change_median": statistics.median(flood) / statistics.median(alone) - 1,
                       "p99_change_mean": statistics.mean(flood) / statistics.mean(alone) - 1}
            body.append(f"\nQuiet tenant's p99 with the flood vs alone (counted phases): median "
                        f"{summary['p99_flood_median']:.2f} vs {summary['p99_alone_median']:.2f} ms "
                        f"(**{summary['p99_change_median']:+.0%}**), mean of phases {summary['p99_change_mean']:+.0%}.")
        self.section("quotas", "Quotas (noisy neighbour)", body, {"rows": rows, "summary": summary})

    def _noisy_neighbour(self, svc: procs.Server) -> list[dict[str, Any]]:
        import hashlib

        def hash_key(key: str) -> str:  # as gateway.auth.hash_key: tenants.yaml stores SHA-256 digests
            return hashlib.sha256(key.encode()).hexdigest()
        tfile = self.logdir / "tenants.yaml"
        tfile.write_text(f"""tenants:
  - name: noisy
    keys_sha256: ["{hash_key('noisy-key')}"]
    rate: 200
    burst: 50
  - name: quiet
    keys_sha256: ["{hash_key('quiet-key')}"]
    rate: 1000
    burst: 200
""")
        gw = self.start(procs.gateway([svc.grpc], self.logdir / "gateway-tenants.log", ["--tenants", str(tfile)]))
        tenants = {"noisy": {"api_key": "noisy-key"}, "quiet": {"api_key": "quiet-key"}}
        quiet_s = 3.0 if self.a.quick else 20.0  # p99 of 100/s needs ~2000 samples to mean anything
        quiet = Scenario.model_validate({"name": "quiet", "http": gw.http, "grpc": gw.grpc, "mode": "open",
                                         "rate": 100, "duration_s": quiet_s, "warmup_s": self.warm,
                                         "tenants": tenants,
                                         "targets": [{"model": "add_sub", "protocol": "grpc", "tenant": "quiet"}]})
        # Issue #4's scenario: the noisy tenant floods at 10x its quota (open loop, 10 x 200/s).
        noisy = quiet.model_copy(update={"name": "noisy", "mode": "open", "rate": 10 * 200,
                                         "duration_s": quiet_s + self.warm + 12,
                                         "targets": [Target(model="add_sub", protocol="grpc", tenant="noisy")]})
        noisy_yaml = self.logdir / "noisy.yaml"
        noisy_yaml.write_text(json.dumps(noisy.model_dump(mode="json", exclude_none=True)))

        def rejected() -> float:
            text = urllib.request.urlopen(f"http://{gw.http}/metrics", timeout=5).read().decode()
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("meshserve_gateway_quota_rejections_total") and 'tenant="noisy"' in line)

        def with_flood(label: str) -> dict[str, Any]:
            # The flood runs in a process of its own: sharing one generator process, its sends
            # would delay the quiet tenant's inside the client and count as server latency.
            noisy_json = self.logdir / f"noisy-{label}.json"
            flood = subprocess.Popen([sys.executable, "-m", "load", "--scenario", str(noisy_yaml),
                                      "--json", str(noisy_json)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            try:
                # Measure only once the flood is at full rate: its process start (imports, ~1-2 s
                # of CPU here) must not land in the quiet tenant's window.
                deadline = time.monotonic() + 10
                before = rejected()
                while time.monotonic() < deadline:
                    time.sleep(0.5)
                    now = rejected()
                    if now - before > 0.5 * 0.5 * 1800:  # half the expected 1800 rejections/s
                        break
                    before = now
                time.sleep(self.warm)
                q = run_sync(quiet)
            finally:
                flood.wait(timeout=quiet_s * 2 + 60)
            n = json.loads(noisy_json.read_text()) if noisy_json.exists() else {}
            return {"phase": f"quiet + noisy ({label})", "quiet": summarize_cell(q, None),
                    "noisy": summarize_cell(n, None)}

        rows = []
        # A first pair, not counted: the gateway's first flood (allocator growth, first-time
        # paths) is warm-up, not the steady state the target is about.
        warm_alone = {"phase": "warm-up: quiet alone", "quiet": summarize_cell(run_sync(quiet), None), "warmup": True}
        warm_flood = {**with_flood("warm-up"), "warmup": True}
        warm_flood["phase"] = "warm-up: quiet + noisy"
        rows += [warm_alone, warm_flood]
        for i in (1, 2, 3):  # alternate, three times: the spread between repeats is the noise floor
            rows.append({"phase": f"quiet alone ({i})", "quiet": summarize_cell(run_sync(quiet), None)})
            rows.append(with_flood(str(i)))
        gw.stop()
        self.servers.remove(gw)
        return rows

    def scale_out(self, models: Path, svc: procs.Server, gw: procs.Server) -> None:
        self.log("scale-out")
        rows = []

        def split(name: str, gws: list[procs.Server], model: str, conc: int, pids: list[int]) -> dict[str, Any]:
            scs = [Scenario(name=f"{name}-{i}", http=g.http, grpc=g.grpc, concurrency=conc // len(gws),
                            duration_s=self.step, warmup_s=self.warm, targets=[Target(model=model, protocol="grpc")])
                   for i, g in enumerate(gws)]

            async def all_() -> list[dict[str, Any]]:
                return list(await asyncio.gather(*(run_scenario(s) for s in scs)))

            cpu0 = sum(procs.proc_tree_cpu_s(p) for p in pids)
            t0 = time.perf_counter()
            res = asyncio.run(all_())
            cores = (sum(procs.proc_tree_cpu_s(p) for p in pids) - cpu0) / (time.perf_counter() - t0)
            cells = [summarize_cell(r, None) for r in res]
            return {"goodput": round(sum(c["goodput"] for c in cells), 1),
                    "p50": max(c["p50"] or 0 for c in cells), "p99": max(c["p99"] or 0 for c in cells),
                    "errors": sum(c["errors"] for c in cells), "server_cores": round(cores, 2),
                    "client_cores": round(sum(c["client_cores"] or 0 for c in cells), 2)}

        gw2 = self.start(procs.gateway([svc.grpc], self.logdir / "gateway2.log"))
        for model in ("add_sub", "mlp"):
            rows.append({"setup": "1 gateway, 1 service", "model": model,
                         **split("g1", [gw], model, 32, [svc.pid, gw.pid])})
            rows.append({"setup": "2 gateways, 1 service", "model": model,
                         **split("g2", [gw, gw2], model, 32, [svc.pid, gw.pid, gw2.pid])})
        svc2 = self.start(procs.service(models / "onnx_repo", self.logdir / "service2.log"))
        gw3 = self.start(procs.gateway([svc.grpc, svc2.grpc], self.logdir / "gateway3.log"))
        for model in ("add_sub", "mlp"):
            rows.append({"setup": "1 gateway, 2 services", "model": model,
                         **split("s2", [gw3], model, 32, [svc.pid, svc2.pid, gw3.pid])})
        body = [f"gRPC, batch 1, total client concurrency 32 (split evenly over the gateways). This machine has "
                f"{os.cpu_count()} cores shared by the client, every gateway and every service: adding processes "
                "adds scheduling and hop overhead but no cores, so on this box scale-out **cannot** show a "
                "throughput gain — what it can show is that the mesh stays correct (no errors) and how much the "
                "extra processes cost. Real gains need the processes on separate cores/machines "
                "(deploy/compose.yaml, k8s).", "",
                "| setup | model | goodput /s | p50 ms (worst) | p99 ms (worst) | errors | server cores | client cores |",
                "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            body.append(f"| {r['setup']} | {r['model']} | {r['goodput']} | {r['p50']} | {r['p99']} | {r['errors']} | "
                        f"{r['server_cores']} | {r['client_cores']} |")
        self.section("scale_out", "Scale-out (1 vs 2 gateways, 1 vs 2 service replicas)", body, rows)

    def perf_analyzer(self, models: Path, svc: procs.Server, gw: procs.Server) -> None:
        if not PA.exists():
            self.section("perf_analyzer", "perf_analyzer", ["not run: /work/shared/tools/perf_analyzer missing"], {})
            return
        rows = []
        concs = (1, 8, 32)
        for model in ("add_sub", "mlp"):
            for mode in ("http", "grpc"):
                for conc in concs:
                    for label, srv in (("direct", svc), ("gateway", gw)):
                        r = self._pa(srv, model, mode, conc, models)
                        rows.append({"model": model, "mode": mode, "conc": conc, "path": label, **r})
                        self.log(f"pa {model} {mode} c{conc} {label}: {r}")
        body = ["Triton's perf_analyzer (C++, `-i http` binary tensors / `-i grpc`, batch 1, "
                f"`--measurement-interval {int(self.step * 1000)}`, file inputs from perf_data/), same servers, "
                "same run. Compare with the Python generator's hop/efficiency tables above: the difference in "
                "throughput at c=32 is mostly client cost (client cores column).", "",
                "| model | mode | c | direct /s | gateway /s | direct p50 ms | gateway p50 ms | added p50 ms | "
                "direct p99 ms | gateway p99 ms | added p99 ms | pa cores (direct / gw) | pa µs/req (direct) |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i in range(0, len(rows), 2):
            d, g = rows[i], rows[i + 1]
            us = round(d["client_cores"] / d["rps"] * 1e6, 1) if d.get("rps") and d.get("client_cores") else "-"
            body.append(f"| {d['model']} | {d['mode']} | {d['conc']} | {d.get('rps')} | {g.get('rps')} | {d.get('p50')} | "
                        f"{g.get('p50')} | {diff(g.get('p50'), d.get('p50'))} | {d.get('p99')} | {g.get('p99')} | "
                        f"{diff(g.get('p99'), d.get('p99'))} | {d.get('client_cores')} / {g.get('client_cores')} | {us} |")
        self.section("perf_analyzer", "Same cells with perf_analyzer", body, rows)

    def _pa(self, srv: procs.Server, model: str, mode: str, conc: int, models: Path) -> dict[str, Any]:
        csv_path = self.logdir / f"pa-{model}-{mode}-{conc}-{srv.pid}.csv"
        url = srv.http if mode == "http" else srv.grpc
        cmd = [str(PA), "-m", model, "-u", url, "-i", mode, "--concurrency-range", str(conc),
               "--measurement-interval", str(int(self.step * 1000)), "--stability-percentage", "999",
               "--max-trials", "3", "--input-data", str(models / "perf_data" / f"{model}.json"), "-f", str(csv_path)]
        t0 = os.times()
        w0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return {"error": "timeout"}
        t1 = os.times()
        cores = round((t1.children_user + t1.children_system - t0.children_user - t0.children_system)
                      / (time.perf_counter() - w0), 2)
        if p.returncode != 0 or not csv_path.exists():
            return {"error": (p.stdout + p.stderr).strip().splitlines()[-1:] or ["failed"]}
        row = next(csv.DictReader(csv_path.open()))
        return {"rps": round(float(row["Inferences/Second"]), 1), "p50": round(int(row["p50 latency"]) / 1e3, 2),
                "p99": round(int(row["p99 latency"]) / 1e3, 2), "client_cores": cores}

    # ---- driver ----------------------------------------------------------------------------
    def run(self) -> Path:
        models = self.models()
        only = set(self.a.only.split(",")) if self.a.only else None

        def want(k: str) -> bool:
            return only is None or k in only

        try:
            svc = self.start(procs.service(models / "onnx_repo", self.logdir / "service.log",
                                           procs.explicit_control_args()))
            gw = self.start(procs.gateway([svc.grpc], self.logdir / "gateway.log"))
            for key, fn in (("generator", lambda: self.generator_ceiling(svc)),
                            ("efficiency", lambda: self.efficiency(models, svc, gw)),
                            ("hop", lambda: self.hop(svc, gw)),
                            ("batching", lambda: self.batching(svc)),
                            ("quotas", lambda: self.quotas(svc)),
                            ("tracing", lambda: self.tracing(models)),
                            ("profile", lambda: self.profile(svc, gw)),
                            ("perf_analyzer", lambda: self.perf_analyzer(models, svc, gw) if not self.a.no_pa else None),
                            ("scale_out", lambda: self.scale_out(models, svc, gw))):
                if want(key):
                    fn()
        finally:
            self.stop_all()
            self.doc["env"]["loadavg_end"] = round(os.getloadavg()[0], 2)
            self.flush()
        shutil.rmtree(self.logdir, ignore_errors=True) if not self.a.keep_logs else None
        return self.out_md


_AREAS = (("ingress (meshserve/server/h2*)", ("meshserve/server/h2",)),
          ("runtime (onnxruntime)", ("onnxruntime",)),
          ("gateway logic", ("gateway/",)),
          ("service logic", ("services/",)),
          ("meshserve common", ("meshserve/",)),
          ("protobuf / grpc python", ("google/protobuf", "grpc/")),
          ("threads (executor, idle waits)", ("threading.py", "concurrent/futures")),
          ("event loop (native)", ("asyncio/runners.py",)))


def summarize_profile(path: Path) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """py-spy raw output -> (self-time share per area, top 8 innermost frames)."""
    from collections import Counter

    frames: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        frames[stack.split(";")[-1]] += int(n)
    if not total:
        return {}, []
    areas: Counter[str] = Counter()
    for frame, count in frames.items():
        area = next((name for name, keys in _AREAS if any(k in frame for k in keys)), "other")
        areas[area] += count
    return ({k: v / total for k, v in areas.most_common()},
            [(f, c / total) for f, c in frames.most_common(8)])


def fmt_errors(cell: dict[str, Any]) -> str:
    kinds = cell.get("error_kinds") or {}
    return ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) or "0"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def diff(a: float | None, b: float | None) -> str:
    return f"{a - b:+.2f}" if a is not None and b is not None else "-"


def summarize_cell(res: dict[str, Any], server_cores: float | None) -> dict[str, Any]:
    lat = res["latency_ms"]
    ss: dict[str, Any] = next(iter(res["server_stats"].values()), {})
    out = {"goodput": res["goodput_rps"], "rows_s": res["rows_per_s"], "p50": lat["p50"], "p99": lat["p99"],
           "errors": res["failed"], "error_kinds": res["errors"], "rows_exec": ss.get("rows_per_execution"),
           "batch_sizes": ss.get("batch_sizes", {}), "client_cores": res["client_cpu"]["cores"],
           "client_us_per_req": res["client_cpu"]["us_per_request"],
           "server_cores": round(server_cores, 2) if server_cores is not None else None}
    if "open_loop" in res:
        out["achieved_rate"] = res["open_loop"]["achieved_rate"]
        out["send_lag_p99"] = res["open_loop"]["send_lag_ms"]["p99"]
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--side-by-side"]:  # the alternating side by side: its own knobs (load/bench/sbs.py)
        from load.bench import sbs

        raise SystemExit(sbs.main(argv[1:]))
    if "--cache" in argv:  # the response cache benchmark, with its own flags
        from load.bench import cache

        cache.main([a for a in argv if a != "--cache"])
        return
    if "--mesh" in argv:  # the model mesh benchmark, with flags of its own (load/bench/mesh.py)
        from load.bench import mesh

        mesh.main([a for a in argv if a != "--mesh"])
        return
    ap = argparse.ArgumentParser(prog="python -m load.bench", description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--cache", action="store_true",
                    help="instead: the response cache benchmark (load/bench/cache.py; `--cache --help` for its flags)")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter cells (about 5 minutes)")
    ap.add_argument("--step-s", type=float, default=3.0, help="seconds measured per cell")
    ap.add_argument("--models", default="/tmp/bench-models", help="gen_models.py output (generated if missing)")
    ap.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "bench-results"),
                    help="where the report goes (outside the tree: docs/perf/ holds the decisions)")
    ap.add_argument("--only", default="", help="comma list: generator,efficiency,hop,batching,quotas,tracing,profile,perf_analyzer,scale_out")
    ap.add_argument("--no-pa", action="store_true", help="skip the perf_analyzer cells")
    ap.add_argument("--quiet-wait", type=float, default=120, help="max seconds to wait for load average < 1")
    ap.add_argument("--keep-logs", action="store_true")
    ap.add_argument("--side-by-side", nargs="?", const="", metavar="RESULTS_DIR",
                    help="instead (first argument): Triton, gateway and direct alternating per cell, repeated "
                         "(load/bench/sbs.py; `--side-by-side --help` for its knobs)")
    ap.add_argument("--side-by-side-once", nargs="?", const="", metavar="RESULTS_DIR",
                    help="instead: load/bench/side_by_side.sh (one perf_analyzer sweep per server, one after the "
                         "other) and its 18-cell table; env knobs in the script")
    args = ap.parse_args(argv)
    if args.side_by_side is not None:
        from load.bench import sbs

        raise SystemExit(sbs.main([args.side_by_side] if args.side_by_side else []))
    if args.side_by_side_once is not None:
        script = ROOT / "load" / "bench" / "side_by_side.sh"
        raise SystemExit(subprocess.call(["bash", str(script), *([args.side_by_side_once] if args.side_by_side_once else [])]))
    out = Suite(args).run()
    print(out)


if __name__ == "__main__":
    procs.clean_exit()
    main()
