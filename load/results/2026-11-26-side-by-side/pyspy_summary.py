import sys, collections, re
for f in sys.argv[1:]:
    self_c = collections.Counter(); incl = collections.Counter(); total = 0
    for line in open(f):
        line = line.rstrip()
        if not line: continue
        stack, _, n = line.rpartition(" ")
        n = int(n); total += n
        frames = stack.split(";")
        leaf = re.sub(r" \(/.*?/(?=[^/]+/[^/]+\.py)", " (", frames[-1])
        self_c[leaf] += n
        seen = set()
        for fr in frames:
            name = fr.split(" (")[0]
            fn = re.search(r"\(([^)]*)\)", fr)
            key = name + " " + (fn.group(1).split("/")[-1].split(":")[0] if fn else "")
            if key not in seen:
                seen.add(key); incl[key] += n
    print(f"== {f}: {total} samples")
    print("-- self (top 15)")
    for k, v in self_c.most_common(15): print(f"{100*v/total:5.1f}% {k[:110]}")
    print("-- inclusive (top 25)")
    for k, v in incl.most_common(25): print(f"{100*v/total:5.1f}% {k[:110]}")
