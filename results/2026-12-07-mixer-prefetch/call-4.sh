# Call 4 (same binaries, the machine warm): the prefetch before the mixer's wait at batch 1 by size (bf16 and fp8),
# and batch 8's best two sizes again. Twice, alternating.
source .carry/env.sh
pf() { echo "ORYX_X_PF=2 ORYX_X_PF_UP_MB=$1 ORYX_X_PF_AT=1"; }
declare -A SETTING=([gp]="" [up4b]="$(pf 4)" [up8b]="$(pf 8)" [up12b]="$(pf 12)" [up16b]="$(pf 16)" [up24b]="$(pf 24)"
  [up32b]="$(pf 32)" [up48b]="$(pf 48)")
source results/2026-12-07-mixer-b8/run-decode.sh
B=build-gpu/bin
for rep in 1 2; do
  order="gp up8b up16b up24b up32b up48b"; [[ $rep -eq 2 ]] && order="up48b up32b up24b up16b up8b gp"
  for s in $order; do run $s --config 1.4b --contexts 32768 --batches 1; done
  order="gp up4b up8b up12b up16b"; [[ $rep -eq 2 ]] && order="up16b up12b up8b up4b gp"
  for s in $order; do run $s --config 1.4b --weights fp8 --contexts 32768 --batches 1; done
  for s in gp up8b up12b; do run $s --config 1.4b --contexts 32768 --batches 8; done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -3 $OUT/err.txt
