#!/usr/bin/env bash
# End-to-end serving grid: `oryx bench serve` over prompt lengths x policies x client counts, prompts from
# a corpus's validation split (real text, so speculation meets its real acceptance). One JSON line per
# (prompt length, policy, clients) point, each tagged with "prompt_tokens" and "policy", appended to OUT.
#
#   bench/serve_grid.sh ORYX MODEL CORPUS OUT.jsonl
#   Environment: DEVICE (default cuda), PROMPTS (default "4096 8192 15872"), POLICIES (default "attention
#   speculative budget:0.1"), CLIENTS (default 1,8,32,64), MAX_TOKENS (default 512: 15872 + 512 = 16384,
#   the model's context), REQUESTS (per level; default 0: four per client, at least 8, so that each level
#   measures its batch kept full; 64 measures one wave of 64 requests, whose end waits for the slowest),
#   TIMEOUT (seconds per run, default 120), REPEATS (default 1: each prompt length runs its policies in turn
#   this many times, so that repeats of a point are interleaved in time; lines carry "repeat"), EXTRA (more
#   flags for every run, e.g. "--no-prefix-cache": the corpus's validation split holds a few windows of 16K,
#   so longer runs repeat prompts, which the prefix cache then serves).
#   bench/serve_ratios.py OUT.jsonl tabulates the policies' ratios over the repeats.
set -euo pipefail
if [[ $# -ne 4 ]]; then sed -n '2,15p' "$0"; exit 2; fi
ORYX=$1 MODEL=$2 CORPUS=$3 OUT=$4
DEVICE=${DEVICE:-cuda} PROMPTS=${PROMPTS:-"4096 8192 15872"} POLICIES=${POLICIES:-"attention speculative budget:0.1"}
CLIENTS=${CLIENTS:-1,8,32,64} MAX_TOKENS=${MAX_TOKENS:-512} REQUESTS=${REQUESTS:-0} TIMEOUT=${TIMEOUT:-120}
REPEATS=${REPEATS:-1} EXTRA=${EXTRA:-}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for prompt in $PROMPTS; do
  for repeat in $(seq 1 "$REPEATS"); do
  for policy in $POLICIES; do
    echo "== prompts of $prompt tokens, policy $policy" >&2
    if timeout "$TIMEOUT" "$ORYX" bench serve --model "$MODEL" --device "$DEVICE" --data "$CORPUS" \
        --concurrency "$CLIENTS" --requests "$REQUESTS" --prompt-tokens "$prompt" --max-tokens "$MAX_TOKENS" \
        --policy "$policy" $EXTRA --json >"$tmp"; then
      python3 -c 'import json,sys
for line in open(sys.argv[1]):
    j = json.loads(line); j.update(prompt_tokens=int(sys.argv[2]), policy=sys.argv[3], repeat=int(sys.argv[4]))
    print(json.dumps(j))' \
        "$tmp" "$prompt" "$policy" "$repeat" >>"$OUT"
    else
      echo "serve_grid: prompts $prompt, policy $policy: exit $?" >&2
    fi
  done
  done
done
