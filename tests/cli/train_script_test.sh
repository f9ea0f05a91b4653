#!/usr/bin/env bash
# scripts/train-default-model without a GPU: the `oryx` it runs is a stub that records its arguments, so
# that each phase's flags (the recipe a shipped model was trained by) and the script's bad-argument errors
# are checked where CI runs.
#   train_script_test.sh SOURCE_DIR
set -u
SRC="$1"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
passed=0 failed=0
cat >"$TMP/oryx" <<'STUB'
#!/usr/bin/env bash
echo "$*" >>"$CALLS"
STUB
chmod +x "$TMP/oryx"
export ORYX="$TMP/oryx" CALLS="$TMP/calls"
check() {  # check DESCRIPTION CONDITION...
  local what="$1"; shift
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: $what"; fi
}
script="$SRC/scripts/train-default-model"

# Bad arguments: exit 2, one "train-default-model: error:" line, and `oryx` never run.
for args in "compare --mixer rwkv --corpus c --out o" "theta --mixer gdn --corpus c --out o --init-from m" \
            "theta --corpus c --out o" "frobnicate --corpus c --out o" "train --corpus c"; do
  rm -f "$CALLS"
  # shellcheck disable=SC2086
  "$script" $args >/dev/null 2>"$TMP/err"
  rc=$?
  check "'$args' exits 2 (got $rc)" test $rc -eq 2
  check "'$args' prints one error line" test "$(grep -c '^train-default-model: error: ' "$TMP/err")" -eq 1
  check "'$args' runs nothing" test ! -e "$CALLS"
done

# compare: the chosen mixer at 4,096 tokens x 32 from scratch, then three evaluations on the engine.
rm -f "$CALLS"
mkdir -p "$TMP/o"  # (oryx train makes it)
"$script" compare --mixer gdn --corpus "$TMP/c" --out "$TMP/o" >/dev/null 2>&1
check "compare runs oryx four times" test "$(wc -l <"$CALLS")" -eq 4
train=$(head -1 "$CALLS")
for want in "^train " "--mixer gdn " "--seq-len 4096 --batch 32 --max-position 4096" "--steps 1200 " \
            "--rope-theta 500000 " "--attn-log-scale-base 0 "; do
  check "compare's training has '$want'" grep -q -e "$want" <<<"$train"
done
check "compare's training starts from scratch" bash -c '! grep -q -e "--init-from" <<<"$1"' _ "$train"
check "compare evaluates on the GPU engine" test "$(grep -c -e '^eval .*--device cuda --weights bf16' "$CALLS")" -eq 3

# theta (the bundled model's stage 4): theta 8M and the query log-scale from the given weights at 16K.
rm -f "$CALLS"
"$script" theta --corpus "$TMP/c" --out "$TMP/o" --init-from "$TMP/m" >/dev/null 2>&1
theta=$(cat "$CALLS")
for want in "--mixer mamba2 " "--rope-theta 8000000 " "--attn-log-scale-base 1024 " "--seq-len 16384 --batch 8" \
            "--steps 900 " "--init-from $TMP/m"; do
  check "theta's training has '$want'" grep -q -e "$want" <<<"$theta"
done

echo "train_script_test: $passed passed, $failed failed"
[[ $failed -eq 0 ]]
