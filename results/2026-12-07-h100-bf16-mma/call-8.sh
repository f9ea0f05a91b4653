# Session 72, call 8: FP8 weights of any size on the tensor-core GEMV past 8 rows (1.4b's up projection, 22M
# weights, was left to the FP8 tensor-core kernel) -- ops_cuda_test, the FP8 products alone by kernel at 9-32
# rows, and 1.4b's fp8 steps at 4K (batch 16 and 32; call 5 measured them before this change).
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
xz -dc .carry/bin2/bench_gemv.xz > build-gpu/bin/bench_gemv && chmod +x build-gpu/bin/bench_gemv
B=build-gpu/bin
timeout 120 $B/ops_cuda_test > $OUT/tests.txt 2>&1; echo "ops_cuda_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok"
grep -B2 -A12 "Failure" $OUT/tests.txt | head -40
timeout 60 $B/bench_gemv --config 1.4b --rows 8,9,16,24,32 > $OUT/gemm-rows.jsonl 2>> $OUT/err.txt
for rep in 1 2; do
  timeout 60 $B/oryx bench decode --device cuda --config 1.4b --weights fp8 --contexts 4096 --batches 16,32 --steps 20 \
    --prefill-max-attention 0 --json >> $OUT/decode-1.4b.jsonl 2>> $OUT/err.txt
done
python3 results/2026-12-07-h100-bf16-mma/print_products.py fp8
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for l in open(f"{out}/decode-1.4b.jsonl"):
    j = json.loads(l)
    if j.get("bench") == "decode" and j.get("next_token") == "device":
        print(j["weights"], j["mode"], j["batch"], "%.3f ms" % j["decode_ms_per_step"])
PY
