"""Markdown report (+ PNG plots when matplotlib is installed) from one or more results dicts."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(v: Any, nd: int = 2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def results_table(results: list[dict[str, Any]]) -> str:
    head = ("| scenario | mode | conc / rate | throughput /s | goodput /s | p50 ms | p90 ms | p99 ms | max ms | "
            "errors | rows/exec | client cores |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for r in results:
        sc, lat = r["scenario"], r["latency_ms"]
        load = sc["concurrency"] if sc["mode"] == "closed" else f"{sc['rate']}/s"
        rpe = ", ".join(f"{_f(s['rows_per_execution'])}" for s in r["server_stats"].values()) or "-"
        rows.append(f"| {sc['name']} | {sc['mode']} | {load} | {_f(r['throughput_rps'], 1)} | "
                    f"{_f(r['goodput_rps'], 1)} | {_f(lat['p50'])} | {_f(lat['p90'])} | {_f(lat['p99'])} | "
                    f"{_f(lat['max'])} | {r['failed']} | {rpe} | {_f(r['client_cpu']['cores'])} |")
    return "\n".join(rows)


def _label(r: dict[str, Any]) -> str:
    sc = r["scenario"]
    return f"{sc['name']} " + (f"c{sc['concurrency']}" if sc["mode"] == "closed" else f"{sc['rate']:g}/s")


def _plots(results: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        tl = [b for b in r["timeline"] if b["p50_ms"] is not None]
        ax.plot([b["t"] for b in tl], [b["p50_ms"] for b in tl], label=f"{_label(r)} p50")
        ax.plot([b["t"] for b in tl], [b["p99_ms"] for b in tl], "--", label=f"{_label(r)} p99")
    ax.set(xlabel="send time (s since start; warm-up first)", ylabel="latency (ms)", title="Latency over time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_over_time.png", dpi=100)
    made.append("latency_over_time.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["cdf_ms"]:
            ax.plot([p[0] for p in r["cdf_ms"]], [p[1] for p in r["cdf_ms"]], label=_label(r))
    ax.set(xlabel="latency (ms)", ylabel="fraction of successes", title="Latency CDF", xscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=100)
    made.append("latency_cdf.png")
    plt.close(fig)

    closed = sorted((r for r in results if r["scenario"]["mode"] == "closed"),
                    key=lambda r: r["scenario"]["concurrency"])
    if len({r["scenario"]["concurrency"] for r in closed}) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        c = [r["scenario"]["concurrency"] for r in closed]
        ax.plot(c, [r["goodput_rps"] for r in closed], "o-", label="goodput /s")
        ax2 = ax.twinx()
        ax2.plot(c, [r["latency_ms"]["p99"] for r in closed], "s--", color="tab:red", label="p99 ms")
        ax.set(xlabel="concurrency", ylabel="goodput (req/s)", title="Throughput vs concurrency", xscale="log")
        ax2.set_ylabel("p99 (ms)")
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_concurrency.png", dpi=100)
        made.append("throughput_vs_concurrency.png")
        plt.close(fig)

    errs: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errs[k] = errs.get(k, 0) + v
    if errs:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.barh(list(errs), list(errs.values()))
        ax.set(xlabel="failed requests", title="Errors by status")
        fig.tight_layout()
        fig.savefig(out / "errors.png", dpi=100)
        made.append("errors.png")
        plt.close(fig)
    return made


def write_report(results: list[dict[str, Any]], out: Path, title: str = "Load report") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pngs = _plots(results, out)
    lines = [f"# {title}", "", results_table(results), ""]
    for r in results:
        if r["errors"]:
            lines.append(f"Errors in {r['scenario']['name']}: "
                         + ", ".join(f"{k} × {v}" for k, v in sorted(r["errors"].items())))
    lines += ["", *(f"![{p}]({p})" for p in pngs)]
    if not pngs:
        lines.append("(no plots: install matplotlib, `pip install -e .[load]`)")
    lines += ["", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in results[0]["definitions"].items()] if results else []
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    """`python -m load.report OUT_DIR RESULT.json...`: one report over several runs (e.g. a concurrency sweep)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m load.report", description=main.__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("results", type=Path, nargs="+")
    a = ap.parse_args(argv)
    print(write_report([json.loads(p.read_text()) for p in a.results], a.out))


if __name__ == "__main__":
    main()
