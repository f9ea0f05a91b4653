# Session 71, call 1: f02760a's prefix cache on the GPU (cuda_backend_test at .carry/rev), the 16K serving
# grid at 32 and 64 clients with no prefix cache (every prompt computed), and the low-load A/B of session 70's
# call 3 (this tree against b43cb50, alternating, no prefix cache so that both trees compute every prompt).
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
TOTAL=${TOTAL:-540}
timeout 150 build-gpu/bin/cuda_backend_test > $OUT/cuda_backend_test.txt 2>&1
echo "cuda_backend_test rc $? at $(el) s"; grep -E "PASSED|FAILED|tests ran" $OUT/cuda_backend_test.txt | tail -4
P4=learned:.carry/p/router-h100-stage4-lambda0.4.safetensors
P1=learned:.carry/p/router-h100-stage4-lambda1.safetensors
for policy in attention speculative $P1 $P4; do
  [[ $(( $(el) + 200 )) -gt $TOTAL ]] && break
  EXTRA=--no-prefix-cache PROMPTS=15872 POLICIES="$policy" CLIENTS=32,64 TIMEOUT=110 \
    bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/grid-nocache.jsonl 2>> $OUT/serve.err
  echo "16K $policy at $(el) s"
done
xz -dc .carry/bin2/oryx-old.xz > build-gpu/bin/oryx-old && chmod +x build-gpu/bin/oryx-old
for rep in 1 2; do
  for tree in new old; do
    O=build-gpu/bin/oryx; [[ $tree == old ]] && O=build-gpu/bin/oryx-old
    [[ $(( $(el) + 30 )) -gt $TOTAL ]] && break 2
    for pc in 8192:1 4096:8; do
      ORYX_GIT_REVISION=$tree EXTRA=--no-prefix-cache PROMPTS=${pc%:*} CLIENTS=${pc#*:} POLICIES=speculative TIMEOUT=40 \
        bench/serve_grid.sh $O models/default data/c1 $OUT/spec-low.jsonl 2>> $OUT/serve.err
    done
    echo "$tree rep $rep at $(el) s"
  done
done
grep -i "warn\|error\|exit" $OUT/serve.err | sort | uniq -c | head
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
if os.path.exists(out + "/grid-nocache.jsonl"):
    rows = {}
    for l in open(out + "/grid-nocache.jsonl"):
        j = json.loads(l); rows.setdefault(j["concurrency"], {})[j["policy"][-14:]] = j
    for c, v in sorted(rows.items()):
        a = v.get("attention", {}).get("generated_tokens_per_s", 0)
        print(c, "  ".join("%s %.0f (%.2fx) hit %.2f ttft %.0f" % (p, j["generated_tokens_per_s"], j["generated_tokens_per_s"] / a if a else 0,
              j.get("prefix_hit_rate", -1), j["ttft_ms"]["p50"]) for p, j in v.items()))
if os.path.exists(out + "/spec-low.jsonl"):
    for l in open(out + "/spec-low.jsonl"):
        j = json.loads(l)
        print(j["git"], j["prompt_tokens"], j["concurrency"], round(j["generated_tokens_per_s"]), round(j.get("acceptance_rate", 0), 3), j.get("rounds_by_length"))
PY
echo "end at $(el) s"
