"""Prints call 10's decode steps ($OUT/decode.jsonl), on-device token, by model, weights, mode and batch, with
the SwiGLU epilogue on (fused1) and off (fused0). (Call 10 ran this inline.)"""
import json, os
t = {}
for l in open(os.environ["OUT"] + "/decode.jsonl"):
    j = json.loads(l)
    if j.get("bench") == "decode" and j.get("next_token") == "device":
        t.setdefault((j["model"], j["weights"], j["mode"], j["batch"]), {}).setdefault(j["fused"], []).append(j["decode_ms_per_step"])
for k, v in sorted(t.items()):
    print(k, "  ".join("fused%s %s" % (f, " ".join("%.3f" % x for x in xs)) for f, xs in sorted(v.items(), reverse=True)))
