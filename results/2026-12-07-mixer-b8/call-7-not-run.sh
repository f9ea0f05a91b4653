# Session 75, call 7: the tree as kept (the head-per-block mixer always two threads a column, on for batches at
# head_dim 128, carveout 0). The GPU tests; then default against the cluster layout (ORYX_CUDA_HEAD_MIXER_SEQS=0),
# alternating twice: 1.4b bf16 mamba2 and gdn, fp8 mamba2, batch 8; then the event profile of 1.4b's batch-8
# linear step (where the 1.50 ms go now; the mixer took 0.312 ms of op time with one thread a column).
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([default]="" [cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=0")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in default cluster; do
    run $s --config 1.4b --contexts 32768 --batches 8
    run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
profile_b8
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
