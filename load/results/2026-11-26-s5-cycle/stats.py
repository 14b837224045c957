"""Print 'rows/exec R queue_us/req Q' between two /v2/models/M/stats snapshots (JSON files)."""
import json
import sys

a, b = (json.load(open(f))["model_stats"][0] for f in sys.argv[1:3])
inf = int(b["inference_count"]) - int(a["inference_count"])
exe = int(b["execution_count"]) - int(a["execution_count"])
q = {k: int(b["inference_stats"]["queue"][k]) - int(a["inference_stats"]["queue"].get(k, 0)) for k in ("count", "ns")}
print(f"rows/exec {inf / max(exe, 1):.1f} queue_us/req {q['ns'] / max(q['count'], 1) / 1000:.0f}")
