"""The A/B table of ab.sh's results.jsonl: per cell, each round's infer/s (p99 ms, rows per
execution, gateway-tree CPU cores, foreign CPU cores: everything else, the ONNX service included)
for 1 and 2 workers, and the medians' ratio.
    python3 load/results/2026-11-26-s4-workers/summary.py RESULTS_DIR/results.jsonl"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    cells: dict[tuple[str, str, int], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            workers = r["label"].split("-")[0]
            cells[(r["model"], r["mode"], r["concurrency"])][workers].append(r)
    print("| model | mode | c | 1 worker: infer/s (p99 ms, rows/exec, gw cores, foreign) per round | 2 workers: same |"
          " median 2w/1w |")
    print("|---|---|---|---|---|---|")
    for (model, mode, c), by in sorted(cells.items()):
        def runs(rs: list[dict]) -> str:
            return "; ".join(f"{r['infer_per_s']:.0f} ({r['p99_us'] / 1000:.1f}, {r.get('avg_batch', 0):.1f}, "
                             f"{r.get('cpu_server_cores', 0):.2f}, "
                             f"{r.get('cpu_foreign_cores', 0):.2f})" for r in rs)
        m1 = statistics.median(r["infer_per_s"] for r in by["w1"]) if by["w1"] else 0
        m2 = statistics.median(r["infer_per_s"] for r in by["w2"]) if by["w2"] else 0
        print(f"| {model} | {mode} | {c} | {runs(by['w1'])} | {runs(by['w2'])} | {m2 / m1 if m1 else 0:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
