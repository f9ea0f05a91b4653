# Session 75, call 3: call 2 found that with programmatic launch off everywhere (ORYX_CUDA_PDL=0) the
# head-per-block mixer is the faster layout (1.4b bf16 batch 8: 1.619 against 1.727 ms), while with it on the
# cluster layout wins (1.62 against 1.92 in call 1): the new layout loses its overlap with its neighbours, or is
# hurt by it. ORYX_CUDA_HEAD_MIXER_OVERLAP (bits) splits the two overlaps: 1, the mixer scheduled during the
# input projection's tail; 2, the next kernel scheduled at the mixer's wait (not after its state's update).
# Settings: cluster; head with overlap 3 (as every kernel), 2, 1, 0; head and cluster with early loads off.
# Alternating twice on 1.4b bf16 and fp8 batch 8, models/default batch 8 and 32. GPU tests first.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
H="ORYX_CUDA_HEAD_MIXER_SEQS=2"
declare -A SETTING=([cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=1048576" [head3]="$H" [head2]="$H ORYX_CUDA_HEAD_MIXER_OVERLAP=2"
  [head1]="$H ORYX_CUDA_HEAD_MIXER_OVERLAP=1" [head0]="$H ORYX_CUDA_HEAD_MIXER_OVERLAP=0"
  [head-el0]="$H ORYX_CUDA_EARLY_LOADS=0" [cluster-el0]="ORYX_CUDA_EARLY_LOADS=0")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in cluster head3 head2 head1 head0; do
    run $s --config 1.4b --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --model models/default --contexts 15360 --batches 8,32
  done
  echo "rep $rep at $(el) s"
done
for s in head-el0 cluster-el0; do run $s --config 1.4b --contexts 32768 --batches 8; done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
