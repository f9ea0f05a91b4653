# Session 71, call 2: the 8K and 4K serving grid at 32 and 64 clients with no prefix cache, and 16K again
# (a second pass), attention, adaptive speculation and the lambda-1 learned policy.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
TOTAL=${TOTAL:-300}
P1=learned:.carry/p/router-h100-stage4-lambda1.safetensors
P4=learned:.carry/p/router-h100-stage4-lambda0.4.safetensors
for prompt in 8192 4096 15872; do
  for policy in attention speculative $P1 $P4; do
    [[ $(( $(el) + 40 )) -gt $TOTAL ]] && break 2
    EXTRA=--no-prefix-cache PROMPTS=$prompt POLICIES="$policy" CLIENTS=32,64 TIMEOUT=60 \
      bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/grid-nocache-2.jsonl 2>> $OUT/serve.err
    echo "$prompt $policy at $(el) s"
  done
done
python3 - <<'PY'
import json, os
rows = {}
for l in open(os.environ["OUT"] + "/grid-nocache-2.jsonl"):
    j = json.loads(l); rows.setdefault((j["prompt_tokens"], j["concurrency"]), {})[j["policy"][-14:]] = j
for c, v in sorted(rows.items()):
    a = v.get("attention", {}).get("generated_tokens_per_s", 0)
    print(c, "  ".join("%s %.0f (%.2fx) hit %.2f" % (p, j["generated_tokens_per_s"], j["generated_tokens_per_s"] / a if a else 0, j.get("prefix_hit_rate", -1)) for p, j in v.items()))
PY
echo "end at $(el) s"
