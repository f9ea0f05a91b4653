#!/usr/bin/env bash
# bench/copy_probe.py on the shipped model (LibTorch on the CPU, a few seconds): a passage of random tokens
# repeated 200 tokens later is copied far better than the same rows score with the passage hidden (random
# tokens leave the model no prior to fall back on), the copying heads put real attention on it and more with
# the queries scaled by --attn-log-scale-base, and a corpus without a validation split is refused.
#   copy_probe_test.sh SOURCE_DIR
set -euo pipefail
SRC="$1"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failed=0
fail() { echo "FAIL: $*"; failed=1; }
mkdir -p "$TMP/corpus" "$TMP/empty"
python3 -c "
import random, struct
random.seed(1)
open('$TMP/corpus/val-00000.bin', 'wb').write(struct.pack('<4000H', *(random.randrange(100, 8000) for _ in range(4000))))"
python3 "$SRC/bench/copy_probe.py" --model "$SRC/models/default" --data "$TMP/corpus" --lengths 256 --depths 1 \
  --seeds 2 --threads 2 --attn-log-scale-base 0 --out "$TMP/probe.json" >"$TMP/out" 2>&1 ||
  { fail "copy_probe exited $?"; cat "$TMP/out"; }
python3 - "$TMP/probe.json" <<'PY' || fail "random tokens are not copied, or the probe's fields are wrong"
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
assert r["length"] == 256 and r["depth"] == 1 and len(r["heads"]) == 3, r
assert r["token_accuracy"] >= r["token_accuracy_hidden"] + 0.3, r
assert r["token_accuracy_hidden"] <= 0.2, r
assert max(h["mass"] for h in r["heads"]) > 0.3, r
PY
# Queries scaled by ln(p+1)/ln(32) (1.6x at the repeat) sharpen the copying heads onto the passage. (The
# model's own base, 1024, leaves 256 positions unscaled, so the run above with 0 is the model as trained.)
python3 "$SRC/bench/copy_probe.py" --model "$SRC/models/default" --data "$TMP/corpus" --lengths 256 --depths 1 \
  --seeds 2 --threads 2 --attn-log-scale-base 32 --out "$TMP/scaled.json" >"$TMP/out" 2>&1 ||
  { fail "copy_probe --attn-log-scale-base exited $?"; cat "$TMP/out"; }
python3 - "$TMP/probe.json" "$TMP/scaled.json" <<'PY' || fail "scaled queries did not sharpen the copying heads"
import json, sys
plain, scaled = (json.load(open(f)) for f in sys.argv[1:])
assert plain["attn_log_scale_base"] == 0 and scaled["attn_log_scale_base"] == 32, (plain, scaled)
mass = lambda d: sum(h["mass"] for h in d["results"][0]["heads"])
assert mass(scaled) > mass(plain) + 0.01, (mass(plain), mass(scaled))  # 2.19 -> 2.22 on the bundled model
PY
if python3 "$SRC/bench/copy_probe.py" --model "$SRC/models/default" --data "$TMP/empty" >"$TMP/out" 2>&1; then
  fail "a corpus without val-*.bin was accepted"
elif ! grep -q "no val-\*.bin" "$TMP/out"; then
  fail "no clear error for a corpus without val-*.bin: $(tail -1 "$TMP/out")"
fi
exit $failed
