"""Self and inclusive shares of a `py-spy record -f raw` profile: python3 pyspy_summary.py FILE..."""
import collections
import re
import sys


def summarize(path: str) -> None:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] += n
            seen = set()
            for frame in frames:
                where = re.search(r"\(([^)]*)\)", frame)
                key = frame.split(" (")[0] + " " + (where.group(1).split("/")[-1].split(":")[0] if where else "")
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += n
    print(f"== {path}: {total} samples")
    print("-- self (top 15)")
    for key, n in own.most_common(15):
        print(f"{100 * n / total:5.1f}% {key[:110]}")
    print("-- inclusive (top 25)")
    for key, n in inclusive.most_common(25):
        print(f"{100 * n / total:5.1f}% {key[:110]}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
