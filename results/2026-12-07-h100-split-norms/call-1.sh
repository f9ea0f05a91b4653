# Session 73, call 1: the norms of a batch's step split between its products and the gated norm in the mixer
# (ORYX_CUDA_SPLIT_NORMS, default on) -- the GPU tests at HEAD (cd65a6a's refactor included), then the steps
# on and off, alternating: 1.4b at 32K (bf16 batch 1 and 8, fp8 batch 8), models/default at 15K (batch 8, 32);
# then the op profile of 1.4b's batch-8 linear step with it on.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
for rep in 1 2; do
  for split in 1 0; do
    ORYX_CUDA_SPLIT_NORMS=$split timeout 60 $B/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches 1,8 \
      --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"split\":$split,/" >> $OUT/decode.jsonl 2>> $OUT/err.txt
    ORYX_CUDA_SPLIT_NORMS=$split timeout 40 $B/oryx bench decode --device cuda --config 1.4b --weights fp8 --contexts 32768 \
      --batches 8 --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"split\":$split,/" >> $OUT/decode.jsonl 2>> $OUT/err.txt
    ORYX_CUDA_SPLIT_NORMS=$split timeout 40 $B/oryx bench decode --device cuda --model models/default --contexts 15360 \
      --batches 8,32 --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"split\":$split,/" >> $OUT/decode.jsonl 2>> $OUT/err.txt
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py split
ORYX_CUDA_PROFILE=1 timeout 90 $B/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches 8 \
  --steps 20 --prefill-max-attention 0 --json > /dev/null 2> $OUT/profile-b8.txt
grep -A14 "linear, batch 8" $OUT/profile-b8.txt
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
