# Call 6 (the binary of call 5, the machine warm; run inline as one command line): the prefetch's size, 8, 12 and
# 16 MiB, three passes alternating, 1.4b bf16 mamba2 linear at 32K, batches 1 and 8.
source .carry/env.sh >/dev/null 2>&1
declare -A SETTING=([p8]="" [p12]="ORYX_CUDA_MIXER_PREFETCH=12" [p16]="ORYX_CUDA_MIXER_PREFETCH=16")
source results/2026-12-07-mixer-b8/run-decode.sh; B=build-gpu/bin
for rep in 1 2 3; do for s in p8 p12 p16; do run $s --config 1.4b --contexts 32768 --batches 1,8; done; done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
cp $OUT/decode.jsonl $OUT/call-6-decode.jsonl
