"""Headline ratios of a side_by_side.sh run (issue #2's performance targets).

    python load/bench/ratios.py RESULTS_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(res: Path, label: str) -> dict[tuple[str, str, int], dict]:
    out = {}
    path = res / f"{label}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[(r["model"], r["mode"], int(r["concurrency"]))] = r
    return out


def main() -> None:
    res = Path(sys.argv[1])
    tri, gw, direct = load(res, "triton"), load(res, "meshserve-gateway"), load(res, "meshserve-direct")

    def cell(d: dict, m: str, mode: str, c: int, key: str = "infer_per_s") -> float:
        r = d.get((m, mode, c))
        return float(r[key]) if r and r.get(key) is not None else float("nan")

    checks = [
        ("add_sub through gateway vs Triton (gRPC c32)", cell(gw, "add_sub", "grpc", 32) / cell(tri, "add_sub", "grpc", 32), 0.7),
        ("mlp through gateway vs Triton (gRPC c32)", cell(gw, "mlp", "grpc", 32) / cell(tri, "mlp", "grpc", 32), 0.9),
        ("add_sub gateway vs direct-to-service (gRPC c32)", cell(gw, "add_sub", "grpc", 32) / cell(direct, "add_sub", "grpc", 32), 0.7),
    ]
    print("| target | measured | required | met |\n|---|---|---|---|")
    for name, value, want in checks:
        print(f"| {name} | {value:.2f}× | ≥ {want}× | {'yes' if value >= want else 'no'} |")
    for m in ("add_sub", "mlp"):
        ratio = cell(gw, m, "grpc", 32, "p99_us") / cell(tri, m, "grpc", 32, "p99_us")
        print(f"| {m} p99 through gateway vs Triton (gRPC c32) | {ratio:.2f}× | ≤ 1.5× | {'yes' if ratio <= 1.5 else 'no'} |")
    print("\n| model | mode | conc | Triton /s | gateway /s | direct /s | gw/Triton | gw/direct | p99 ms Triton / gw / direct |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in ("add_sub", "mlp"):
        for mode in ("grpc", "http", "http-json"):
            for c in (1, 8, 32):
                t, g, d = cell(tri, m, mode, c), cell(gw, m, mode, c), cell(direct, m, mode, c)
                p = [cell(x, m, mode, c, "p99_us") / 1000 for x in (tri, gw, direct)]
                print(f"| {m} | {mode} | {c} | {t:.0f} | {g:.0f} | {d:.0f} | {g / t:.2f} | {g / d:.2f} | "
                      f"{p[0]:.1f} / {p[1]:.1f} / {p[2]:.1f} |")


if __name__ == "__main__":
    main()
