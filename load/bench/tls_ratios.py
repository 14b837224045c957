"""The 18-cell side by side with TLS on against TLS off (load/bench/tls_side_by_side.sh): per
model × protocol × concurrency, the throughput and the CPU per inference of `meshserve up` with
plaintext (label ``tls-off``) and with TLS on the gateway's front door and mutual TLS on the hop
(label ``tls-on``), and what TLS costs.

    python -m load.bench.tls_ratios RESULTS_DIR

CPU per inference is the whole `meshserve up` tree's (gateway + service) over the run, from
drive.py's ``cpu_server_cores`` / ``infer_per_s``. A cell keeps its quietest run of each label
(the least foreign CPU, load/bench/ratios.py's rule); ``foreign`` is the larger of the two runs'.
The goal (issue 34): TLS costs under 15% at c32 (throughput and CPU per inference).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from load.bench.ratios import CONCURRENCY, MODELS, MODES, _f, _num, foreign, load

LABELS = ("tls-off", "tls-on")
GOAL_C32 = 0.15  # TLS's cost at c32, at most


def cost(off: float, on: float, higher_is_better: bool) -> float:
    """TLS's cost as a fraction of the plaintext figure (positive: TLS is worse)."""
    if math.isnan(off) or math.isnan(on) or off <= 0:
        return math.nan
    return (off - on) / off if higher_is_better else (on - off) / off


def table(res: Path) -> str:
    runs = {label: load(res, label) for label in LABELS}
    lines = ["| model | protocol | c | infer/s off | infer/s TLS | throughput cost | CPU µs/inf off | "
             "CPU µs/inf TLS | CPU cost | p99 ms off / TLS | foreign cores | c32 goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        for mode in MODES:
            for c in CONCURRENCY:
                off, on = (runs[label].get((model, mode, c)) for label in LABELS)
                if off is None and on is None:
                    continue
                tput = (_num(off, "infer_per_s"), _num(on, "infer_per_s"))
                cpu = tuple(_num(r, "cpu_server_cores") / _num(r, "infer_per_s") * 1e6 for r in (off, on))
                t_cost, c_cost = cost(*tput, True), cost(cpu[0], cpu[1], False)
                verdict = ""
                if c == 32:
                    worst = max(v for v in (t_cost, c_cost) if not math.isnan(v)) if not (
                        math.isnan(t_cost) and math.isnan(c_cost)) else math.nan
                    verdict = "–" if math.isnan(worst) else ("met" if worst < GOAL_C32 else "MISSED")
                p99 = "/".join(_f(_num(r, "p99_us") / 1e3, ".2f") for r in (off, on))
                lines.append(f"| {model} | {mode} | {c} | {_f(tput[0], '.0f')} | {_f(tput[1], '.0f')} | "
                             f"{_f(100 * t_cost, '+.1f')}% | {_f(cpu[0], '.0f')} | {_f(cpu[1], '.0f')} | "
                             f"{_f(100 * c_cost, '+.1f')}% | {p99} | "
                             f"{_f(max(foreign(off), foreign(on)), '.2f')} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m load.bench.tls_ratios RESULTS_DIR")
    print(table(Path(args[0])))


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
