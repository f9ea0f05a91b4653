# Session 72, call 4: the bf16 tensor-core GEMV as it is kept -- the GPU tests; the products alone by path; the
# 1.4b decode step at 32K (batch 1, 8, 16, 32) and models/default's at 15K (8, 32, 64), and served points at 4K-16K,
# with it on (ORYX_CUDA_BF16_MMA_ROWS=32, the default) and off (0), alternating.
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
source results/2026-12-07-h100-bf16-mma/preamble.sh
for rep in 1 2; do
  for mma in 32 0; do
    ORYX_CUDA_BF16_MMA_ROWS=$mma timeout 100 $B/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches 1,8,16,32 \
      --steps 20 --prefill-max-attention 0 --json >> $OUT/decode-1.4b-mma$mma.jsonl 2>> $OUT/err.txt
    ORYX_CUDA_BF16_MMA_ROWS=$mma timeout 60 $B/oryx bench decode --device cuda --model models/default --contexts 15360 \
      --batches 8,32,64 --steps 20 --prefill-max-attention 0 --json >> $OUT/decode-default-mma$mma.jsonl 2>> $OUT/err.txt
  done
  echo "decode rep $rep at $(el) s"
done
for pc in 15872:64 8192:32 4096:8; do
  for mma in 32 0; do
    ORYX_CUDA_BF16_MMA_ROWS=$mma EXTRA=--no-prefix-cache PROMPTS=${pc%:*} POLICIES="attention speculative" CLIENTS=${pc#*:} TIMEOUT=40 \
      bench/serve_grid.sh $B/oryx models/default data/c1 $OUT/serve-mma$mma.jsonl 2>> $OUT/err.txt
  done
  echo "serve $pc at $(el) s"
done
python3 - <<'PY'
import json, os, glob, statistics as st
out = os.environ["OUT"]
for f in ("decode-1.4b", "decode-default"):
    t = {}
    for mma in ("32", "0"):
        for l in open(f"{out}/{f}-mma{mma}.jsonl"):
            j = json.loads(l)
            if j.get("bench") != "decode" or j.get("next_token") != "device": continue
            t.setdefault((j["mode"], j["batch"]), {}).setdefault(mma, []).append((j["decode_ms_per_step"], j["roofline_fraction"]))
    for (mode, b), v in sorted(t.items()):
        print(f, mode, b, "  ".join("mma%s %s" % (k, " ".join("%.3f ms (%.3f)" % x for x in xs)) for k, xs in v.items()))
for mma in ("32", "0"):
    for l in open(f"{out}/serve-mma{mma}.jsonl"):
        j = json.loads(l)
        print("serve mma%s" % mma, j["prompt_tokens"], j["concurrency"], j["policy"], "%.0f tok/s" % j["generated_tokens_per_s"])
PY
echo "$T1; $T2"
echo "end at $(el) s"
