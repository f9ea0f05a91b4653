# Session 72, call 3: the bf16 tensor-core GEMV -- ops_cuda_test; the products alone at 2-32 rows with one or two
# weight tiles a block past 8 rows (ORYX_BF16_MMA_TILES_W, a temporary knob); models/default's decode steps and
# rounds at 15K (batch 8 and 32) and the served 16K x 32 grid point, with it on (32 rows) and off (0).
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
xz -dc .carry/bin2/bench_gemv.xz > build-gpu/bin/bench_gemv && chmod +x build-gpu/bin/bench_gemv
B=build-gpu/bin
timeout 120 $B/ops_cuda_test > $OUT/tests.txt 2>&1; T1="ops_cuda_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok"
grep -B2 -A12 "Failure" $OUT/tests.txt | head -40
echo "$T1 at $(el) s"
for tw in 1 2; do
  ORYX_BF16_MMA_TILES_W=$tw timeout 90 $B/bench_gemv --config 1.4b --rows 2,3,8,9,16,24,32 | sed "s/^{/{\"tiles_w\":$tw,/" >> $OUT/gemm-rows.jsonl 2>> $OUT/err.txt
done
python3 - <<'PY'
import json, os
rows = {}
for l in open(os.environ["OUT"] + "/gemm-rows.jsonl"):
    j = json.loads(l)
    p = j["path"] + ("/w%d" % j["tiles_w"] if j["path"] in ("bf16-mma",) else "")
    if j["tiles_w"] == 2 and p in ("fp8", "bf16", "bf16-multirow", "bf16-cublas"): continue
    rows.setdefault((j["op"], j["rows"]), {})[p] = j["us_per_call"]
for (op, m), v in rows.items():
    print("%-8s %2d  " % (op, m) + "  ".join("%s %.2f" % (p, u) for p, u in v.items()))
PY
echo "gemv done at $(el) s"
for mma in 32 0; do
  ORYX_CUDA_BF16_MMA_ROWS=$mma timeout 60 $B/oryx bench decode --device cuda --model models/default --contexts 15360 \
    --batches 8,32 --steps 20 --spec-k 4 --prefill-max-attention 0 --json >> $OUT/decode-default-mma$mma.jsonl 2>> $OUT/err.txt
done
echo "default decode done at $(el) s"
for rep in 1 2; do
  for mma in 32 0; do
    ORYX_CUDA_BF16_MMA_ROWS=$mma EXTRA=--no-prefix-cache PROMPTS=15872 POLICIES="attention speculative" CLIENTS=32 TIMEOUT=40 \
      bench/serve_grid.sh $B/oryx models/default data/c1 $OUT/serve-mma$mma.jsonl 2>> $OUT/err.txt
  done
  echo "serve rep $rep at $(el) s"
done
python3 - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/decode-*.jsonl")):
    for l in open(f):
        j = json.loads(l)
        if j.get("bench") == "prefill": continue
        if j["bench"] == "speculative":
            print(os.path.basename(f), "spec b", j["batch"], "%.0f tok/s (attention %.0f) draft step %.3f ms verify %.3f ms" % (
                j["spec_decode_tokens_per_s"], j["attention_decode_tokens_per_s"], j["draft_step_ms"], j["verify_ms"]))
            continue
        print(os.path.basename(f), j["bench"], j.get("mode"), "b", j["batch"],
              "ms %.3f" % j.get("decode_ms_per_step", 0), "roof %.3f" % j.get("roofline_fraction", 0))
for f in sorted(glob.glob(os.environ["OUT"] + "/serve-*.jsonl")):
    for l in open(f):
        j = json.loads(l)
        print(os.path.basename(f), j["policy"], j["concurrency"], "%.0f tok/s" % j["generated_tokens_per_s"], "acc", j.get("acceptance_rate"))
PY
echo "$T1"
echo "end at $(el) s"
