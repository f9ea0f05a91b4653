# Session 72, call 2: the bf16 tensor-core GEMV (2-32 rows) -- its tests, the products alone by path, and the
# 1.4b decode step at 32K (batch 1 and 8) and models/default's at 16K with it on (ORYX_CUDA_BF16_MMA_ROWS=32,
# the default) and off (0), alternating.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
xz -dc .carry/bin2/bench_gemv.xz > build-gpu/bin/bench_gemv && chmod +x build-gpu/bin/bench_gemv
B=build-gpu/bin
timeout 120 $B/ops_cuda_test > $OUT/ops_cuda_test.txt 2>&1; echo "ops_cuda_test rc $?: $(grep -c '^\[       OK' $OUT/ops_cuda_test.txt) ok"; grep -A8 "FAILED\|Failure" $OUT/ops_cuda_test.txt | head -30
timeout 150 $B/cuda_backend_test > $OUT/cuda_backend_test.txt 2>&1; echo "cuda_backend_test rc $?: $(grep -c '^\[       OK' $OUT/cuda_backend_test.txt) ok"; grep -A8 "FAILED\|Failure" $OUT/cuda_backend_test.txt | head -30
echo "tests done at $(el) s"
timeout 90 $B/bench_gemv --config 1.4b --rows 2,4,8,16,24,32 > $OUT/gemm-rows.jsonl 2> $OUT/gemm-rows.err
python3 - <<'PY'
import json, os
rows = {}
for l in open(os.environ["OUT"] + "/gemm-rows.jsonl"):
    j = json.loads(l)
    rows.setdefault((j["op"], j["rows"]), {})[j["path"]] = j
for (op, m), v in rows.items():
    print("%-8s %2d  " % (op, m) + "  ".join("%s %.2f us %.0f GB/s" % (p, j["us_per_call"], j["gb_per_s"]) for p, j in v.items()))
PY
echo "gemv done at $(el) s"
for rep in 1 2; do
  for mma in 32 0; do
    ORYX_CUDA_BF16_MMA_ROWS=$mma timeout 90 $B/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches 1,8 \
      --steps 20 --prefill-max-attention 0 --json >> $OUT/decode-1.4b-mma$mma.jsonl 2>> $OUT/decode.err
  done
  echo "1.4b rep $rep at $(el) s"
done
for mma in 32 0; do
  ORYX_CUDA_BF16_MMA_ROWS=$mma timeout 60 $B/oryx bench decode --device cuda --model models/default --contexts 16384 \
    --batches 8,32 --steps 20 --spec-k 4 --prefill-max-attention 0 --json >> $OUT/decode-default-mma$mma.jsonl 2>> $OUT/decode.err
done
python3 - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/decode-*.jsonl")):
    for l in open(f):
        j = json.loads(l)
        if j.get("bench") not in ("decode", "speculative"): continue
        print(os.path.basename(f), j["bench"], j.get("mode"), "ctx", j["context"], "b", j["batch"], "k", j.get("k"),
              "ms %.3f" % j.get("decode_ms_per_step", j.get("round_ms", 0)), "roof %.3f" % j.get("roofline_fraction", 0))
PY
echo "end at $(el) s"
