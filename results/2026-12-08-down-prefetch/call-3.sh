# Call 3 (the same machine, right after call 2; run inline): 1.4b at 32K, batches 2 and 4, with the down
# projection's prefetch at 8 MiB (`new`) and off (`d0`), twice, alternating.
source .carry/env.sh > /dev/null; B=build-gpu/bin; declare -A SETTING=([new]="" [d0]="ORYX_CUDA_DOWN_PREFETCH=0")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2; do for s in new d0; do run $s --config 1.4b --contexts 32768 --batches 2,4; done; done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
