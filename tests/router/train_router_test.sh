#!/usr/bin/env bash
# `oryx train-router` end to end at a tiny scale, on a small random-weight model with the bundled model's
# tokenizer (the pipeline is under test, not the policy's quality; the bundled 29M model would take CI
# minutes): a two-lambda sweep writes one policy file per lambda and a log, the files load in `oryx generate
# --policy learned:FILE`, a resumed run skips the lambdas already done and trains the rest, a run with draft
# lengths trains a draft head and evaluates on held-out examples, and bad input is one clear error.
#   train_router_test.sh PATH_TO_ORYX PATH_TO_WRITE_RANDOM_MODEL SOURCE_DIR
set -u
ORYX="$1"
WRITE_RANDOM="$2"
SRC="$3"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
M="$TMP/model"
"$WRITE_RANDOM" "$M" "$SRC/models/default" 3 d_model=128 n_layers=2 n_heads=2 head_dim=64 mlp_hidden=256 \
  max_position=2048 || { echo "FAIL: could not write the random model"; exit 1; }
SHARD=$(ls "$M"/*.safetensors | head -1)
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
# Resumed again, a finished run says so and trains nothing.
"$ORYX" train-router "${TINY[@]}" --out "$TMP/r.safetensors" --lambda 0.5,1 --iterations 1 --resume 2>"$TMP/err" ||
  { fail "a finished run resumed"; cat "$TMP/err"; }
grep -q 'nothing to resume' "$TMP/err" || fail "a finished run resumed without saying that nothing is left"
grep -q 'counterfactual episodes' "$TMP/err" && fail "a finished run resumed collected counterfactuals again"
# What a lambda trains depends on the seed and the lambda, not on its place in --lambda: lambda 1 alone gives
# the same policy file as lambda 1 second, resumed.
# (The tensors are compared: the metadata holds the iterations' timings.)
"$ORYX" train-router "${TINY[@]}" --out "$TMP/one.safetensors" --lambda 1 --iterations 1 2>/dev/null || fail "lambda 1 alone"
python3 - "$TMP/one.safetensors" "$TMP/r-lambda1.safetensors" <<'PY' || fail "lambda 1 trained alone differs from lambda 1 trained second"
import json, struct, sys
def tensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header, data = json.loads(b[8:8 + n]), b[8 + n:]
    return {k: data[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items() if k != "__metadata__"}
sys.exit(0 if tensors(sys.argv[1]) == tensors(sys.argv[2]) else 1)
PY

# Validation: a line per check (the warm start and each iteration), and the policy file keeps the network of
# the first check with the highest reward, and says which.
# (Its prompts end in a finer tail, which the file records.)
"$ORYX" train-router "${TINY[@]}" --out "$TMP/v.safetensors" --lambda 1 --iterations 2 --validation-examples 1 \
  --segment-tail 16 2>"$TMP/err" || { fail "train-router --validation-examples exited $?"; cat "$TMP/err"; }
grep -q 'lambda 1 keeps the network after' "$TMP/err" || fail "no line saying which network was kept"
python3 - "$TMP/v.safetensors.log.jsonl" "$TMP/v.safetensors" <<'PY' || fail "the kept network is not validation's best"
import json, struct, sys
checks = [r for r in map(json.loads, open(sys.argv[1])) if r.get("phase") == "validation"]
assert [r["iteration"] for r in checks] == [0, 1, 2], checks
best = max(range(3), key=lambda i: (checks[i]["reward"], -i))
with open(sys.argv[2], "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
meta = json.loads(header["__metadata__"]["oryx.router_policy"])
assert (meta["segment_len"], meta["tail_len"]) == (64, 16), meta
training = meta["training"]
assert training["validation"]["kept_iteration"] == best, (training["validation"], checks)
assert abs(training["validation"]["reward"] - checks[best]["reward"]) < 1e-12
PY

# --warm-tail: the rule tail:N is a fourth counterfactual base, so the same warm start runs more episodes (the
# tail base and one flip per decision of it) and logs the base's quality and cost.
"$ORYX" train-router "${TINY[@]}" --out "$TMP/wt.safetensors" --lambda 1 --iterations 0 --segment-tail 16 \
  --warm-tail 2>"$TMP/err" || { fail "train-router --warm-tail exited $?"; cat "$TMP/err"; }
python3 - "$TMP/v.safetensors.log.jsonl" "$TMP/wt.safetensors.log.jsonl" <<'PY' || fail "--warm-tail adds no base"
import json, sys
v, wt = ([r for r in map(json.loads, open(p)) if r.get("phase") == "counterfactual"][0] for p in sys.argv[1:])
assert "tail_quality" not in v and 0 <= wt["tail_quality"] <= 1 and wt["tail_cost"] > 0, (v, wt)
assert wt["examples"] == v["examples"] and wt["episodes"] > v["episodes"], (v["episodes"], wt["episodes"])
PY

# --warm-imitate: the warm start learns each example's best tail rule (of tails 16, 32, 64 and 128 here) and
# runs no flipped episodes, so it has fewer episodes than --warm-tail's and, given the steps, follows its
# prefill labels closely.
"$ORYX" train-router "${TINY[@]}" --out "$TMP/wi.safetensors" --lambda 1 --iterations 0 --segment-tail 16 \
  --warm-tail --warm-imitate --warm-steps 300 2>"$TMP/err" || { fail "train-router --warm-imitate exited $?"; cat "$TMP/err"; }
python3 - "$TMP/wt.safetensors.log.jsonl" "$TMP/wi.safetensors.log.jsonl" <<'PY' || fail "--warm-imitate does not imitate"
import json, sys
(wt, wt_warm), (wi, wi_warm) = ([[r for r in recs if r.get("phase") == p][0] for p in ("counterfactual", "warm_start")]
                                for recs in ([json.loads(l) for l in open(path)] for path in sys.argv[1:]))
assert wi["warm_start"] == "imitation" and "warm_start" not in wt, (wi, wt)
assert wi["flips_that_helped"] + wi["flips_that_hurt"] == 0 and wi["episodes"] < wt["episodes"], (wi, wt)
assert [t["tail"] for t in wi["imitation_tails"]] == [16, 32, 64, 128], wi
assert wi["imitation_tails"][0]["quality"] == wi["tail_quality"], wi
assert 0 < wi_warm["prefill_labels"]["attention_label_share"] < 1, wi_warm
assert wi_warm["prefill_labels"]["agreement"] >= 0.9, wi_warm
PY

# --warm-margins: the same episodes, labelled band by band along each example's chain of schedules by the
# reward margins between neighbours, the decode decisions among them (all-linear against prefill-linear).
"$ORYX" train-router "${TINY[@]}" --out "$TMP/wm.safetensors" --lambda 1 --iterations 0 --segment-tail 16 \
  --warm-tail --warm-imitate --warm-margins --warm-steps 300 2>"$TMP/err" ||
  { fail "train-router --warm-margins exited $?"; cat "$TMP/err"; }
python3 - "$TMP/wi.safetensors.log.jsonl" "$TMP/wm.safetensors.log.jsonl" <<'PY' || fail "--warm-margins labels wrong"
import json, sys
(wi, wi_warm), (wm, wm_warm) = ([[r for r in recs if r.get("phase") == p][0] for p in ("counterfactual", "warm_start")]
                                for recs in ([json.loads(l) for l in open(path)] for path in sys.argv[1:]))
assert wm["warm_start"] == "imitation-margins" and wm["episodes"] == wi["episodes"], (wm, wi)
assert wm["imitation_tails"] == wi["imitation_tails"], (wm, wi)
# Each decision switches to attention once along the chain, so it is labelled once, as imitation labels it;
# the weights are the margins', not imitation's uniform ones.
for part in ("prefill_labels", "decode_labels"):
    assert wm_warm[part]["labels"] == wi_warm[part]["labels"] > 0, (part, wm_warm, wi_warm)
uniform = wm_warm["decode_labels"]["labels"] / wm_warm["labels"]
assert abs(wi_warm["decode_labels"]["weight_share"] - uniform) < 1e-6, wi_warm
assert abs(wm_warm["decode_labels"]["weight_share"] - uniform) > 1e-3, wm_warm
PY

# The validation front: one file per network on it, each named in the lambda's policy file, none dominated by
# another on validation; --eval-only --validation-front compares them too.
"$ORYX" train-router "${TINY[@]}" --out "$TMP/f.safetensors" --lambda 0.05 --iterations 3 --validation-examples 2 \
  --validation-front 2>"$TMP/err" || { fail "train-router --validation-front exited $?"; cat "$TMP/err"; }
python3 - "$TMP/f.safetensors" <<'PY' || fail "the validation front's files or their points are wrong"
import json, os, struct, sys
def meta(path):
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return json.loads(header["__metadata__"]["oryx.router_policy"])["training"]
front = meta(sys.argv[1])["validation"]["front"]
assert front, "an empty front"
for p in front:
    assert not any(q["quality"] >= p["quality"] and q["cost"] <= p["cost"] for q in front if q is not p), front
    point = meta(sys.argv[1].replace(".safetensors", "-iter%d.safetensors" % p["iteration"]))
    assert point["iteration"] == p["iteration"] and point["validation_quality"] == p["quality"], point
PY
"$ORYX" train-router "${TINY[@]}" --out "$TMP/f.safetensors" --lambda 0.05 --eval-only --eval-examples 1 \
  --validation-front 2>"$TMP/err" || { fail "--eval-only --validation-front"; cat "$TMP/err"; }
# (Without --log, the comparison goes after the training's lines in the run's log, which it keeps.)
grep -q '"policy":"learned lambda 0.05 iter ' "$TMP/f.safetensors.log.jsonl" || fail "the front was not compared"
grep -q '"phase":"reinforce"' "$TMP/f.safetensors.log.jsonl" || fail "--eval-only erased the training's log"

# Speculation as an action: text episodes, a draft head over lengths 0 and 2, the bytes cost, and the
# held-out comparison at the end (2 tasks x 8 policies: attention, linear, prefill-linear, the default rules
# budget:0.1 and match:8, speculative:2, prefill-linear+speculative:2, the learned one), the mixed workload and
# the Pareto check.
"$ORYX" train-router --model "$M" --haystack "$SRC"/tests/data/default_model/val-*.txt --tasks text niah --lengths 128 \
  --continuation 8 --draft-lengths 0,2 --cost bytes --lambda 1 --warm-examples 2 --warm-steps 20 --iterations 1 \
  --batch 2 --samples 2 --eval-examples 2 --threads 2 --out "$TMP/s.safetensors" 2>"$TMP/err" ||
  { fail "train-router with draft lengths exited $?"; cat "$TMP/err"; }
grep -q '"prefill_linear_by_draft_length"' "$TMP/s.safetensors.log.jsonl" || fail "no draft-length counterfactuals"
# The warm start reports how closely it follows its prefill and decode labels (text episodes decode).
python3 - "$TMP/s.safetensors.log.jsonl" <<'PY' || fail "the warm start's label agreement is missing or out of [0, 1]"
import json, sys
warm = [r for r in map(json.loads, open(sys.argv[1])) if r.get("phase") == "warm_start"]
assert warm, "no warm_start line"
for part in ("prefill_labels", "decode_labels"):
    p = warm[0][part]
    assert p["labels"] > 0 and 0 <= p["agreement"] <= 1 and 0 <= p["weighted_agreement"] <= 1, (part, p)
PY
[[ $(grep -c '"phase":"eval"' "$TMP/s.safetensors.log.jsonl") -eq 16 ]] || fail "expected 16 eval log lines"
grep -q '"task":"text","policy":"speculative:2"' <(sed 's/"acceptance":[^,]*,//' "$TMP/s.safetensors.log.jsonl" |
  python3 -c 'import json,sys
for l in sys.stdin:
    r=json.loads(l)
    if r.get("phase")=="eval": print(json.dumps({"task":r["task"],"policy":r["policy"]},separators=(",",":")))') ||
  fail "no eval line for speculative:2 on text"
grep -q '"policy":"prefill-linear+speculative:2"' "$TMP/s.safetensors.log.jsonl" ||
  fail "no eval line for the rule prefill-linear+speculative:2"
[[ $(grep -c '"phase":"eval_mixed"' "$TMP/s.safetensors.log.jsonl") -eq 8 ]] || fail "expected 8 eval_mixed log lines"
[[ $(grep -c '"phase":"pareto"' "$TMP/s.safetensors.log.jsonl") -eq 7 ]] || fail "expected a pareto line per rule"
grep -q 'rules dominated by a learned policy' "$TMP/err" || fail "no Pareto summary"
# Each policy that dominates or ties a rule comes with its margins: the paired quality gain is the difference
# of the two mixed means (the same examples, the tasks alike), with a standard error; the cost saving is the
# difference of the costs, not negative.
python3 - "$TMP/s.safetensors.log.jsonl" <<'PY' || fail "the Pareto margins do not match the eval_mixed lines"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
mixed = {r["policy"]: r for r in rows if r.get("phase") == "eval_mixed"}
for p in (r for r in rows if r.get("phase") == "pareto"):
    named = {m["policy"]: m for m in p["margins"]}
    assert sorted(named) == sorted(p["dominated_by"] + p["tied_by"]), p
    rule = mixed[p["rule"]]
    for name, m in named.items():
        assert abs(m["quality_gain"] - (mixed[name]["quality"] - rule["quality"])) < 1e-9, (p["rule"], m)
        assert abs(m["cost_saving"] - (rule["cost"] - mixed[name]["cost"])) < 1e-9, (p["rule"], m)
        assert m["cost_saving"] >= 0 and math.isfinite(m["quality_gain_error"]) and m["quality_gain_error"] >= 0, m
PY
# --eval-only: the same comparison from the finished run's file, with other rules; nothing trained.
"$ORYX" train-router --model "$M" --haystack "$SRC"/tests/data/default_model/val-*.txt --tasks text niah --lengths 128 \
  --continuation 8 --draft-lengths 0,2 --cost bytes --lambda 1 --eval-examples 2 --eval-rules entropy:1,random:0.5 \
  --threads 2 --out "$TMP/s.safetensors" --eval-only --log "$TMP/only.jsonl" 2>"$TMP/err" ||
  { fail "train-router --eval-only exited $?"; cat "$TMP/err"; }
grep -q '"phase":"reinforce"\|"phase":"counterfactual"' "$TMP/only.jsonl" && fail "--eval-only trained"
[[ $(grep -c '"phase":"eval"' "$TMP/only.jsonl") -eq 16 ]] || fail "--eval-only: expected 16 eval log lines"
grep -q '"policy":"random:0.5"' "$TMP/only.jsonl" || fail "--eval-only: no line for the rule random:0.5"
head -c 4096 "$TMP/s.safetensors" | grep -aq '"draft.weight"' || fail "the policy file has no draft head"
"$ORYX" generate --model "$M" --prompt "int main" --max-tokens 8 --policy "learned:$TMP/s.safetensors" >/dev/null \
  2>"$TMP/err" || { fail "generate with the speculating policy"; cat "$TMP/err"; }

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
bad "one draft length" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --draft-lengths 3
bad "a draft length twice" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --draft-lengths 0,2,2
bad "unknown cost" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --cost money
bad "unknown rule" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --eval-rules budget:2
bad "eval-only without its files" train-router "${TINY[@]}" --out "$TMP/none.safetensors" --eval-only --eval-examples 1
bad "eval-only without examples" train-router "${TINY[@]}" --out "$TMP/s.safetensors" --eval-only
bad "a validation front without validation" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --validation-front
bad "a tail base without a tail" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --warm-tail
bad "imitation without the tail base" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --segment-tail 16 \
  --warm-imitate
bad "margins without imitation" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --segment-tail 16 --warm-tail \
  --warm-margins
bad "a tail as long as a segment" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --segment-len 32 --segment-tail 32
bad "eval-only in other segments" train-router "${TINY[@]}" --out "$TMP/v.safetensors" --lambda 1 --eval-only --eval-examples 1
bad "resume in other segments" train-router "${TINY[@]}" --out "$TMP/r.safetensors" --lambda 0.5,1 --iterations 1 \
  --resume --segment-tail 16
bad "unknown device" train-router "${TINY[@]}" --out "$TMP/x.safetensors" --device tpu
bad "missing policy file" generate --model "$M" --prompt hi --policy "learned:$TMP/none.safetensors"
head -c 200 "$TMP/p-lambda2.safetensors" >"$TMP/cut.safetensors"
bad "truncated policy file" generate --model "$M" --prompt hi --policy "learned:$TMP/cut.safetensors"
bad "a checkpoint shard as policy" generate --model "$M" --prompt hi --policy "learned:$SHARD"

[[ $failed -eq 0 ]] && echo "train_router_test: all checks passed"
[[ $failed -eq 0 ]]
