# Session 71, call 6: at 16K with 1 and 8 clients, attention, speculative, drafted lambda 0.4 and 1, and lambda 1.
# against the learned policies as they are and attention mode, 8K, 4K and 16K prompts, 32 and 64 clients, no
# prefix cache.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
TOTAL=${TOTAL:-420}
P1=learned:.carry/p/router-h100-stage4-lambda1.safetensors
P4=learned:.carry/p/router-h100-stage4-lambda0.4.safetensors
for prompt in 15872; do
  for policy in attention speculative drafted:$P4 drafted:$P1 $P1; do
    [[ $(( $(el) + 35 )) -gt $TOTAL ]] && break 2
    EXTRA=--no-prefix-cache PROMPTS=$prompt POLICIES="$policy" CLIENTS=1,8 TIMEOUT=60 \
      bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/drafted-8.jsonl 2>> $OUT/serve.err
    echo "$prompt $policy at $(el) s"
  done
done
grep -v "^==" $OUT/serve.err | sort | uniq -c | head
python3 - <<'PY'
import json, os
rows = {}
for l in open(os.environ["OUT"] + "/drafted-8.jsonl"):
    j = json.loads(l)
    p = j["policy"].replace("learned:.carry/p/router-h100-stage4-", "").replace(".safetensors", "")
    rows.setdefault((j["prompt_tokens"], j["concurrency"]), {})[p] = j
for c, v in sorted(rows.items()):
    a = v.get("attention", {}).get("generated_tokens_per_s", 0)
    print(c, "  ".join("%s %.0f (%.2fx) att %.2f acc %s" % (p, j["generated_tokens_per_s"], j["generated_tokens_per_s"] / a if a else 0,
          j["attention_fraction"], None if j.get("acceptance_rate") is None else round(j["acceptance_rate"], 2)) for p, j in v.items()))
PY
echo "end at $(el) s"
