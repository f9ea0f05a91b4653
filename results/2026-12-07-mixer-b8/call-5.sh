# Session 75, call 5: the tree with the new defaults -- batch steps of models whose head_dim is 128 run the
# mixer a head per block, asking for the least shared-memory split that holds a block
# (ORYX_CUDA_HEAD_MIXER_CARVEOUT=0; call 4: 1.485-1.500 ms against the cluster layout's 1.583-1.585 at 1.4b bf16
# batch 8). The GPU tests; then default against cluster (ORYX_CUDA_HEAD_MIXER_SEQS=0), alternating twice:
# 1.4b mamba2 bf16 batch 1 and 8, fp8 batch 8, gdn bf16 batch 8; models/default (head_dim 64: the cluster
# layout either way) batch 8 and 32; head1: the new layout at batch 1 too.
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([default]="" [cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=0" [head1]="ORYX_CUDA_HEAD_MIXER_SEQS=1")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in default cluster; do
    run $s --config 1.4b --contexts 32768 --batches 1,8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    run $s --model models/default --contexts 15360 --batches 8,32
  done
  run head1 --config 1.4b --contexts 32768 --batches 1
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
