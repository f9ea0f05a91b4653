# Session 76, call 7 (binary of wip 092c641: the tree as kept, 4cf15fd, plus ORYX_CUDA_HEAD_MIXER_PARTS=2|4,
# ORYX_CUDA_MMA_WARPS (the warps an SM the tensor-core GEMV's grid aims at, 16), ORYX_CUDA_MMA_EARLY_BOTH and the diagnostic ORYX_DIAG bits
# of the head-per-block mixer; none changes the default path's code). The GPU
# tests (the mixer test: the cluster layout and the head layout with 2 and 4 threads a column); then, alternating
# twice, 1.4b bf16 mamba2 batch 8 at 32K with: the default (2 threads a column), 4 threads a column, the
# cluster layout, ORYX_CUDA_MMA_WARPS 12 (the input projection's 513 blocks at 4 warps, one wave, not 8), 7 (also the
# output and down projections at 8 warps, not 16, so that they fit beside the kernel before them) and 3 (4 warps
# everywhere), ORYX_CUDA_MMA_EARLY_BOTH=1 (the tensor-core GEMV's second weight buffer loaded before the wait
# too), and the diagnostics (1 no mixer launched, 2 no state store, 4 no state copy, 8 the
# state copied after the wait instead of before); gdn and fp8 batch 8, and batches 16 and 32 (at 4K: their 32K caches do not fit the H100), default against 4
# threads, MMA_WARPS=7 and MMA_EARLY_BOTH=1; then the event profile of the batch-8 step.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([default]="" [parts4]="ORYX_CUDA_HEAD_MIXER_PARTS=4" [cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=0" [mw12]="ORYX_CUDA_MMA_WARPS=12"
  [mw7]="ORYX_CUDA_MMA_WARPS=7" [mw3]="ORYX_CUDA_MMA_WARPS=3"
  [early2]="ORYX_CUDA_MMA_EARLY_BOTH=1"
  [diag1]="ORYX_DIAG=1" [diag2]="ORYX_DIAG=2" [diag4]="ORYX_DIAG=4" [diag8]="ORYX_DIAG=8")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in default parts4 cluster mw12 mw7 mw3 early2 diag1 diag2 diag4 diag8; do run $s --config 1.4b --contexts 32768 --batches 8; done
  echo "rep $rep at $(el) s"
done
for rep in 1; do
  for s in default parts4 mw7 early2; do
    run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --config 1.4b --contexts 4096 --batches 16,32
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
profile_b8
mv $OUT/profile-b8.txt $OUT/profile-b8-default.txt
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
