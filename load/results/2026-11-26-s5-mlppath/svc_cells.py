"""The ONNX service direct (optionally a gateway in front) on variants of the bench repo: per cell,
rows/exec, CPU per request (service, gateway), and from the service's batch statistics the mean
compute_input / compute_infer / compute_output per execution (ms) and the mean queue time.

    python3 svc_cells.py VARIANT_REPO[,VARIANT_REPO...] [--cells grpc:32,http:8] [--gateway]
"""
import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from load.bench import procs
from load.bench.hop_batches import perf_analyzer

DATA = Path("/tmp/bench-models/perf_data/mlp.json")


def stats(http: str) -> dict:
    with urllib.request.urlopen(f"http://{http}/v2/models/mlp/stats", timeout=10) as r:
        return json.load(r)["model_stats"][0]


def totals(s: dict) -> dict:
    out = {"inf": int(s["inference_count"]), "exe": int(s["execution_count"]),
           "queue_ns": int(s["inference_stats"]["queue"]["ns"]), "queue_n": int(s["inference_stats"]["queue"]["count"])}
    for k in ("compute_input", "compute_infer", "compute_output"):
        out[k] = sum(int(b[k]["ns"]) for b in s.get("batch_stats", []))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("repos")
    ap.add_argument("--cells", default="grpc:32,http:32,grpc:8,http:8")
    ap.add_argument("--gateway", action="store_true")
    ap.add_argument("--interval", type=int, default=2000)
    ap.add_argument("--gateway-arg", action="append", default=[])
    a = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="mlppath-"))
    print("| repo | target | cell | rows/exec | infer/s | p99 ms | svc CPU us/req | gw CPU us/req | "
          "input ms/exec | infer ms/exec | output ms/exec | queue us/req |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for repo in a.repos.split(","):
        svc = procs.service(Path(repo), logs / "svc.log")
        gw = procs.gateway([svc.grpc], logs / "gw.log", a.gateway_arg) if a.gateway else None
        try:
            for cell in a.cells.split(","):
                proto, conc = cell.split(":")
                tgt = gw or svc
                url = tgt.grpc if proto == "grpc" else tgt.http
                s0 = totals(stats(svc.http))
                c0 = procs.proc_tree_cpu_s(svc.pid), procs.proc_tree_cpu_s(gw.pid) if gw else 0.0
                res = perf_analyzer(url, "mlp", proto, int(conc), a.interval, DATA, logs / f"{cell}.csv".replace(":", "-"))
                s1 = totals(stats(svc.http))
                c1 = procs.proc_tree_cpu_s(svc.pid), procs.proc_tree_cpu_s(gw.pid) if gw else 0.0
                d = {k: s1[k] - s0[k] for k in s0}
                n, e = max(1, d["inf"]), max(1, d["exe"])
                thr = f"{res[0]:.0f} | {res[1]:.2f}" if isinstance(res, tuple) else f"FAILED {res} | -"
                print(f"| {Path(repo).name} | {'gateway' if gw else 'direct'} | {proto} c{conc} | {n / e:.2f} | {thr} | "
                      f"{1e6 * (c1[0] - c0[0]) / n:.0f} | {1e6 * (c1[1] - c0[1]) / n:.0f} | "
                      f"{d['compute_input'] / e / 1e6:.3f} | {d['compute_infer'] / e / 1e6:.3f} | "
                      f"{d['compute_output'] / e / 1e6:.3f} | {d['queue_ns'] / max(1, d['queue_n']) / 1e3:.0f} |",
                      flush=True)
        finally:
            if gw:
                gw.stop()
            svc.stop()


if __name__ == "__main__":
    main()
