# Session 72, call 9: where 1.4b's linear step at batch 8 goes now (ORYX_CUDA_PROFILE=1: every op timed with
# events, graphs off), beside batch 1.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
for b in 1 8; do
  ORYX_CUDA_PROFILE=1 timeout 90 build-gpu/bin/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches $b \
    --steps 20 --prefill-max-attention 0 --json > $OUT/decode-b$b.jsonl 2> $OUT/profile-b$b.txt
  echo "batch $b at $(el) s"; grep -v "^\s*$" $OUT/profile-b$b.txt | head -60
done
