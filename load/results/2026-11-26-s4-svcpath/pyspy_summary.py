"""Self and inclusive shares of a `py-spy record -f raw [--threads]` profile, per thread and
overall: python3 pyspy_summary.py FILE [TOP]. A frame is counted once per sample (recursion)."""
import re
import sys
from collections import Counter

_LINE = re.compile(r"\s*\(.*?:\d+\)$")


def frame(f: str) -> str:
    """'name (file.py:123)' -> 'name (file.py)': lines of one function add up."""
    return re.sub(r":\d+\)$", ")", f)


def summarize(path: str, top: int) -> None:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith("thread") else "-"
        frames = [frame(f) for f in frames if not f.startswith(("thread", "process"))]
        total += n
        threads[thread] += n
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    print(f"== {path}: {total} samples")
    for t, n in threads.most_common():
        print(f"{100 * n / total:5.1f}% {t}")
    print("-- self")
    for key, n in own.most_common(top):
        print(f"{100 * n / total:5.1f}% {key[:120]}")
    print("-- inclusive")
    for key, n in inclusive.most_common(top + 10):
        print(f"{100 * n / total:5.1f}% {key[:120]}")


if __name__ == "__main__":
    summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)
