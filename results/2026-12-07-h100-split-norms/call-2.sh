# Session 73, call 2: the GPU tests (the new linear steps moved to the end of the parity scenario), then the
# decode steps under four settings, alternating, twice: all on (the default); the L2 prefetch of the states off
# (ORYX_CUDA_STATE_PREFETCH=0); the gated norm in the mixer off (ORYX_CUDA_MIXER_NORM=0); all three off (the
# tree before this session). 1.4b at 32K (bf16 batch 1 and 8, fp8 batch 8), models/default at 15K (batch 8, 32);
# then the op profile of 1.4b's batch-8 linear step, all on.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([on]="" [no-prefetch]="ORYX_CUDA_STATE_PREFETCH=0" [no-mixer-norm]="ORYX_CUDA_MIXER_NORM=0"
  [off]="ORYX_CUDA_SPLIT_NORMS=0 ORYX_CUDA_MIXER_NORM=0 ORYX_CUDA_STATE_PREFETCH=0")
for rep in 1 2; do
  for s in on no-prefetch no-mixer-norm off; do
    run() { env ${SETTING[$s]} timeout 60 $B/oryx bench decode --device cuda "$@" --steps 20 --prefill-max-attention 0 --json \
      | sed "s/^{/{\"setting\":\"$s\",/" >> $OUT/decode.jsonl 2>> $OUT/err.txt; }
    run --config 1.4b --contexts 32768 --batches 1,8
    run --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run --model models/default --contexts 15360 --batches 8,32
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
ORYX_CUDA_PROFILE=1 timeout 90 $B/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches 8 \
  --steps 20 --prefill-max-attention 0 --json > /dev/null 2> $OUT/profile-b8.txt
grep -A10 "linear, batch 8" $OUT/profile-b8.txt
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
