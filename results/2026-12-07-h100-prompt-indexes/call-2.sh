# Session 70, call 2: the serving grid on the final tree (.carry/rev): 16K, 8K, 4K prompts x 1/8/32/64 clients,
# attention, adaptive speculation and the two stage-4 learned policies, real text, 512 tokens a request.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)  # the binary's tree (the copy's own git is not it)
TOTAL=${TOTAL:-400}
P4=learned:.carry/p/router-h100-stage4-lambda0.4.safetensors
P1=learned:.carry/p/router-h100-stage4-lambda1.safetensors
for prompt in 15872 8192 4096; do
  for policy in attention speculative $P1 $P4; do
    [[ $(( $(el) + 60 )) -gt $TOTAL ]] && break 2
    PROMPTS=$prompt POLICIES="$policy" CLIENTS=1,8,32,64 TIMEOUT=100 \
      bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-grid.jsonl 2>> $OUT/serve.err
    echo "$prompt $policy at $(el) s"
  done
done
tail -n 3 $OUT/serve.err
python3 - <<'PY'
import json, os, collections
rows = collections.defaultdict(dict)
for l in open(os.environ["OUT"] + "/serve-grid.jsonl"):
    j = json.loads(l)
    n = j["server_steps"]
    rows[(j["prompt_tokens"], j["concurrency"])][j["policy"][-14:]] = (j["generated_tokens_per_s"], j["ttft_ms"]["p50"],
        1e3 * j["server_host_s"]["start_prefill"] / n, 1e3 * (j["server_step_s"] - j["server_forward_s"]) / n)
for k, v in sorted(rows.items()):
    a = v.get("attention", (0,))[0]
    print(k, "  ".join("%s %.0f (%.2fx) ttft %.0f sp %.3f host %.3f" % (p, t, t / a if a else 0, f, sp, h) for p, (t, f, sp, h) in v.items()))
PY
