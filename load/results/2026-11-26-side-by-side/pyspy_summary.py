"""Self and inclusive shares of a `py-spy record -f raw` profile: python3 pyspy_summary.py FILE...
(run from the repository root: it reads profiles with load/bench/profile_cells.py)"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from load.bench.profile_cells import read_profile


def summarize(path: str) -> None:
    p = read_profile(Path(path))
    print(f"== {path}: {p.samples} samples")
    print("-- self (top 15)")
    for key, n in p.own.most_common(15):
        print(f"{100 * n / p.samples:5.1f}% {key[:110]}")
    print("-- inclusive (top 25)")
    for key, n in p.inclusive.most_common(25):
        print(f"{100 * n / p.samples:5.1f}% {key[:110]}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarize(arg)
