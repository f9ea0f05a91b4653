# Session 75, call 4: call 3 found that neither of the head-per-block mixer's programmatic-launch overlaps
# explains its slower step (overlap 0-3: 1.86-1.96 ms against the cluster layout's 1.63 at 1.4b bf16 batch 8),
# while call 2 had it faster with programmatic launch off everywhere. A guess that fits calls 2 and 3: for
# occupancy the driver gives this mixer (65 KiB of shared memory a block) the largest shared-memory split, and
# under programmatic launch no SM drains, so the GEMVs after it keep that split's small L1 (all-shared L1 made
# every GEMV slower in call 2). ORYX_CUDA_HEAD_MIXER_CARVEOUT asks for a smaller split: 0 (the least that fits a
# block), 58 (two blocks). Settings alternating twice, no GPU tests (no kernel code changed since call 3).
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
export OUT; source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
B=build-gpu/bin
H="ORYX_CUDA_HEAD_MIXER_SEQS=2"
declare -A SETTING=([cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=1048576" [head]="$H" [head-c0]="$H ORYX_CUDA_HEAD_MIXER_CARVEOUT=0"
  [head-c58]="$H ORYX_CUDA_HEAD_MIXER_CARVEOUT=58" [head1-c0]="$H ORYX_CUDA_HEAD_MIXER_CARVEOUT=0 ORYX_CUDA_HEAD_MIXER_OVERLAP=1")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in cluster head head-c0 head-c58 head1-c0; do
    run $s --config 1.4b --contexts 32768 --batches 8,32
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --model models/default --contexts 15360 --batches 8,32
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -5 $OUT/err.txt
echo "at $(el) s"
