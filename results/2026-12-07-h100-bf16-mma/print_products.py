"""Prints bench_gemv --rows's JSON ($OUT/gemm-rows.jsonl) as one line per product and row count, µs per
path; with an argument, only the paths of that weight format. (Calls 5 and 8 ran this inline.)"""
import json
import os
import sys

weights = sys.argv[1] if len(sys.argv) > 1 else None
rows = {}
for line in open(os.environ["OUT"] + "/gemm-rows.jsonl"):
    j = json.loads(line)
    if weights is None or j["weights"] == weights:
        rows.setdefault((j["op"], j["rows"]), {})[j["path"]] = j["us_per_call"]
for (op, m), v in rows.items():
    print("%-8s %2d  " % (op, m) + "  ".join("%s %.2f" % (p, u) for p, u in v.items()))
