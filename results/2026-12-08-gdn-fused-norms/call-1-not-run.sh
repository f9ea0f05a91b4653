# Call 1 (not run yet): GDN's q and k norms inside the chunk operands' kernel and its state passing split over
# the state's columns (call-1-wip.diff, on main at 3b91830). In order, most needed first:
# 1. train_cuda_test of the wip, with the state passing whole and split (ORYX_TRAIN_GDN_STATE_SPLITS=1, 2);
# 2. the 205M config at sequence 2048, batch 24, with the CUDA graph: GDN on main, on the wip whole and on the
#    wip split, alternating, twice;
# 3. a 3-step profile of GDN at batch 8 without the graph: main, the wip whole and split;
# 4. Mamba-2 once on each tree (the chunk operands' kernel, its loop changed for the norms, serves it too).
# Carried: .carry/bin2/{oryx-torch-base,oryx-torch-gdn,train_cuda_test}.xz, built on the 2-core VM (sm_90a)
# from main at 3b91830 and from main + the diff. About 7 minutes.
source .carry/env.sh
export LD_LIBRARY_PATH=$(python3 -c 'import os,torch;print(os.path.join(os.path.dirname(torch.__file__),"lib"))'):$LD_LIBRARY_PATH
mkdir -p build-gpu/base build-gpu/gdn
xz -dc .carry/bin2/oryx-torch-base.xz > build-gpu/base/oryx-torch
xz -dc .carry/bin2/oryx-torch-gdn.xz > build-gpu/gdn/oryx-torch
xz -dc .carry/bin2/train_cuda_test.xz > build-gpu/bin/train_cuda_test
chmod +x build-gpu/base/oryx-torch build-gpu/gdn/oryx-torch build-gpu/bin/train_cuda_test
build-gpu/gdn/oryx-torch --version | head -n 2 || { echo "the carried oryx-torch does not run here"; exit 1; }
for splits in 1 2; do
  ORYX_TRAIN_GDN_STATE_SPLITS=$splits build-gpu/bin/train_cuda_test --gtest_brief=1 > $OUT/call-1-train_cuda_test-$splits.log 2>&1
  echo "train_cuda_test (splits $splits) rc $? at $(el) s"; tail -n 3 $OUT/call-1-train_cuda_test-$splits.log
done
build-gpu/bin/oryx data prepare --out data/inc --input-dir /usr/include --tokenizer models/default/tokenizer.model \
  --max-tokens 4000000 > /dev/null 2>&1 || { echo "corpus failed"; exit 1; }
echo "corpus at $(el) s"
rate() {  # TAG TREE SPLITS RUN: one JSON line into call-1-rates.jsonl
  ORYX_TRAIN_GDN_STATE_SPLITS=$3 bench/train_throughput.sh build-gpu/$2/oryx-torch data/inc out/tt-$1 "$4" \
    | sed "s/^{/{\"tree\": \"$1\", /" | tee -a $OUT/call-1-rates.jsonl
}
for rep in 1 2; do
  rate base base 1 "205m:24:on:--mixer gdn"
  rate wip-split gdn 2 "205m:24:on:--mixer gdn"
  rate wip gdn 1 "205m:24:on:--mixer gdn"
done
echo "gdn rates at $(el) s"
profile() {  # TAG TREE SPLITS
  ORYX_TRAIN_GDN_STATE_SPLITS=$3 STEPS=8 ORYX_PROFILE_TRACE=out/trace-$1.json bench/train_throughput.sh \
    build-gpu/$2/oryx-torch data/inc out/prof-$1 "205m:8:off:--mixer gdn" > /dev/null
  python3 bench/summarize_trace.py out/trace-$1.json --by kernel --top 200 > $OUT/call-1-profile-$1-kernel.txt
  python3 bench/summarize_trace.py out/trace-$1.json --by op --top 200 > $OUT/call-1-profile-$1-op.txt
  head -n 14 $OUT/call-1-profile-$1-kernel.txt
}
profile base base 1
profile wip gdn 1
profile wip-split gdn 2
for tag in wip wip-split; do  # where the time moved, against main
  python3 bench/compare_profiles.py $OUT/call-1-profile-base-kernel.txt $OUT/call-1-profile-$tag-kernel.txt --top 16
done
echo "profiles at $(el) s"
rate base base 1 "205m:24:on"
rate wip gdn 1 "205m:24:on"
echo "done at $(el) s"
