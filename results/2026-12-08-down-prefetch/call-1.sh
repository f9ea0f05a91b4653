# Call 1: the down projection's prefetch of the next layer's input projection (ORYX_CUDA_DOWN_PREFETCH, 8 MiB, the
# tensor-core GEMV only: batches of 2-32) as committed (`new`) against main (`base`: built at a65aa96,
# whose code 2b2a7bc changes only in how a default is spelled) and against itself
# at 0, 4 and 12 MiB. `wip` is `new` plus the same prefetch in the single-row GEMV (the down projection at batch
# 1), set by ORYX_X_B1_DPF_MB (0: off): does its code alone slow batch 1, as call 7 of 2026-12-07-mixer-prefetch
# found for the wip there? The GPU tests first; then twice, alternating: 1.4b bf16 mamba2 at 32K, batches 1 and 8;
# then base and new once each way at batches 16 and 32, gdn at batch 8, models/default at 15K, batches 8 and 32.
rm -rf build-gpu/bin build-gpu/base build-gpu/wip
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
for b in base wip; do mkdir -p build-gpu/$b && xz -dc .carry/bin2/oryx-$b.xz > build-gpu/$b/oryx && chmod +x build-gpu/$b/oryx; done
declare -A SETTING=([base]="" [new]="" [d0]="ORYX_CUDA_DOWN_PREFETCH=0" [d4]="ORYX_CUDA_DOWN_PREFETCH=4"
  [d12]="ORYX_CUDA_DOWN_PREFETCH=12" [wip]="" [wip_b1d4]="ORYX_X_B1_DPF_MB=4" [wip_b1d8]="ORYX_X_B1_DPF_MB=8")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() {
  local s=$1; shift
  case $s in base) B=build-gpu/base ;; wip*) B=build-gpu/wip ;; *) B=build-gpu/bin ;; esac
  run $s "$@"; B=build-gpu/bin
}
for rep in 1 2; do
  order="base new d0 d4 d12 wip wip_b1d4 wip_b1d8"
  [[ $rep -eq 2 ]] && order="wip_b1d8 wip_b1d4 wip d12 d4 d0 new base"
  for s in $order; do runs $s --config 1.4b --contexts 32768 --batches 1,8; done
  echo "rep $rep at $(el) s"
done
for s in base new new base; do
  runs $s --config 1.4b --contexts 32768 --batches 16,32
  runs $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
  runs $s --model models/default --contexts 15360 --batches 8,32
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting
tail -3 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
