# Call 2 (same binaries as call 1, the machine warm): how many MiB of the up projection the batch mixer should ask
# L2 for. Twice, alternating: 1.4b linear at 32K, batch 8 (and 1), bf16 mamba2; then gdn and fp8 at batch 8.
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh > /dev/null 2>&1 || true
source .carry/env.sh
declare -A SETTING=([base]="" [gp]="" [up4]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=4" [up8]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=8"
  [up12]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=12" [up16]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=16" [up24]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=24"
  [up8_from8]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=8 ORYX_X_PF_UP_FROM=8" [up8_ef]="ORYX_X_PF=6 ORYX_X_PF_UP_MB=8"
  [up8_before]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=8 ORYX_X_PF_AT=1")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2; do
  order="base gp up4 up8 up12 up16 up24 up8_from8 up8_ef up8_before"
  [[ $rep -eq 2 ]] && order="up8_before up8_ef up8_from8 up24 up16 up12 up8 up4 gp base"
  for s in $order; do runs $s --config 1.4b --contexts 32768 --batches 8; done
  for s in base up8 up16; do runs $s --config 1.4b --mixer gdn --contexts 32768 --batches 8; runs $s --config 1.4b --weights fp8 --contexts 32768 --batches 8; done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -3 $OUT/err.txt
