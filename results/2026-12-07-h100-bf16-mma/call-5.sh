# Session 72, call 5: FP8 weights on the tensor-core GEMV (ORYX_CUDA_FP8_GEMV_ROWS=32 against 0, the default
# still) -- the GPU tests, the products alone, and 1.4b's fp8 decode steps at 32K (batch 1, 8) and 4K (8, 16, 32)
# beside bf16, and models/default's fp8 steps at 15K (8, 32).
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
source results/2026-12-07-h100-bf16-mma/preamble.sh
for rep in 1 2; do
  for rows in 32 0; do
    ORYX_CUDA_FP8_GEMV_ROWS=$rows timeout 60 $B/oryx bench decode --device cuda --config 1.4b --weights fp8 --contexts 32768 \
      --batches 1,8 --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"fp8_gemv_rows\":$rows,/" >> $OUT/decode-1.4b.jsonl 2>> $OUT/err.txt
    ORYX_CUDA_FP8_GEMV_ROWS=$rows timeout 60 $B/oryx bench decode --device cuda --config 1.4b --weights fp8 --contexts 4096 \
      --batches 8,16,32 --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"fp8_gemv_rows\":$rows,/" >> $OUT/decode-1.4b.jsonl 2>> $OUT/err.txt
    ORYX_CUDA_FP8_GEMV_ROWS=$rows timeout 60 $B/oryx bench decode --device cuda --model models/default --weights fp8 --contexts 15360 \
      --batches 8,32 --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"fp8_gemv_rows\":$rows,/" >> $OUT/decode-default.jsonl 2>> $OUT/err.txt
  done
  [[ $rep == 1 ]] && timeout 60 $B/oryx bench decode --device cuda --config 1.4b --contexts 4096 --batches 8,16,32 --steps 20 \
    --prefill-max-attention 0 --json | sed 's/^{/{"fp8_gemv_rows":-1,/' >> $OUT/decode-1.4b.jsonl 2>> $OUT/err.txt
  echo "decode rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-bf16-mma/print_products.py
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ("decode-1.4b", "decode-default"):
    t = {}
    for l in open(f"{out}/{f}.jsonl"):
        j = json.loads(l)
        if j.get("bench") != "decode" or j.get("next_token") != "device": continue
        t.setdefault((j["context"], j["mode"], j["batch"]), {}).setdefault(j["fp8_gemv_rows"], []).append(j["decode_ms_per_step"])
    for key, v in sorted(t.items()):
        print(f, key, "  ".join("rows%s %s" % (k, " ".join("%.3f" % x for x in xs)) for k, xs in sorted(v.items())))
PY
echo "$T1; $T2"
echo "end at $(el) s"
