#!/usr/bin/env bash
# `oryx train-router` end to end on the bundled model, at a tiny scale: a two-lambda sweep writes one
# policy file per lambda and a log, the files load in `oryx generate --policy learned:FILE`, a resumed run
# skips the lambdas already done and trains the rest, and bad input is one clear error.
#   train_router_test.sh PATH_TO_ORYX SOURCE_DIR
set -u
ORYX="$1"
SRC="$2"
M="$SRC/models/default"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failed=0
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
TINY=(--model "$M" --haystack "$SRC"/tests/data/default_model/val-*.txt --tasks niah-multikey mqar --lengths 256
      --warm-examples 2 --warm-steps 20 --batch 2 --samples 2 --threads 2)

# A sweep of two lambdas, two iterations each.
"$ORYX" train-router "${TINY[@]}" --out "$TMP/p.safetensors" --lambda 0.5,2 --iterations 2 2>"$TMP/err" ||
  { fail "train-router sweep exited $?"; cat "$TMP/err"; }
for f in "$TMP/p-lambda0.5.safetensors" "$TMP/p-lambda2.safetensors" "$TMP/p.safetensors.log.jsonl"; do
  [[ -s "$f" ]] || fail "missing $f"
done
[[ $(grep -c '"phase":"reinforce"' "$TMP/p.safetensors.log.jsonl") -eq 4 ]] || fail "expected 4 REINFORCE log lines"
grep -q '"phase":"counterfactual"' "$TMP/p.safetensors.log.jsonl" || fail "no counterfactual log line"
grep -q 'iter 2/2' "$TMP/err" || fail "no progress lines"

# The policy runs inside generation and reports its modes.
"$ORYX" generate --model "$M" --prompt "int main" --max-tokens 4 --policy "learned:$TMP/p-lambda2.safetensors" --json \
  >"$TMP/gen.json" 2>"$TMP/err" || { fail "generate with the learned policy"; cat "$TMP/err"; }
grep -q '"attention_fraction"' "$TMP/gen.json" || fail "generate --json without stats"

# Resume: the first lambda is done (its file must not change), the second is trained.
"$ORYX" train-router "${TINY[@]}" --out "$TMP/r.safetensors" --lambda 0.5 --iterations 1 2>/dev/null || fail "first run"
sum=$(cksum <"$TMP/r.safetensors")
mv "$TMP/r.safetensors" "$TMP/r-lambda0.5.safetensors"
"$ORYX" train-router "${TINY[@]}" --out "$TMP/r.safetensors" --lambda 0.5,1 --iterations 1 --resume 2>"$TMP/err" ||
  { fail "resumed run"; cat "$TMP/err"; }
grep -q 'resuming at lambda index 1' "$TMP/err" || fail "the resumed run did not start at the second lambda"
grep -q 'lambda 0.5  iter' "$TMP/err" && fail "the resumed run trained the first lambda again"
[[ "$(cksum <"$TMP/r-lambda0.5.safetensors")" == "$sum" ]] || fail "the first lambda's file changed"
[[ -s "$TMP/r-lambda1.safetensors" ]] || fail "the resumed run wrote no file for the second lambda"

# Bad input: one "oryx: error:" line and a non-zero exit.
bad() {
  local what="$1"; shift
  "$ORYX" "$@" >/dev/null 2>"$TMP/err"
  local rc=$?
  if [[ $rc -eq 0 || $(grep -c '^oryx: error: ' "$TMP/err") -ne 1 ]]; then fail "$what: exit $rc"; cat "$TMP/err"; fi
}
bad "negative lambda" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --lambda -1
bad "one sample" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --samples 1
bad "length past max_position" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --lengths 4096
bad "no haystack" train-router --model "$M" --out "$TMP/x.safetensors"
bad "unknown task" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --tasks sudoku
bad "missing policy file" generate --model "$M" --prompt hi --policy "learned:$TMP/none.safetensors"
head -c 200 "$TMP/p-lambda2.safetensors" >"$TMP/cut.safetensors"
bad "truncated policy file" generate --model "$M" --prompt hi --policy "learned:$TMP/cut.safetensors"
bad "a checkpoint shard as policy" generate --model "$M" --prompt hi --policy "learned:$M/model-00002-of-00002.safetensors"

[[ $failed -eq 0 ]] && echo "train_router_test: all checks passed"
[[ $failed -eq 0 ]]
