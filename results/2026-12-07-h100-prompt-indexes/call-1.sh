# Session 69, call 5: prompts indexed side by side and kept for their first decision (0a0ffd9) against its
# base (1118f55: the host-time counters alone), 16K x 32, attention and the two stage-4 policies, alternating.
source .carry/env.sh
TOTAL=${TOTAL:-200}
xz -dc .carry/bin2/oryx-base.xz > build-gpu/bin/oryx-base && chmod +x build-gpu/bin/oryx-base
P4=learned:.carry/p/router-h100-stage4-lambda0.4.safetensors
P1=learned:.carry/p/router-h100-stage4-lambda1.safetensors
for rep in 1 2; do
  for tree in new base; do
    O=build-gpu/bin/oryx; [[ $tree == base ]] && O=build-gpu/bin/oryx-base
    [[ $(( $(el) + 35 )) -gt $TOTAL ]] && break 2
    PROMPTS=15872 POLICIES="attention $P4 $P1" CLIENTS=32 REPEATS=1 TIMEOUT=45 \
      bench/serve_grid.sh $O models/default data/c1 $OUT/serve-$tree-32.jsonl 2>> $OUT/serve.err
    echo "$tree rep $rep at $(el) s"
  done
done
if [[ $(( $(el) + 60 )) -lt $TOTAL ]]; then
  PROMPTS=15872 POLICIES="attention $P4 $P1" CLIENTS=8 REPEATS=1 TIMEOUT=45 \
    bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-new8-8.jsonl 2>> $OUT/serve.err
  echo "new 8 clients at $(el) s"
fi
tail -n 2 $OUT/serve.err
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/serve-*.jsonl")):
    for l in open(f):
        j = json.loads(l); n = j["server_steps"]; h = j["server_host_s"]
        print(os.path.basename(f)[6:10], j["policy"][-14:], round(j["generated_tokens_per_s"]), "ttft50 %.0f" % j["ttft_ms"]["p50"], "step %.3f = fwd %.3f + host %.3f:" % (
            1e3 * j["server_step_s"] / n, 1e3 * j["server_forward_s"] / n, 1e3 * (j["server_step_s"] - j["server_forward_s"]) / n),
            " ".join("%s %.3f" % (k, 1e3 * v / n) for k, v in h.items()))
PY
