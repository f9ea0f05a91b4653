#!/usr/bin/env bash
# End-to-end serving grid: `oryx bench serve` over prompt lengths x policies x client counts, prompts from
# a corpus's validation split (real text, so speculation meets its real acceptance). One JSON line per
# (prompt length, policy, clients) point, each tagged with "prompt_tokens" and "policy", appended to OUT.
#
#   bench/serve_grid.sh ORYX MODEL CORPUS OUT.jsonl
#   Environment: DEVICE (default cuda), PROMPTS (default "4096 8192 15872"), POLICIES (default "attention
#   speculative budget:0.1"), CLIENTS (default 1,8,32,64), MAX_TOKENS (default 512: 15872 + 512 = 16384,
#   the model's context), REQUESTS (per level, default 64: at least the largest level, or that level measures
#   a smaller batch than it names), TIMEOUT (seconds per run, default 120).
set -euo pipefail
if [[ $# -ne 4 ]]; then sed -n '2,9p' "$0"; exit 2; fi
ORYX=$1 MODEL=$2 CORPUS=$3 OUT=$4
DEVICE=${DEVICE:-cuda} PROMPTS=${PROMPTS:-"4096 8192 15872"} POLICIES=${POLICIES:-"attention speculative budget:0.1"}
CLIENTS=${CLIENTS:-1,8,32,64} MAX_TOKENS=${MAX_TOKENS:-512} REQUESTS=${REQUESTS:-64} TIMEOUT=${TIMEOUT:-120}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for prompt in $PROMPTS; do
  for policy in $POLICIES; do
    echo "== prompts of $prompt tokens, policy $policy" >&2
    if timeout "$TIMEOUT" "$ORYX" bench serve --model "$MODEL" --device "$DEVICE" --data "$CORPUS" \
        --concurrency "$CLIENTS" --requests "$REQUESTS" --prompt-tokens "$prompt" --max-tokens "$MAX_TOKENS" \
        --policy "$policy" --json >"$tmp"; then
      python3 -c 'import json,sys
for line in open(sys.argv[1]):
    j = json.loads(line); j.update(prompt_tokens=int(sys.argv[2]), policy=sys.argv[3]); print(json.dumps(j))' \
        "$tmp" "$prompt" "$policy" >>"$OUT"
    else
      echo "serve_grid: prompts $prompt, policy $policy: exit $?" >&2
    fi
  done
done
