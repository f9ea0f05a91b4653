"""Prints a call's decode steps ($OUT/decode.jsonl; on-device token), by model, weights, mode and batch: the
step's milliseconds and roofline fraction for each value of the switch field named on the command line
(the runs alternate its values), on first."""
import json, os, sys
field = sys.argv[1]
steps = {}
for line in open(os.environ["OUT"] + "/decode.jsonl"):
    j = json.loads(line)
    if j.get("bench") != "decode" or j.get("next_token") != "device":
        continue
    key = (j["model"], j["weights"], j["mode"], j["batch"])
    steps.setdefault(key, {}).setdefault(j[field], []).append((j["decode_ms_per_step"], j["roofline_fraction"]))
for key, by_value in sorted(steps.items()):
    runs = ("%s=%s %s" % (field, v, " ".join("%.3f ms (%.2f)" % r for r in rs)) for v, rs in sorted(by_value.items(), reverse=True))
    print(*key, " | ".join(runs))
