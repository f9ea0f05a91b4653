# Session 72, call 6: the FP8 tensor-core GEMV on by default -- the GPU tests, and 1.4b's fp8 and bf16 steps at
# 4K (batch 2, 8, 32) as a user gets them.
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
for w in fp8 bf16; do
  timeout 60 $B/oryx bench decode --device cuda --config 1.4b --weights $w --contexts 4096 --batches 2,8,32 --steps 20 \
    --prefill-max-attention 0 --json >> $OUT/decode-1.4b.jsonl 2>> $OUT/err.txt
done
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/decode-1.4b.jsonl"):
    j = json.loads(l)
    if j.get("bench") == "decode" and j.get("next_token") == "device":
        print(j["weights"], j["mode"], j["batch"], "%.3f ms" % j["decode_ms_per_step"])
PY
echo "$T1; $T2"
echo "end at $(el) s"
