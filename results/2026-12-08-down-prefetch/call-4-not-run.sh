# Call 4, NOT RUN: the twentieth session's device time ran out on tries that found no machine. The tree as
# committed (4e0fc25: the prefetch at batches of 2-8 only) against main before this session (`base`, as in call 1).
# The GPU tests first; then twice, alternating: 1.4b bf16 mamba2 at 32K, batches 1 and 8, and at 4K, batches 16
# and 32. Then `wip`, 4e0fc25 plus call-4-wip.diff, whose experiments are set by environment variables:
# - ORYX_X_FP8_PF_MB: the mixer's prefetch of the up projection with FP8 weights at batch 1 (run here, at 4 MiB);
# - ORYX_X_UP_PF_MB: the up projection asking L2 for the down projection's first MiB, batches of 2-8, bf16 (run
#   here at batch 8, 4 and 8 MiB);
# - ORYX_X_FP8_DPF_MB: the down projection's prefetch with FP8 weights at batches of 2-8 (not run here).
# Each twice, alternating. Last, the event profiles of FP8's and bf16's batch-1 linear steps.
rm -rf build-gpu/bin build-gpu/base build-gpu/wip
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
for b in base wip; do mkdir -p build-gpu/$b && xz -dc .carry/bin2/oryx-$b.xz > build-gpu/$b/oryx && chmod +x build-gpu/$b/oryx; done
declare -A SETTING=([base]="" [new]="" [wip]="" [wip_pf4]="ORYX_X_FP8_PF_MB=4" [wip_up4]="ORYX_X_UP_PF_MB=4"
  [wip_up8]="ORYX_X_UP_PF_MB=8")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() {
  local s=$1; shift
  case $s in base) B=build-gpu/base ;; wip*) B=build-gpu/wip ;; *) B=build-gpu/bin ;; esac
  run $s "$@"; B=build-gpu/bin
}
for rep in 1 2; do
  order="base new"; [[ $rep -eq 2 ]] && order="new base"
  for s in $order; do
    runs $s --config 1.4b --contexts 32768 --batches 1,8
    runs $s --config 1.4b --contexts 4096 --batches 16,32
  done
  echo "rep $rep at $(el) s"
done
for s in wip wip_pf4 wip_pf4 wip; do runs $s --config 1.4b --weights fp8 --contexts 32768 --batches 1; done
for s in wip wip_up4 wip_up8 wip_up8 wip_up4 wip; do runs $s --config 1.4b --contexts 32768 --batches 8; done
# Where FP8's batch-1 step goes (issue 31 asks 0.6 ms on the H200): the event profile (every op timed, graphs off)
# of the linear step, bf16 beside it.
for w in fp8 bf16; do
  ORYX_CUDA_PROFILE=1 timeout 90 $B/oryx bench decode --device cuda --config 1.4b --weights $w --contexts 32768 \
    --batches 1 --steps 20 --prefill-max-attention 0 --json > /dev/null 2> $OUT/profile-b1-$w.txt
  grep -A12 "linear, batch 1" $OUT/profile-b1-$w.txt
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -3 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
