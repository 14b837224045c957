"""The gateway's front door with TLS on against off, in CPU per request, with Triton's perf_analyzer
as the client (gRPC, HTTP binary, HTTP JSON): docs/perf/tls-cost.md, "Where the front door's time went"
and "The HTTP front door at c32: what is left, and whose it is".

    python -m load.bench.tls_front [--models add_sub,mlp] [--modes grpc,http,http-json] [-c 32 | --rate N]
        [--rounds 3] [--window 6] [--baseline-tree DIR] [--together | --callgrind]

One ONNX service on the bench models (/tmp/bench-models/onnx_repo, ../shared/bench/gen_models.py)
and, in front of it, a plaintext gateway (label ``off``) and a gateway with TLS on its gRPC and
HTTP ports (``tls``); with --baseline-tree, one more TLS gateway run from another checkout of the
project (``tls@base``: e.g. `git worktree add /tmp/base <rev>`). The hop is plaintext for all.

Per cell, each label is driven in turn by perf_analyzer at concurrency -c for a few seconds; over a
window of --window seconds in its middle the gateway's CPU seconds (/proc) and its own count of
requests answered (meshserve_gateway_requests_total) give µs per request; so do perf_analyzer's
own CPU seconds (``client``: its HTTPS client works harder with TLS too, on the same cores) and
the service's (``svc``; not with --together, where the labels share it). ``all`` is their sum,
what one request costs the machine: on a machine that the cell saturates, the throughput cost is
about all's cost. The gateway's read and write calls and bytes per request (/proc/PID/io) give
the TLS records per request: its bytes over ``off``'s divided by what a record adds. The machine
is shared: each cell's median over --rounds is printed. --together drives every label at the
same time, each with its own perf_analyzer, so that all see the same machine (their throughputs
then differ, and a gateway's CPU per request falls as its throughput rises: it merges more
requests per hop call); --rate N drives each label at N requests per second instead, so that
their throughputs are the same too. --callgrind runs the gateways under valgrind and counts
their user-space instructions per request over each window: the one measure here that other
work on the machine does not move (it leaves out the kernel's work and the client's).
"""
from __future__ import annotations

import argparse
import os
import re
import ssl
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from load.bench import callgrind, procs

ROOT = procs.ROOT
MODELS = Path(os.environ.get("MODELS_DIR", "/tmp/bench-models"))
PERF_ANALYZER = os.environ.get("PERF_ANALYZER", str(ROOT.parent / "shared" / "tools" / "perf_analyzer"))
MODES = {"grpc": ["-i", "grpc"], "http": ["-i", "http"],
         "http-json": ["-i", "http", "--input-tensor-format=json", "--output-tensor-format=json"]}


def _ready(gw: procs.Server, ctx: ssl.SSLContext | None, timeout: float = 120) -> None:
    procs.wait_ready(gw.http, timeout, gw.proc, ctx)


def _gateway(tree: Path, upstream: str, log: Path, extra: list[str], ctx: ssl.SSLContext | None,
             dump: Path | None = None) -> procs.Server:
    """A gateway run from ``tree`` (procs.Server runs from procs.ROOT; its readiness check is plain
    HTTP), under callgrind (not counting yet) when ``dump`` is given."""
    here, wait = procs.ROOT, procs.wait_ready
    procs.ROOT, procs.wait_ready = tree, (lambda *a, **k: None)
    slow = dump is not None
    try:
        # (under callgrind: discovery's health calls are slow, not every 2 s)
        gw = procs.gateway([upstream], log, extra=[*extra, "--metrics-port", "0",
                                                   *(["--discovery-interval", "60"] if slow else [])],
                           prefix=callgrind.command(dump, instr_at_start=False) if dump else None,
                           timeout=600 if slow else 120)
    finally:
        procs.ROOT, procs.wait_ready = here, wait
    _ready(gw, ctx, 600 if slow else 120)
    return gw


