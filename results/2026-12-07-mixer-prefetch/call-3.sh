# Call 3 (same binaries, the machine warm): the up projection's prefetch issued before the mixer's wait, by size;
# batches 1, 8, 16 and 32; gdn and fp8 at batch 8; cuda_backend_test with the prefetch on.
source .carry/env.sh
declare -A SETTING=([gp]="" [up4b]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=4 ORYX_X_PF_AT=1"
  [up8b]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=8 ORYX_X_PF_AT=1" [up12b]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=12 ORYX_X_PF_AT=1"
  [up16b]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=16 ORYX_X_PF_AT=1" [up24b]="ORYX_X_PF=2 ORYX_X_PF_UP_MB=24 ORYX_X_PF_AT=1")
source results/2026-12-07-mixer-b8/run-decode.sh
B=build-gpu/bin
ORYX_X_PF=2 ORYX_X_PF_UP_MB=8 ORYX_X_PF_AT=1 timeout 150 $B/cuda_backend_test > $OUT/tests-prefetch.txt 2>&1
echo "cuda_backend_test (prefetch on) rc $?: $(grep -c '^\[       OK' $OUT/tests-prefetch.txt) ok at $(el) s"
for rep in 1 2; do
  order="gp up4b up8b up12b up16b up24b"; [[ $rep -eq 2 ]] && order="up24b up16b up12b up8b up4b gp"
  for s in $order; do run $s --config 1.4b --contexts 32768 --batches 8; done
  for s in gp up8b up16b; do
    run $s --config 1.4b --contexts 32768 --batches 1
    run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    run $s --config 1.4b --contexts 4096 --batches 16,32
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -3 $OUT/err.txt
