# Session 69, call 1: the whole CUDA backend test (the mixed-step draws have never run on a GPU), then 16K x 32
# serving A/B of the draw rule in one binary (ORYX_CUDA_MIXED_DRAWS=1 vs 0), alternating, then one profile.
source .carry/env.sh
TOTAL=${TOTAL:-560}
timeout 150 build-gpu/bin/cuda_backend_test > $OUT/gtest-cuda-backend.txt 2>&1; echo "gtest rc $?"
grep -E "^\[  (PASSED|FAILED)|FAILED  \]" $OUT/gtest-cuda-backend.txt | tail -n 12; echo "gtest at $(el) s"
P4=learned:results/2026-12-06-h100-router-stage4-v3/router-h100-stage4-lambda0.4.safetensors
P1=learned:results/2026-12-06-h100-router-stage4-v3/router-h100-stage4-lambda1.safetensors
for rep in 1 2; do
  for mixed in 1 0; do
    POL="$P4 $P1"; [[ $mixed == 1 ]] && POL="attention $P4 $P1"
    [[ $(( $(el) + 110 )) -gt $TOTAL ]] && break 2
    ORYX_CUDA_MIXED_DRAWS=$mixed PROMPTS=15872 POLICIES="$POL" CLIENTS=32 REPEATS=1 TIMEOUT=45 \
      bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-mixed$mixed-32.jsonl 2>> $OUT/serve.err
    echo "mixed=$mixed rep $rep at $(el) s"
  done
done
tail -n 5 $OUT/serve.err
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/serve-*.jsonl")):
    for l in open(f):
        j = json.loads(l)
        print(os.path.basename(f), j["policy"][-28:], j["concurrency"], round(j["generated_tokens_per_s"]), "itl50 %.2f" % j["inter_token_ms_p50"],
              "step %.3f ms" % (1e3 * j["server_step_s"] / max(1, j["server_steps"])), "gr", j.get("graphs_recorded"), "attn %.3f" % j["attention_fraction"],
              *(["rows/f %.1f attn/f %.1f lg/f %.2f hd/f %.2f" % tuple(j[k] / max(1, j["forwards"]) for k in ("forward_rows", "forward_attention_rows", "logit_rows_back", "host_draws"))] if "forwards" in j else []))
PY
if [[ $(( $(el) + 70 )) -le $TOTAL ]]; then
  ORYX_CUDA_PROFILE=1 timeout 60 build-gpu/bin/oryx bench serve --model models/default --device cuda --data data/c1 \
    --concurrency 32 --requests 64 --prompt-tokens 15872 --max-tokens 512 --policy $P4 --json > $OUT/profile-l04.jsonl 2> $OUT/profile-l04.txt
  echo "profile at $(el) s"; python3 bench/profile_summary.py $OUT/profile-l04.txt | head -n 45
  xz -9 -T8 $OUT/profile-l04.txt
fi
