"""Self and inclusive shares of a `py-spy record -f raw [--threads]` profile, per thread and
overall: python3 pyspy_summary.py FILE [TOP]. A frame is counted once per sample (recursion).
(the summary is load/bench/profile_cells.py:summary)"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from load.bench.profile_cells import summary

if __name__ == "__main__":
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    print(summary(Path(sys.argv[1]), top, top + 10))
