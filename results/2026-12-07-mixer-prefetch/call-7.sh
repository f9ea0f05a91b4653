# Call 7 (run in the twentieth session, on an H100). Two binaries: `base` is main at a65aa96 (the
# mixer prefetches the up projection's first 12 MiB); `new` is a65aa96 plus call-7-wip.diff: the output projection
# also asks L2 for the up projection's next ORYX_X_OPF_MB MiB (after the mixer's share), before its wait or
# (ORYX_X_OPF_AFTER=1) after it; and the down projection asks L2 for the next layer's input projection's first
# ORYX_X_DPF_MB MiB (the last layer: the LM head's), before its wait (ORYX_X_DPF_AFTER=1: after); bf16 steps where
# no row attends, at batch 1 (the fused GEMV; the down projection's GemvKernel) and at batches of 2-32 (the
# tensor-core GEMV). Twice, alternating: 1.4b bf16 mamba2 linear at 32K, batches 1 and 8.
# Issue 31's batch-1 target (0.85 of the roofline) needs 1.19 -> about 1.16 ms.
rm -rf build-gpu/bin build-gpu/base
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
mkdir -p build-gpu/base && xz -dc .carry/bin2/oryx-base.xz > build-gpu/base/oryx && chmod +x build-gpu/base/oryx
declare -A SETTING=([base]="" [new]="" [o4]="ORYX_X_OPF_MB=4" [o8]="ORYX_X_OPF_MB=8" [o12]="ORYX_X_OPF_MB=12"
  [o16]="ORYX_X_OPF_MB=16" [o8_after]="ORYX_X_OPF_MB=8 ORYX_X_OPF_AFTER=1" [o16_after]="ORYX_X_OPF_MB=16 ORYX_X_OPF_AFTER=1"
  [d4]="ORYX_X_DPF_MB=4" [d8]="ORYX_X_DPF_MB=8" [d8_after]="ORYX_X_DPF_MB=8 ORYX_X_DPF_AFTER=1"
  [o8_d8]="ORYX_X_OPF_MB=8 ORYX_X_DPF_MB=8")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2; do
  order="base new o4 o8 o12 o16 o8_after o16_after d4 d8 d8_after o8_d8"
  [[ $rep -eq 2 ]] && order="o8_d8 d8_after d8 d4 o16_after o8_after o16 o12 o8 o4 new base"
  for s in $order; do runs $s --config 1.4b --contexts 32768 --batches 1,8; done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -3 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
