# Session 76, call 8 (binary of wip 50e1485: main plus ORYX_CUDA_MIXER_HANDOFF). The hand-off: the head-per-block
# mixer writes its outputs, counts itself done (a counter per layer), and only then stores the new state (from
# shared memory); the output projection waits for that count instead of the mixer's end, and for the end only
# before it writes. The GPU tests (cuda_backend_test compares a third backend, the hand-off on at every head_dim,
# against the CPU); then default against the hand-off, alternating: 1.4b bf16 mamba2 batch 8 (three times), gdn
# and fp8 batch 8 and mamba2 batches 16 and 32 at 4K (twice).
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([default]="" [handoff]="ORYX_CUDA_MIXER_HANDOFF=1")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2 3; do
  for s in default handoff; do run $s --config 1.4b --contexts 32768 --batches 8; done
done
echo "b8 at $(el) s"
for rep in 1 2; do
  for s in default handoff; do
    run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --config 1.4b --contexts 4096 --batches 16,32
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
grep -B3 -A15 "Failure\|hand-off" $OUT/tests.txt | head -30
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
