# Call 1 (not run yet): GDN's q and k norms inside the chunk operands' kernel (call-1-wip.diff, on main at
# 3b91830). In order: train_cuda_test of the wip tree; the 205M config at sequence 2048, batch 24, with the
# CUDA graph, GDN on main and on the wip alternating twice, then Mamba-2 once each (the kernel's loop, changed
# for the norms' shuffles, serves Mamba-2 too); a 3-step profile of each tree's GDN at batch 8 without the graph.
# Carried: .carry/bin2/{oryx-torch-base,oryx-torch-gdn,train_cuda_test}.xz, built on the 2-core VM (sm_90a)
# from main at 3b91830 and from main + the diff. The call takes about 6 minutes.
source .carry/env.sh
export LD_LIBRARY_PATH=$(python3 -c 'import os,torch;print(os.path.join(os.path.dirname(torch.__file__),"lib"))'):$LD_LIBRARY_PATH
mkdir -p build-gpu/base build-gpu/gdn
xz -dc .carry/bin2/oryx-torch-base.xz > build-gpu/base/oryx-torch
xz -dc .carry/bin2/oryx-torch-gdn.xz > build-gpu/gdn/oryx-torch
xz -dc .carry/bin2/train_cuda_test.xz > build-gpu/bin/train_cuda_test
chmod +x build-gpu/base/oryx-torch build-gpu/gdn/oryx-torch build-gpu/bin/train_cuda_test
build-gpu/gdn/oryx-torch --version | head -n 2 || { echo "the carried oryx-torch does not run here"; exit 1; }
build-gpu/bin/train_cuda_test --gtest_brief=1 > $OUT/call-1-train_cuda_test.log 2>&1
echo "train_cuda_test rc $? at $(el) s"; tail -n 4 $OUT/call-1-train_cuda_test.log
build-gpu/bin/oryx data prepare --out data/inc --input-dir /usr/include --tokenizer models/default/tokenizer.model \
  --max-tokens 4000000 > /dev/null 2>&1 || { echo "corpus failed"; exit 1; }
echo "corpus at $(el) s"
rate() {  # TREE RUN: one JSON line into rates.jsonl, tagged with the tree
  bench/train_throughput.sh build-gpu/$1/oryx-torch data/inc out/tt-$1 "$2" | sed "s/^{/{\"tree\": \"$1\", /" \
    | tee -a $OUT/call-1-rates.jsonl
}
for rep in 1 2; do
  rate base "205m:24:on:--mixer gdn"
  rate gdn "205m:24:on:--mixer gdn"
done
echo "gdn rates at $(el) s"
rate base "205m:24:on"
rate gdn "205m:24:on"
echo "mamba2 rates at $(el) s"
for tree in base gdn; do
  STEPS=8 ORYX_PROFILE_TRACE=out/trace-$tree.json bench/train_throughput.sh build-gpu/$tree/oryx-torch data/inc \
    out/prof-$tree "205m:8:off:--mixer gdn" > /dev/null
  python3 bench/summarize_trace.py out/trace-$tree.json --by kernel --top 40 > $OUT/call-1-profile-$tree-kernel.txt
  python3 bench/summarize_trace.py out/trace-$tree.json --by op --top 40 > $OUT/call-1-profile-$tree-op.txt
  head -n 12 $OUT/call-1-profile-$tree-kernel.txt
done
echo "done at $(el) s"
