# Call 15: device LogitStats. Build the tree and the tree before 38c7dc2 (3023ced); kernel + backend tests;
# 16K x 8 clients serving: attention, budget:0.1, entropy:3, learned (v3) on both trees, interleaved.
source .carry/env.sh
t0=$(date +%s)
mkdir -p $OUT data
LD_LIBRARY_PATH=$PWD/.carry/bin zstd -dc .xa/model.tar.zst | tar -xf -
tar -xJf .xb/c16v.tar.xz -C data
R=$PWD
scripts/device-build --no-tests --targets "oryx cuda_backend_test ops_cuda_test" > /tmp/b.log 2>&1 || { tail -40 /tmp/b.log; exit 1; }
echo "built new at $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/old && tar -xJf .xb/old.tar.xz -C /tmp/old && ln -sfn $R/.deps /tmp/old/.deps
(cd /tmp/old && scripts/device-build --build-dir build-old --no-tests --targets oryx > /tmp/bo.log 2>&1) &
BO=$!
build-gpu/tests/ops_cuda_test --gtest_filter='*DistributionStats*:*Argmax*' 2>&1 | tail -4 | tee $OUT/ops-cuda.txt
build-gpu/tests/cuda_backend_test 2>&1 | grep -E "^\[  (PASSED|FAILED) |FAILED|tests ran" | tee $OUT/cuda-backend.txt
wait $BO || { tail -30 /tmp/bo.log; }
echo "built old, tests done at $(( $(date +%s) - t0 )) s"
POL="attention budget:0.1 entropy:3 learned:.carry/p/router-cpu-v3.safetensors"
for rep in 1 2; do
for tree in new old; do
  O=build-gpu/bin/oryx; [[ $tree == old ]] && O=/tmp/old/build-old/bin/oryx
  PROMPTS="15872" POLICIES="$POL" CLIENTS=8 REPEATS=1 TIMEOUT=60 \
    timeout 200 bench/serve_grid.sh $O models/default data/c16v $OUT/serve-$tree-$rep.jsonl 2>> $OUT/serve.err
  echo "$tree rep $rep at $(( $(date +%s) - t0 )) s"
  [[ $(( $(date +%s) - t0 )) -gt 500 ]] && break 2
done
done
for f in $OUT/serve-*.jsonl; do echo "== $f"; python3 bench/serve_ratios.py $f 2>&1 | tail -n +2; done
python3 - <<'PY'
import json,os
import glob
for p in sorted(glob.glob(os.path.join(os.environ["OUT"],"serve-*.jsonl"))):
    for l in open(p):
        j=json.loads(l); print(os.path.basename(p), j.get("policy"), round(j["generated_tokens_per_s"],1), j.get("ttft_s_p50", ""))
PY
