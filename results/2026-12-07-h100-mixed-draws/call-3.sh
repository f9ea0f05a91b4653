# Session 69, call 3: where a routed policy's step time goes at 16K x 32: the steps' time in forwards and
# whole rounds (server_forward_s, new) against the rest, the engine thread's own (the device idle).
source .carry/env.sh
which perf py-spy 2>&1 | head -2
P4=learned:results/2026-12-06-h100-router-stage4-v3/router-h100-stage4-lambda0.4.safetensors
P1=learned:results/2026-12-06-h100-router-stage4-v3/router-h100-stage4-lambda1.safetensors
for C in 32 8; do
  PROMPTS=15872 POLICIES="attention $P4 $P1" CLIENTS=$C REPEATS=1 TIMEOUT=45 \
    bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-host-$C.jsonl 2>> $OUT/serve.err
  echo "clients $C at $(el) s"
done
tail -n 3 $OUT/serve.err
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/serve-host-*.jsonl")):
    for l in open(f):
        j = json.loads(l); n = j["server_steps"]
        print(j["concurrency"], j["policy"][-28:], round(j["generated_tokens_per_s"]), "step %.3f ms = forward %.3f + host %.3f (emit %.3f)" % (
            1e3 * j["server_step_s"] / n, 1e3 * j["server_forward_s"] / n, 1e3 * (j["server_step_s"] - j["server_forward_s"]) / n, 1e3 * j["server_emit_s"] / n),
            "rounds", j.get("rounds"), "whole", j.get("whole_round_fraction"))
PY
