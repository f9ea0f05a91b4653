# Session 73, call 3: the tree as kept (the state prefetch removed after call 2) -- the GPU tests; the decode
# steps with the split norms and the mixer's gated norm (the default) and without them (ORYX_CUDA_SPLIT_NORMS=0
# ORYX_CUDA_MIXER_NORM=0), alternating, once; served `attention` and `speculative` at 8K x 32, one
# pass each way.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([on]="" [off]="ORYX_CUDA_SPLIT_NORMS=0 ORYX_CUDA_MIXER_NORM=0")
for s in on off; do
  run() { env ${SETTING[$s]} timeout 60 $B/oryx bench decode --device cuda "$@" --steps 20 --prefill-max-attention 0 --json \
    | sed "s/^{/{\"setting\":\"$s\",/" >> $OUT/decode.jsonl 2>> $OUT/err.txt; }
  run --config 1.4b --contexts 32768 --batches 1,8
  run --config 1.4b --weights fp8 --contexts 32768 --batches 8
  run --model models/default --contexts 15360 --batches 8,32
done
echo "decode at $(el) s"
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
for pc in 8192:32; do
  for s in on off; do
    env ${SETTING[$s]} EXTRA=--no-prefix-cache PROMPTS=${pc%:*} POLICIES="attention speculative" CLIENTS=${pc#*:} \
      TIMEOUT=60 bench/serve_grid.sh $B/oryx models/default data/c1 $OUT/serve-$s.jsonl 2>> $OUT/err.txt
  done
  echo "serve $pc at $(el) s"
done
for s in on off; do
  python3 -c "
import json
for l in open('$OUT/serve-$s.jsonl'):
    j = json.loads(l); print('serve $s', j['prompt_tokens'], j['concurrency'], j['policy'], '%.0f tok/s' % j['generated_tokens_per_s'])"
done
tail -3 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
