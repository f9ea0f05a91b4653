# Session 74, call 2: call 1 found the head-per-block mixer faster alone (0.31 against 0.42 ms of op time at
# batch 8) but slower in the step with bf16 weights (1.92 against 1.59 ms; with FP8 weights 0.97x). One guess:
# an SM changes its L1 / shared split only when idle, so a mixer asking for 64 KiB of shared memory between two
# GEMVs asking for little cannot overlap them. Here the GEMV and the mixer ask for the same split
# (ORYX_CUDA_BATCH_CARVEOUT=100: all shared) -- cluster (every batch a head per cluster, no carveout: the
# default), head-c100, cluster-c100, alternating twice; the GPU tests first (the new layout's sums now in
# the cluster layout's order); then, with programmatic launch off (ORYX_CUDA_PDL=0: no kernel overlaps
# another), both layouts once on 1.4b bf16 at batch 8 -- if the new one is then the faster, what it loses is the overlap; served
# `speculative` at 8K x 32 if time is left.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=1048576" [head-c100]="ORYX_CUDA_HEAD_MIXER_SEQS=2 ORYX_CUDA_BATCH_CARVEOUT=100"
  [cluster-c100]="ORYX_CUDA_HEAD_MIXER_SEQS=1048576 ORYX_CUDA_BATCH_CARVEOUT=100"
  [head-pdl0]="ORYX_CUDA_HEAD_MIXER_SEQS=2 ORYX_CUDA_PDL=0" [cluster-pdl0]="ORYX_CUDA_PDL=0")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in cluster head-c100 cluster-c100; do
    run $s --config 1.4b --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --model models/default --contexts 15360 --batches 8,32
  done
  echo "rep $rep at $(el) s"
done
for s in head-pdl0 cluster-pdl0; do run $s --config 1.4b --contexts 32768 --batches 8; done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
if (( $(el) < 200 )); then
  for s in head-c100 cluster; do
    serve $s
  done
fi
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
