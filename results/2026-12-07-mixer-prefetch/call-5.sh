# Call 5: the tree as committed (the state pointers marked global, and the mixer's prefetch of the up projection's
# first 8 MiB, ORYX_CUDA_MIXER_PREFETCH) against main at dc06dcd (`base`), and against itself with the prefetch off
# (`off`). The GPU tests first; then twice, alternating: 1.4b at 32K, batches 1 and 8 (bf16 mamba2; both modes);
# models/default at 15K, batches 8 and 32.
rm -rf build-gpu/bin build-gpu/base
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
mkdir -p build-gpu/base && xz -dc .carry/bin2/oryx-base.xz > build-gpu/base/oryx && chmod +x build-gpu/base/oryx
declare -A SETTING=([base]="" [new]="" [off]="ORYX_CUDA_MIXER_PREFETCH=0")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2; do
  order="base new off"; [[ $rep -eq 2 ]] && order="off new base"
  for s in $order; do
    runs $s --config 1.4b --contexts 32768 --batches 1,8
    runs $s --model models/default --contexts 15360 --batches 8,32
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
tail -3 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
