# Call 1 (not run yet): decode steps in chains (call-1-wip.diff, on main). Backend::DecodeSteps runs n greedy
# steps as one CUDA graph, each step's token the argmax the step before wrote on the device, with one
# synchronisation a chain; `bench decode --chain N` times them, in each mode, beside the usual steps of the
# same point.
# 1. the wip's GPU tests: ops_cuda_test (its Embed test reads tokens from argmax keys too), then
#    cuda_backend_test (the new DecodeStepChainsAreTheStepsOneAtATime first, then all);
# 2. twice, alternating chain lengths: 1.4b bf16 mamba2 at 32K, batches 1 and 8, chains of 8 and of 32;
# 3. models/default at 1K and 15K, batches 1 and 8, chains of 16 (a small model, where the host's share is largest).
# Carried: .carry/bin2/{oryx,cuda_backend_test,ops_cuda_test}-chain.xz, built on the 2-core VM (sm_90a). About
# 4 minutes.
source .carry/env.sh
B=build-gpu/bin
for b in oryx cuda_backend_test ops_cuda_test; do xz -dc .carry/bin2/$b-chain.xz > $B/$b-chain && chmod +x $B/$b-chain; done
timeout 120 $B/ops_cuda_test-chain --gtest_brief=1 > $OUT/call-1-ops-tests.txt 2>&1
echo "ops_cuda_test rc $?"; tail -n 3 $OUT/call-1-ops-tests.txt
timeout 60 $B/cuda_backend_test-chain --gtest_filter='*DecodeStepChains*' > $OUT/call-1-tests.txt 2>&1
echo "chains test rc $?"; grep -E "^\[  (PASSED|FAILED)|Failure" -A3 $OUT/call-1-tests.txt | head -20
timeout 180 $B/cuda_backend_test-chain --gtest_brief=1 >> $OUT/call-1-tests.txt 2>&1
echo "cuda_backend_test rc $? at $(el) s"; tail -n 3 $OUT/call-1-tests.txt
run() {  # ARGS...: one bench decode, its JSON lines appended
  timeout 90 $B/oryx-chain bench decode --device cuda "$@" --steps 20 --prefill-max-attention 0 --json \
    >> $OUT/call-1-decode.jsonl 2>> $OUT/call-1-err.txt
}
for rep in 1 2; do
  order="8 32"; [[ $rep -eq 2 ]] && order="32 8"
  for n in $order; do run --config 1.4b --contexts 32768 --batches 1,8 --chain $n; done
  echo "rep $rep at $(el) s"
done
run --model models/default --contexts 1024,15000 --batches 1,8 --chain 16
python3 - <<'PY'
import json, os
rows = {}
for line in open(os.environ["OUT"] + "/call-1-decode.jsonl"):
    j = json.loads(line)
    if j.get("bench") != "decode" or j.get("next_token") != "device":
        continue
    key = (j["model"], j["mode"], j["context"], j["batch"])
    rows.setdefault(key, []).append(("chain %d" % j["chain"] if "chain" in j else "step",
                                     j["decode_ms_per_step"], j["roofline_fraction"]))
for key, runs in sorted(rows.items()):
    print(*key, " | ".join("%s %.4f ms (%.3f)" % r for r in runs))
PY
tail -n 3 $OUT/call-1-err.txt
echo "done at $(el) s"
