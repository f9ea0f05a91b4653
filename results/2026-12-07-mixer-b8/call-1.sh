# Session 74, call 1: the decode mixer a head per block for batches (DecodeMixerHeadKernel,
# ORYX_CUDA_HEAD_MIXER_SEQS, default 2) -- the GPU tests, then the steps with it (head) and without it (cluster:
# every batch a head per cluster), alternating twice: 1.4b at 32K (bf16 batch 1 and 8, fp8 batch 8),
# models/default at 15K (batch 8, 32); batch 1 with it forced (head1); the op profile of 1.4b's batch-8 step;
# if time is left, served `speculative` at 8K x 32 both ways.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([head]="" [cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=1048576" [head1]="ORYX_CUDA_HEAD_MIXER_SEQS=1")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in head cluster; do
    run $s --config 1.4b --contexts 32768 --batches 1,8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --model models/default --contexts 15360 --batches 8,32
  done
  run head1 --config 1.4b --contexts 32768 --batches 1
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
profile_b8
if (( $(el) < 330 )); then
  for s in head cluster; do
    serve $s
  done
fi
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
