# Session 75, call 6: the head-per-block mixer with two threads a state column (ORYX_CUDA_HEAD_MIXER_SPLIT=2;
# 256 threads a block at head_dim 128, each advancing its column over half the keys, 48 registers) against
# one (the default, now 72 registers: the shared code) and the cluster layout (ORYX_CUDA_HEAD_MIXER_SEQS=0),
# alternating twice: 1.4b bf16 mamba2 and gdn batch 8, fp8 batch 8; models/default (head_dim 64) batch 8 and
# 32 with the head layout allowed there (ORYX_CUDA_HEAD_MIXER_DIM=64). The GPU tests first (all three layouts).
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
declare -A SETTING=([split1]="" [split2]="ORYX_CUDA_HEAD_MIXER_SPLIT=2" [cluster]="ORYX_CUDA_HEAD_MIXER_SEQS=0"
  [d64-split1]="ORYX_CUDA_HEAD_MIXER_DIM=64" [d64-split2]="ORYX_CUDA_HEAD_MIXER_DIM=64 ORYX_CUDA_HEAD_MIXER_SPLIT=2")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do
  for s in split1 split2 cluster; do
    run $s --config 1.4b --contexts 32768 --batches 8
    run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
  done
  for s in d64-split1 d64-split2 cluster; do run $s --model models/default --contexts 15360 --batches 8,32; done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
