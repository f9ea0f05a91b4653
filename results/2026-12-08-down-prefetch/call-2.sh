# Call 2 (the same machine as call 1, right after it): models/default's linear step at batch 32 was 1.05x slower
# with the down projection's prefetch in call 1. Its size (0-8 MiB; the next input projection is 2.6 MB) at
# batches 8, 16 and 32; 1.4b at 4K, batches 16 and 32 (32K does not fit the H100 there). Twice, alternating.
source .carry/env.sh > /dev/null
declare -A SETTING=([base]="" [new]="" [d0]="ORYX_CUDA_DOWN_PREFETCH=0" [d1]="ORYX_CUDA_DOWN_PREFETCH=1"
  [d2]="ORYX_CUDA_DOWN_PREFETCH=2" [d4]="ORYX_CUDA_DOWN_PREFETCH=4")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2; do
  order="base new d0 d1 d2 d4"; [[ $rep -eq 2 ]] && order="d4 d2 d1 d0 new base"
  for s in $order; do runs $s --model models/default --contexts 15360 --batches 8,16,32; done
  for s in base new d0; do runs $s --config 1.4b --contexts 4096 --batches 16,32; done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -3 $OUT/err.txt
