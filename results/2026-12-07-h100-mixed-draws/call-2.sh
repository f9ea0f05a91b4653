# Session 69, call 2: single attention rows beside verify groups on the row kernel (ORYX_CUDA_SPLIT_SINGLES).
# GPU tests of the change, then 16K x 32 serving of lambda 0.4 with the split on and off, alternating, attention
# beside, and profiles of attention mode and of lambda 0.4 with the split.
source .carry/env.sh
TOTAL=${TOTAL:-330}
timeout 120 build-gpu/bin/ops_cuda_test > $OUT/gtest-ops.txt 2>&1; echo "ops rc $?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/gtest-ops.txt | tail -n 8
timeout 120 build-gpu/bin/cuda_backend_test > $OUT/gtest-backend.txt 2>&1; echo "backend rc $?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/gtest-backend.txt | tail -n 8; echo "gtest at $(el) s"
P4=learned:results/2026-12-06-h100-router-stage4-v3/router-h100-stage4-lambda0.4.safetensors
prof() {  # name, policy, env...
  local n=$1 p=$2; shift 2
  env "$@" ORYX_CUDA_PROFILE=1 timeout 60 build-gpu/bin/oryx bench serve --model models/default --device cuda --data data/c1 \
    --concurrency 32 --requests 64 --prompt-tokens 15872 --max-tokens 512 --policy $p --json > $OUT/profile-$n.jsonl 2> $OUT/profile-$n.txt
  echo "== profile $n at $(el) s"; python3 bench/profile_summary.py $OUT/profile-$n.txt > $OUT/profile-$n.summary; head -n 26 $OUT/profile-$n.summary
  xz -9 -T8 $OUT/profile-$n.txt
}
for rep in 1 2; do
  for split in 1 0; do
    POL="$P4"; [[ $split == 1 ]] && POL="attention $P4"
    [[ $(( $(el) + 60 )) -gt $TOTAL ]] && break 2
    ORYX_CUDA_SPLIT_SINGLES=$split PROMPTS=15872 POLICIES="$POL" CLIENTS=32 REPEATS=1 TIMEOUT=45 \
      bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-split$split-32.jsonl 2>> $OUT/serve.err
    echo "split=$split rep $rep at $(el) s"
  done
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/serve-*.jsonl")):
    for l in open(f):
        j = json.loads(l)
        w = j["graph_warmup_s"]
        print(os.path.basename(f), j["policy"][-28:], round(j["generated_tokens_per_s"]), "itl50 %.2f" % j["inter_token_ms_p50"],
              "step %.3f ms" % (1e3 * j["server_step_s"] / max(1, j["server_steps"])), "replayed %.3f ms" % (1e3 * (j["server_step_s"] - w) / max(1, j["server_steps"] - j["graph_warmups"])),
              "warm %.2f s" % w, "gr", j.get("graphs_recorded"))
PY
[[ $(( $(el) + 45 )) -le $TOTAL ]] && prof l04-split $P4
[[ $(( $(el) + 40 )) -le $TOTAL ]] && prof attention attention
