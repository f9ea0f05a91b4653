# Session 77, call 2, NOT RUN (eight tries found no machine; then too little device time was left to start one). Two binaries: `base` is main at dc06dcd; `new` is dc06dcd plus call-2-tree.diff (the
# state, conv-window and KV-row pointers of the decode mixers, the verify recurrence and the chunked scan
# marked global with GlobalPtr: the form call 1 measured as ORYX_X_STORE=2). The GPU tests of `new`; then
# twice, base first then new first: 1.4b linear at 32K, batches 1 and 8 (bf16 mamba2), batches 16 and 32 at 4K;
# once, speculative rounds (k = 4) at 4K, batches 1 and 8.
rm -rf build-gpu/bin build-gpu/base  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
mkdir -p build-gpu/base && xz -dc .carry/bin2/oryx-base.xz > build-gpu/base/oryx && chmod +x build-gpu/base/oryx
declare -A SETTING=([base]="" [new]="")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2; do
  order="base new"; [[ $rep -eq 2 ]] && order="new base"
  for s in $order; do
    runs $s --config 1.4b --contexts 32768 --batches 1,8
    runs $s --config 1.4b --contexts 4096 --batches 16,32
    [[ $rep -eq 1 ]] && runs $s --config 1.4b --contexts 4096 --batches 1,8 --spec-k 4
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
python3 - <<'PY'
import json, os
rounds = {}
for l in open(os.environ["OUT"] + "/decode.jsonl"):
    j = json.loads(l)
    if "round_ms" in j:
        rounds.setdefault((j["batch"], j["rounds_run_by"], j["setting"]), []).append(j["round_ms"])
for k, v in sorted(rounds.items()): print("spec round", *k, " ".join("%.3f" % x for x in v))
PY
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
