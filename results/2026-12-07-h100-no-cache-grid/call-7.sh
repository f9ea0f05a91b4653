# Call 7 (session 72): 9f171bd's rule (drafted: keeps the router's own length where every slot asks for one;
# 16K with 1 and 8 clients, and 8K with 32, against attention mode and lambda 1 as it is.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
TOTAL=${TOTAL:-120}
P1=learned:.carry/p/router-h100-stage4-lambda1.safetensors
P4=learned:.carry/p/router-h100-stage4-lambda0.4.safetensors
for pc in 15872:1,8 8192:32; do
  for policy in attention drafted:$P1 $P1 drafted:$P4; do
    [[ $(( $(el) + 15 )) -gt $TOTAL ]] && break 2
    EXTRA=--no-prefix-cache PROMPTS=${pc%:*} POLICIES="$policy" CLIENTS=${pc#*:} TIMEOUT=40 \
      bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/drafted-own.jsonl 2>> $OUT/serve.err
  done
  echo "$pc at $(el) s"
done
python3 - <<'PY'
import json, os
rows = {}
for l in open(os.environ["OUT"] + "/drafted-own.jsonl"):
    j = json.loads(l)
    p = j["policy"].replace("learned:.carry/p/router-h100-stage4-", "").replace(".safetensors", "")
    rows.setdefault((j["prompt_tokens"], j["concurrency"]), {})[p] = j
for c, v in sorted(rows.items()):
    a = v.get("attention", {}).get("generated_tokens_per_s", 0)
    print(c, "  ".join("%s %.0f (%.2fx) acc %s" % (p, j["generated_tokens_per_s"], j["generated_tokens_per_s"] / a if a else 0,
          None if j.get("acceptance_rate") is None else round(j["acceptance_rate"], 2)) for p, j in v.items()))
PY
echo "end at $(el) s"