def _counts(gw: procs.Server, model: str) -> tuple[int, int]:
    """(requests the gateway answered, the calls to its service that carried them: a merged call
    carries several, meshserve_gateway_merged_*)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.ports['metrics']}/metrics", timeout=5) as r:
        text = r.read().decode()
    line = f'meshserve_gateway_requests_total{{model="{model}",outcome="OK"}} '
    found = re.search(re.escape(line) + r"(\d+)", text)
    answered = int(found.group(1)) if found else 0

    def total(family: str) -> int:
        return sum(int(float(v)) for v in re.findall(rf"^{family}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    merged = total("meshserve_gateway_merged_requests_total")
    return answered, answered - merged + total("meshserve_gateway_merged_sends_total")


def _pa(gw: procs.Server, tls: bool, ca: Path, model: str, mode: str, c: int, rate: int, seconds: float
        ) -> subprocess.Popen[bytes]:
    if mode == "grpc":
        url, extra = gw.grpc, (["--ssl-grpc-use-ssl", "true", "--ssl-grpc-root-certifications-file", str(ca)]
                               if tls else [])
    else:
        url = ("https://" if tls else "") + gw.http
        extra = (["--ssl-https-verify-peer", "1", "--ssl-https-verify-host", "2",
                  "--ssl-https-ca-certificates-file", str(ca)] if tls else [])
    load = ["--request-rate-range", str(rate)] if rate else ["--concurrency-range", str(c)]
    cmd = [PERF_ANALYZER, "-m", model, "-u", url, *MODES[mode], *load,
           "--measurement-interval", str(int(seconds * 1000 / 3)), "--max-trials", "3",
           "--stability-percentage", "999", "--input-data", str(MODELS / "perf_data" / f"{model}.json"), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    from meshserve.server import certs

    ap = argparse.ArgumentParser(prog="python -m load.bench.tls_front", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="add_sub")
    ap.add_argument("--modes", default="grpc,http,http-json")
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=int, default=0,
                    help="requests per second per label instead of a concurrency (perf_analyzer's --request-rate-range): "
                         "every label then answers as many, and their CPU per request compares like for like")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=6.0, help="seconds measured per cell and label")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="another checkout: its TLS gateway too")
    ap.add_argument("--together", action="store_true", help="drive all labels at once")
    ap.add_argument("--callgrind", action="store_true",
                    help="the gateways under callgrind: their user-space instructions per request over each window "
                         "(a count that a busy machine does not change; not the kernel's work); labels in turn")
    a = ap.parse_args(argv)
    if a.callgrind and (a.together or not callgrind.available()):
        raise SystemExit("--callgrind: labels in turn only, and valgrind is needed (apt-get install valgrind)")
    warm = 20.0 if a.callgrind else 3.0  # (32 handshakes under valgrind take seconds)
    tick = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca = certs.authority(d, "ca")
        server = ca.issue(d, "server", server=True)
        front = ["--grpc-use-ssl", "--http-use-ssl", "--grpc-server-cert", str(server.cert), "--grpc-server-key", str(server.key),
                  "--http-server-cert", str(server.cert), "--http-server-key", str(server.key)]
        ctx = ssl.create_default_context(cafile=str(ca.cert))
        svc = procs.service(MODELS / "onnx_repo", d / "svc.log", env={"BENCH_ORT_THREADS": "2"})
        gws: dict[str, tuple[procs.Server, bool]] = {}
        dumps = {g: d / f"cg-{g.replace('@', '-')}.out" for g in ("off", "tls", "tls@base")} if a.callgrind else {}
        try:
            gws["off"] = (_gateway(ROOT, svc.grpc, d / "gw-off.log", [], None, dumps.get("off")), False)
            gws["tls"] = (_gateway(ROOT, svc.grpc, d / "gw-tls.log", front, ctx, dumps.get("tls")), True)
            if a.baseline_tree is not None:
                gws["tls@base"] = (_gateway(a.baseline_tree.resolve(), svc.grpc, d / "gw-base.log", front, ctx,
                                            dumps.get("tls@base")), True)
            runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
            for rnd in range(a.rounds):
                for model in a.models.split(","):
                    for mode in a.modes.split(","):
                        groups = [list(gws)] if a.together else [[label] for label in gws]
                        line = f"round {rnd} {model:8s} {mode:9s}"
                        for group in groups:
                            clients = [_pa(gws[g][0], gws[g][1], ca.cert, model, mode, a.concurrency, a.rate,
                                           warm + a.window + 3) for g in group]
                            time.sleep(warm)
                            s0 = {g: _sample(gws[g][0], p.pid, svc.pid, model) for g, p in zip(group, clients, strict=True)}
                            if a.callgrind:
                                before = set(d.glob(dumps[group[0]].name + "*"))
                                callgrind.control(gws[group[0]][0].pid, "--zero")
                                callgrind.control(gws[group[0]][0].pid, "--instr=on")
                            time.sleep(a.window)
                            if a.callgrind:
                                callgrind.control(gws[group[0]][0].pid, "--instr=off")
                            s1 = {g: _sample(gws[g][0], p.pid, svc.pid, model) for g, p in zip(group, clients, strict=True)}
                            if a.callgrind:
                                callgrind.control(gws[group[0]][0].pid, "--dump")
                                s1[group[0]]["instr"] = callgrind.totals(callgrind.wait_dump(dumps[group[0]], before))[0]
                                s0[group[0]]["instr"] = 0
                            for p in clients:
                                p.kill()
                                p.wait()
                            for g in group:
                                n = max(s1[g]["answered"] - s0[g]["answered"], 1)
                                run = {k: (s1[g][k] - s0[g][k]) / n for k in s0[g] if k != "answered"}
                                for k in ("gw", "client", "svc"):
                                    run[k] *= 1e6  # CPU seconds -> µs per request
                                if a.together:
                                    run["svc"] = float("nan")  # (the labels share it)
                                run["rate"] = n / a.window
                                runs.setdefault((model, mode, g), []).append(run)
                                line += (f"  {g} gw {run['gw']:6.1f} client {run['client']:6.1f} svc {run['svc']:5.1f}"
                                         f" µs/req {run['rate']:6.0f}/s {1 / max(run['hop_calls'], 1e-9):4.2f}/call")
                                if a.callgrind:
                                    line += f" {run['instr']:9.0f} instructions/req"
                        print(f"{line}  (load {os.getloadavg()[0]:.1f}; CPU tick {1e6 / tick:.0f} µs)", flush=True)
        finally:
            for gw, _ in gws.values():
                gw.stop()
            svc.stop()
    print(f"\nmedian of {a.rounds} rounds, {f'{a.rate} req/s' if a.rate else f'c{a.concurrency}'}, CPU µs per request, "
          f"{'labels driven together' if a.together else 'labels in turn'}")
    print(_table(runs, list(gws), a.models.split(","), a.modes.split(",")))


TLS_RECORD_BYTES = 22  # what one TLS 1.3 AEAD record adds: a 5-byte header, the inner content type, a 16-byte tag


def _table(runs: dict[tuple[str, str, str], list[dict[str, float]]], labels: list[str],
           models: list[str], modes: list[str]) -> str:
    """The medians as a markdown table: per cell and label the gateway's, the client's, the
    service's and all three's CPU µs per request (each against ``off``), requests per second, the
    requests per call to the service (what merging made of them: more when the gateway holds
    more requests at once), and
    the gateway's read and write calls per request, with the TLS records that its extra bytes in
    and out per request make (the bytes over ``off``'s / TLS_RECORD_BYTES; /proc/PID/io). (Not
    the client's calls: its plaintext HTTP uses sendto and recvfrom, which /proc/PID/io does not count.)
    Under --callgrind, the gateway's instructions per request too."""
    counted = "instr" in next(iter(runs.values()))[0]
    out = ["| model | protocol | label | gateway µs | client µs | service µs | all µs | req/s | requests per hop call "
           "| gateway reads / writes | TLS records in / out |" + (" gateway instructions |" if counted else ""),
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if counted else "")]
    for model in models:
        for mode in modes:
            base: dict[str, float] = {}
            for g in labels:
                rows = runs[(model, mode, g)]
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                med["all"] = med["gw"] + med["client"] + (med["svc"] if med["svc"] == med["svc"] else 0.0)
                if g == "off":
                    base = med
                cpu = [f"{med[k]:.1f}" + ("" if g == "off" or med[k] != med[k] else f" ({100 * (med[k] / base[k] - 1):+.1f}%)")
                       for k in ("gw", "client", "svc", "all")]
                records = ("–" if g == "off" else
                           f"{(med['gw_in'] - base['gw_in']) / TLS_RECORD_BYTES:.2f} / "
                           f"{(med['gw_out'] - base['gw_out']) / TLS_RECORD_BYTES:.2f}")
                out.append(f"| {model} | {mode} | {g} | " + " | ".join(cpu) + f" | {med['rate']:.0f} "
                           f"| {1 / med['hop_calls'] if med['hop_calls'] else 0:.2f} "
                           f"| {med['gw_reads']:.2f} / {med['gw_writes']:.2f} | {records} |"
                           + (f" {med['instr']:,.0f}" + ("" if g == "off" else f" ({100 * (med['instr'] / base['instr'] - 1):+.1f}%)")
                              + " |" if counted else ""))
    return "\n".join(out)


def _io(pid: int) -> dict[str, int]:
    """A process's read and write calls and bytes so far (/proc/PID/io: read, write and writev
    on sockets count, recvfrom and sendto do not)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return {k: int(fields[k]) for k in ("rchar", "wchar", "syscr", "syscw")}


def _sample(gw: procs.Server, client: int, service: int, model: str) -> dict[str, float]:
    """The counters a window's difference is taken of: requests the gateway answered, the CPU
    seconds of the gateway, the client and the service, the gateway's I/O."""
    gio = _io(gw.pid)
    answered, calls = _counts(gw, model)
    return {"answered": answered, "hop_calls": calls, "gw": procs.cpu_seconds(gw.pid), "client": procs.cpu_seconds(client),
            "svc": procs.cpu_seconds(service), "gw_reads": gio["syscr"], "gw_writes": gio["syscw"],
            "gw_in": gio["rchar"], "gw_out": gio["wchar"]}


if __name__ == "__main__":
    procs.clean_exit()
    main()
