"""Self and inclusive shares of a `py-spy record -f raw` profile: python3 pyspy_summary.py FILE...
(the summary is load/bench/profile_cells.py:summary)"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from load.bench.profile_cells import summary

if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summary(Path(arg)))
