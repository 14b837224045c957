"""Self and inclusive shares of ``py-spy record -f raw`` profiles (with or without ``--threads``).

    python -m load.bench.pyspy_summary FILE... [--top 15] [--inclusive 25]

Per file: its samples, each thread's share where it has several, the top frames by own samples
and by inclusive samples (a frame counted once per stack, so recursion does not inflate it).
The reading is ``load/bench/profile_cells.py:summary`` (which the side-by-side's profiling pass
uses too); profiles come from ``python -m load.bench.per_request pyspy`` or
``PROFILE=1 load/bench/side_by_side.sh``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from load.bench.profile_cells import summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m load.bench.pyspy_summary", description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15, help="frames by own samples")
    ap.add_argument("--inclusive", type=int, default=25, help="frames by inclusive samples")
    a = ap.parse_args(argv)
    for f in a.files:
        if not f.is_file():
            raise SystemExit(f"no such profile: {f}")
        print(summary(f, a.top, a.inclusive))


if __name__ == "__main__":
    from load.bench.procs import clean_exit

    clean_exit()
    main()
