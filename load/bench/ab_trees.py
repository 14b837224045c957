"""Throughput of two checkouts side by side: `python -m load.bench.ab_trees OLD_TREE NEW_TREE`.

Starts an ONNX service and a gateway from each tree at once (both stacks stay up, idle while
the other is measured), then alternates closed-loop add_sub cells between them (c=32, gRPC and
HTTP binary; the order flips every round), so the VM's drift hits both sides alike. Prints each
cell and, per protocol, the means and the new/old ratio of every pair. Run it on a quiet
machine; it takes about rounds x 2 protocols x 2 trees x (seconds + 2) s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from load.bench import procs

ROOT = Path(__file__).resolve().parents[2]
PROTOCOLS = ("grpc", "http-binary")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--repository", type=Path, default=Path("/tmp/bench-models/onnx_repo"),
                    help="a repository with add_sub (load.bench generates /tmp/bench-models)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    args = ap.parse_args()
    stacks: dict[str, tuple[procs.Server, procs.Server]] = {}
    results: dict[tuple[str, str], list[float]] = {(t, p): [] for t in ("old", "new") for p in PROTOCOLS}
    tmp = Path(tempfile.mkdtemp())
    out = tmp / "cell.json"
    try:
        for tag, tree in (("old", args.old), ("new", args.new)):
            procs.ROOT = tree.resolve()  # `python -m meshserve` runs that tree's code
            svc = procs.Server(["service", "onnx", "--repository", str(args.repository), "--grpc-port", "0",
                                "--http-port", "0"], tmp / f"{tag}-service.log")
            stacks[tag] = (svc, procs.Server(["gateway", "--grpc-port", "0", "--http-port", "0",
                                              "--upstream", svc.grpc], tmp / f"{tag}-gateway.log"))
        for rnd in range(args.rounds):
            for proto in PROTOCOLS:
                for tag in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
                    gw = stacks[tag][1]
                    subprocess.run([sys.executable, "-m", "load", "--http", gw.http, "--grpc", gw.grpc,
                                    "-m", "add_sub", "--protocol", proto, "-c", str(args.concurrency),
                                    "-d", str(args.seconds), "--warmup", "1", "--quiet", "--json", str(out)],
                                   cwd=ROOT, capture_output=True, check=True)
                    cell = json.loads(out.read_text())
                    results[(tag, proto)].append(cell["goodput_rps"])
                    print(f"round {rnd} {proto} {tag}: {cell['goodput_rps']:.0f}/s {cell.get('errors') or ''}",
                          flush=True)
    finally:
        for svc, gw in stacks.values():
            gw.stop()
            svc.stop()
    for proto in PROTOCOLS:
        old, new = results[("old", proto)], results[("new", proto)]
        ratios = [n / o for o, n in zip(old, new, strict=True)]
        print(f"{proto} c{args.concurrency}: old {statistics.mean(old):.0f}/s, new {statistics.mean(new):.0f}/s, "
              f"new/old {statistics.mean(ratios):.4f} (pairs {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    procs.clean_exit()
    main()
