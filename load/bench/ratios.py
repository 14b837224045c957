"""The 18-cell side-by-side table of a side_by_side.sh run (issue 21's goals).

    python -m load.bench.ratios RESULTS_DIR      (side_by_side.sh prints it at the end)

Reads the JSON lines ``drive.py`` (../shared/bench) wrote per label: ``triton``,
``meshserve-gateway``, ``meshserve-direct``. For each model × protocol × concurrency: throughput of
each, gateway/Triton and gateway/direct, p99s, rows per execution (the servers' own statistics)
and the CPU that neither the server nor perf_analyzer used ("foreign", cores). A cell measured more
than once (side_by_side.sh repeats the meshserve runs that had foreign CPU above the bound) keeps
its quietest run; a cell whose runs all had more foreign CPU is marked, and its ratio is not
evidence either way.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FOREIGN_BOUND = 0.1  # cores of other work during a run before it is marked (and repeated)
LABELS = ("triton", "meshserve-gateway", "meshserve-direct")
MODELS = ("add_sub", "mlp")
MODES = ("grpc", "http", "http-json")
CONCURRENCY = (1, 8, 32)
# issue 21's goals per cell
GOAL_VS_TRITON = 1.0
GOAL_VS_DIRECT = 0.85

Key = tuple[str, str, int]


def load(res: Path, label: str) -> dict[Key, dict[str, Any]]:
    """The quietest successful run per (model, mode, concurrency) of ``label``."""
    out: dict[Key, dict[str, Any]] = {}
    path = res / f"{label}.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if not r.get("ok", "infer_per_s" in r):
            continue
        key = (r["model"], r["mode"], int(r["concurrency"]))
        old = out.get(key)
        if old is None or foreign(r) < foreign(old):
            out[key] = r
    return out


def foreign(r: dict[str, Any] | None) -> float:
    """Cores of other work during the run (NaN when unknown)."""
    if r is None or r.get("cpu_foreign_cores") is None:
        return math.nan
    return float(r["cpu_foreign_cores"])


def noisy(res: Path, label: str) -> list[Key]:
    """Cells of ``label`` whose quietest run still had foreign CPU above the bound (side_by_side.sh
    repeats them)."""
    return [k for k, r in sorted(load(res, label).items()) if foreign(r) > FOREIGN_BOUND]


def _num(r: dict[str, Any] | None, key: str) -> float:
    v = None if r is None else r.get(key)
    return float(v) if v is not None else math.nan


def _f(v: float, fmt: str) -> str:
    return "–" if math.isnan(v) else format(v, fmt)


@dataclass(frozen=True)
class Cell:
    """One model × protocol × concurrency cell: throughputs (infer/s), p99s (ms) and rows per
    execution of Triton, the gateway and the service direct, and which goals it meets."""
    key: Key
    triton: float
    gateway: float
    direct: float
    p99_ms: tuple[float, float, float]
    rows: tuple[float, float, float]
    foreign: float

    @property
    def vs_triton(self) -> float:
        return self.gateway / self.triton

    @property
    def vs_direct(self) -> float:
        return self.gateway / self.direct

    @property
    def goals(self) -> tuple[bool, bool, bool]:
        """gw/Triton ≥ 1.0, p99 gw ≤ Triton's, gw/direct ≥ 0.85."""
        return (self.vs_triton >= GOAL_VS_TRITON, self.p99_ms[1] <= self.p99_ms[0],
                self.vs_direct >= GOAL_VS_DIRECT)

    @property
    def known(self) -> bool:
        return not any(math.isnan(v) for v in (self.vs_triton, self.vs_direct, self.p99_ms[0], self.p99_ms[1]))

    @property
    def missed(self) -> list[str]:
        names = ("gw/Triton", "p99", "gw/direct")
        return [n for n, ok in zip(names, self.goals, strict=True) if not ok]


def cells(res: Path, runs: dict[str, dict[Key, dict[str, Any]]] | None = None) -> list[Cell]:
    """The 18 cells of a results directory, in table order."""
    runs = runs if runs is not None else {label: load(res, label) for label in LABELS}
    out = []
    for m in MODELS:
        for mode in MODES:
            for c in CONCURRENCY:
                t, g, d = (runs[label].get((m, mode, c)) for label in LABELS)
                tr, gr, dr = (_num(x, "infer_per_s") for x in (t, g, d))
                p99 = (_num(t, "p99_us") / 1000, _num(g, "p99_us") / 1000, _num(d, "p99_us") / 1000)
                rows = (_num(t, "avg_batch"), _num(g, "avg_batch"), _num(d, "avg_batch"))
                fg = max((foreign(x) for x in (t, g, d) if not math.isnan(foreign(x))), default=math.nan)
                out.append(Cell((m, mode, c), tr, gr, dr, p99, rows, fg))
    return out


def table(res: Path) -> str:
    runs = {label: load(res, label) for label in LABELS}
    lines = [
        f"Side by side: {res}",
        f"gw = meshserve through the gateway, direct = to the ONNX service; goals: gw/Triton ≥ {GOAL_VS_TRITON}, "
        f"p99 gw ≤ Triton, gw/direct ≥ {GOAL_VS_DIRECT}; rows/exec = inference_count / execution_count; "
        f"foreign = the most CPU (cores) other work used in the cell's three runs; ⚠ above {FOREIGN_BOUND}.",
        "",
        "| model | protocol | c | Triton /s | gw /s | direct /s | gw/Triton | gw/direct | p99 ms Triton / gw / direct "
        "| rows/exec Triton / gw / direct | foreign | goals met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    met = total = 0
    for cell in cells(res, runs):
        m, mode, c = cell.key
        total += 1
        met += cell.known and all(cell.goals)
        verdict = f"{sum(cell.goals)}/3" if cell.known else "–"
        mark = " ⚠" if cell.foreign > FOREIGN_BOUND else ""
        lines.append(
            f"| {m} | {mode} | {c} | {_f(cell.triton, '.0f')} | {_f(cell.gateway, '.0f')} | {_f(cell.direct, '.0f')} | "
            f"{_f(cell.vs_triton, '.2f')} | {_f(cell.vs_direct, '.2f')} | {' / '.join(_f(p, '.1f') for p in cell.p99_ms)} | "
            f"{' / '.join(_f(r, '.1f') for r in cell.rows)} | {_f(cell.foreign, '.2f')}{mark} | {verdict} |")
    lines.append("")
    lines.append(f"cells meeting all three goals: {met} of {total}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--noisy":  # side_by_side.sh: the cells to measure again
        res = Path(args[1])
        for label in LABELS[1:]:
            for m, mode, c in noisy(res, label):
                print(label, m, mode, c)
        return
    if len(args) != 1:
        raise SystemExit("usage: python -m load.bench.ratios RESULTS_DIR  (or --noisy RESULTS_DIR)")
    print(table(Path(args[0])))


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
