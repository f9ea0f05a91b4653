# Call 1. Two binaries: `base` is main at dc06dcd (58736cc adds only a static_assert); `new` is 58736cc plus
# ../2026-12-07-mixer-stores/call-2-tree.diff (the state pointers marked global) and call-1-wip.diff here (the
# decode mixer asks L2 to prefetch the next products' weights, ORYX_X_PF bits 0-1; bit 2: the batch mixer's state
# stores with an L2 evict_first hint). The GPU tests of `new`; then twice,
# in alternating order: 1.4b bf16 mamba2 linear at 32K, batches 1 and 8, for each setting; base and gp at
# batches 16 and 32 (4K); fp8 at 32K, batches 1 and 8, for base, o, o_up8 and o_up8_ef.
rm -rf build-gpu/bin build-gpu/base  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
mkdir -p build-gpu/base && xz -dc .carry/bin2/oryx-base.xz > build-gpu/base/oryx && chmod +x build-gpu/base/oryx
declare -A SETTING=([base]="" [gp]="" [o]="ORYX_X_PF=1" [o_before]="ORYX_X_PF=1 ORYX_X_PF_AT=1"
  [o_up8]="ORYX_X_PF=3 ORYX_X_PF_UP_MB=8" [o_up24]="ORYX_X_PF=3 ORYX_X_PF_UP_MB=24" [up8]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=8"
  [ef]="ORYX_X_PF=4" [o_up8_ef]="ORYX_X_PF=7 ORYX_X_PF_UP_MB=8")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2; do
  order="base gp o o_before o_up8 o_up24 up8 ef o_up8_ef"; [[ $rep -eq 2 ]] && order="o_up8_ef ef up8 o_up24 o_up8 o_before o gp base"
  for s in $order; do runs $s --config 1.4b --contexts 32768 --batches 1,8; done
  for s in base gp; do runs $s --config 1.4b --contexts 4096 --batches 16,32; done
  for s in base o o_up8 o_up8_ef; do runs $s --config 1.4b --weights fp8 --contexts 32768 --batches 1,8; done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
