#!/usr/bin/env bash
# Every command that prints JSON, on a model that emits text which is not valid UTF-8: a checkpoint with the
# bundled model's tokenizer, a small config and random weights, which samples byte-fallback pieces at once. Each
# command must exit 0 and print JSON that parses; ill-formed bytes come out as U+FFFD, and at least one
# output must show that it met them (or the test proved nothing). No command may abort.
#   json_output_test.sh PATH_TO_ORYX PATH_TO_WRITE_RANDOM_MODEL SOURCE_DIR
set -u
ORYX="$1" WRITE_RANDOM="$2" SRC="$3"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
passed=0 failed=0
M="$TMP/random"
"$WRITE_RANDOM" "$M" "$SRC/models/default" 7 d_model=128 n_layers=2 n_heads=2 head_dim=64 mlp_hidden=256 \
  max_position=2048 || { echo "FAIL: could not write the random model"; exit 1; }
HAY=("$SRC"/tests/data/default_model/val-100000.txt)

# check WHAT -- ARGS...: runs oryx ARGS, expects exit 0 and every stdout line that starts with '{' to parse.
check() {
  local what="$1"; shift 2
  "$ORYX" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [[ $rc -eq 0 ]] && python3 - "$TMP/out" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[1], encoding="utf-8") if l.startswith("{")]
assert lines, "no JSON printed"
for l in lines: json.loads(l)
PY
  then
    passed=$((passed + 1))
    cat "$TMP/out" >>"$TMP/all"
  else
    failed=$((failed + 1))
    echo "FAIL: $what (oryx $*): exit $rc; stderr:"; tail -5 "$TMP/err"
  fi
}

for policy in attention linear speculative:3 speculative:ngram:2 entropy:2 periodic:4; do
  check "generate $policy" -- generate --model "$M" --prompt "int main" --max-tokens 160 --temperature 1 --seed 3 \
    --policy "$policy" --json
done
check "generate greedy" -- generate --model "$M" --prompt "static int" --max-tokens 16 --json
check "eval niah" -- eval niah --model "$M" --haystack "${HAY[@]}" --lengths 128 --seeds 1 --json
check "eval mqar" -- eval mqar --model "$M" --lengths 128 --seeds 1 --json
check "eval ppl" -- eval ppl --model "$M" --text "${HAY[@]}" --seq-len 128 --sequences 1 --json
check "bench router" -- bench router --model "$M" --haystack "${HAY[@]}" --lengths 128 --seeds 1 --json
check "bench decode" -- bench decode --model "$M" --batches 1 --contexts 16 --steps 2 --json
check "bench cost" -- bench cost --model "$M" --repeats 1 --json
check "bench serve" -- bench serve --model "$M" --concurrency 2 --requests 2 --prompt-tokens 8 --max-tokens 8 --json
check "bench serve speculative" -- bench serve --model "$M" --concurrency 2 --requests 2 --prompt-tokens 8 \
  --max-tokens 8 --policy speculative:2 --json
# Its rounds by draft length, and the share of drafting rounds run whole: none on the CPU backend.
if python3 -c 'import json, sys
j = json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][0])
assert sum(j["rounds_by_length"][1:]) > 0 and j["whole_round_fraction"] == 0, j' "$TMP/out"; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL: bench serve speculative: no rounds_by_length, or whole_round_fraction missing or not 0"
fi

# More tokens asked for than the context holds: generation ends at the context's end, and says so (not JSON).
"$ORYX" generate --model "$M" --prompt "int main" --max-tokens 4000 --ignore-eos --temperature 1 --seed 3 \
  >"$TMP/out" 2>"$TMP/err"
if [[ $? -eq 0 ]] && grep -q "stopped at the end of the model's context (2048 positions), before --max-tokens 4000" \
  "$TMP/err"; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL: generate past the context: no note on stderr"; tail -3 "$TMP/err"
fi

if python3 -c 'import sys; sys.exit(0 if "\ufffd" in open(sys.argv[1], encoding="utf-8").read() else 1)' "$TMP/all"
then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL: no output contained U+FFFD: the random model never emitted ill-formed UTF-8, so nothing was tested"
fi
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
