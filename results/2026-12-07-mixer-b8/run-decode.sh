# Sourced by this folder's call scripts (calls 1-7 defined these inline). run SETTING ARGS... runs `oryx bench decode`
# with the environment variables of SETTING (the caller's SETTING array) and ARGS, appending its JSON lines,
# tagged with the setting, to $OUT/decode.jsonl.
run() {
  local s=$1; shift
  env ${SETTING[$s]} timeout 60 $B/oryx bench decode --device cuda "$@" --steps 20 --prefill-max-attention 0 --json \
    | sed "s/^{/{\"setting\":\"$s\",/" >> $OUT/decode.jsonl 2>> $OUT/err.txt
}
# serve SETTING: served `speculative` on models/default, 8K prompts, 32 clients, prefix cache off, one pass, with
# SETTING's variables; JSON to $OUT/serve-SETTING.jsonl, one line printed.
serve() {
  local s=$1
  env ${SETTING[$s]} EXTRA=--no-prefix-cache PROMPTS=8192 POLICIES=speculative CLIENTS=32 TIMEOUT=60 \
    bench/serve_grid.sh $B/oryx models/default data/c1 $OUT/serve-$s.jsonl 2>> $OUT/err.txt
  python3 -c "
import json
for l in open('$OUT/serve-$s.jsonl'):
    j = json.loads(l); print('serve $s', j['prompt_tokens'], j['concurrency'], j['policy'], '%.0f tok/s' % j['generated_tokens_per_s'])"
}
# profile_b8: the event profile (ORYX_CUDA_PROFILE=1: every op timed, graphs off) of 1.4b's batch-8 steps at 32K
# to $OUT/profile-b8.txt; the linear step's ops printed.
profile_b8() {
  ORYX_CUDA_PROFILE=1 timeout 90 $B/oryx bench decode --device cuda --config 1.4b --contexts 32768 --batches 8 \
    --steps 20 --prefill-max-attention 0 --json > /dev/null 2> $OUT/profile-b8.txt
  grep -A9 "linear, batch 8" $OUT/profile-b8.txt
}
