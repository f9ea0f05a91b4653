#!/usr/bin/env bash
# bench/router_oracle.py on a hand-made train-router log whose answer is known: rule a is best on task x and
# rule b on task y, so choosing per task dominates both; all-attention stays more accurate, and all-linear,
# the cheapest policy, is never dominated; a second evaluation in the log is read with --run; bad input is
# one clear error.
#   router_oracle_test.sh SOURCE_DIR
set -u
SRC="$1"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failed=0
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
row() { echo "{\"phase\":\"eval\",\"task\":\"$1\",\"policy\":\"$2\",\"quality\":$3,\"cost\":$4,\"examples\":$5}"; }
{
  echo '{"phase":"cost_model"}'
  row x attention 1.0 1.0 8; row x linear 0.1 0.5 8; row x a 0.9 0.6 8; row x b 0.2 0.9 8
  row y attention 1.0 1.0 8; row y linear 0.1 0.5 8; row y a 0.2 0.9 8; row y b 0.9 0.6 8
  echo '{"phase":"eval_mixed"}'
  row x attention 1.0 1.0 4; row x linear 0.1 0.5 4; row x a 0.5 0.6 4
  row y attention 1.0 1.0 4; row y linear 0.1 0.5 4; row y a 0.5 0.6 4
} >"$TMP/log.jsonl"
ORACLE=(python3 "$SRC/bench/router_oracle.py")

"${ORACLE[@]}" "$TMP/log.jsonl" --run 0 --json >"$TMP/out" 2>&1 || fail "exited $?: $(cat "$TMP/out")"
python3 - "$TMP/out" <<'PY' || fail "wrong answer: $(cat "$TMP/out")"
import json, sys
d = json.load(open(sys.argv[1]))
by = {r["rule"]: r for r in d["rules"]}
assert d["dominated"] == 2 and d["of"] == 4, d  # a and b; not attention (more accurate), never linear
assert by["a"]["by"] == {"x": "a", "y": "b"} and by["b"]["by"] == {"x": "a", "y": "b"}, by
assert abs(by["a"]["by_point"][0] - 0.9) < 1e-9 and abs(by["a"]["by_point"][1] - 0.6) < 1e-9, by
assert not by["linear"]["dominated"], by
PY
# The last evaluation (the default): a is the only other rule, and choosing per task cannot beat it.
"${ORACLE[@]}" "$TMP/log.jsonl" >"$TMP/out" 2>&1 || fail "exited $?: $(cat "$TMP/out")"
grep -q "^0 of 3 rules dominated" "$TMP/out" || fail "the last evaluation: $(cat "$TMP/out")"

for bad in "--run 2" "--run -3"; do
  if "${ORACLE[@]}" "$TMP/log.jsonl" $bad >"$TMP/out" 2>&1; then fail "$bad accepted"; fi
  grep -q "holds 2 evaluations" "$TMP/out" || fail "$bad: $(cat "$TMP/out")"
done
echo '{"phase":"cost_model"}' >"$TMP/none.jsonl"
if "${ORACLE[@]}" "$TMP/none.jsonl" >"$TMP/out" 2>&1; then fail "a log without evaluations accepted"; fi
grep -q "holds no evaluation" "$TMP/out" || fail "no evaluation: $(cat "$TMP/out")"
echo "not json" >"$TMP/bad.jsonl"
if "${ORACLE[@]}" "$TMP/bad.jsonl" >"$TMP/out" 2>&1; then fail "a line that is not JSON accepted"; fi
grep -q "bad.jsonl:1: not JSON" "$TMP/out" || fail "not JSON: $(cat "$TMP/out")"
if "${ORACLE[@]}" "$TMP/missing.jsonl" >"$TMP/out" 2>&1; then fail "a missing log accepted"; fi

[[ $failed -eq 0 ]] && echo "router_oracle_test: all passed"
exit $failed
