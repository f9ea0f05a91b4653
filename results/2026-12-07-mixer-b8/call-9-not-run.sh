# Session 76, call 9, NOT RUN (too little device time was left to start a machine). Its oryx: main at 1b89e4d with
# `call-7-wip.diff` applied (the code of call 7's binary). Do call 7's two small gains add
# up? Four threads a state column (ORYX_CUDA_HEAD_MIXER_PARTS=4), MMA_WARPS=12, both, against the default,
# alternating: 1.4b bf16 mamba2 linear batch 8 at 32K three times, gdn twice, fp8 once. No tests (call 7 ran them
# on this code).
rm -rf build-gpu/bin  # (a warm machine keeps the last call's binaries)
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
B=build-gpu/bin
declare -A SETTING=([default]="" [parts4]="ORYX_CUDA_HEAD_MIXER_PARTS=4" [mw12]="ORYX_CUDA_MMA_WARPS=12"
  [both]="ORYX_CUDA_HEAD_MIXER_PARTS=4 ORYX_CUDA_MMA_WARPS=12")
source results/2026-12-07-mixer-b8/run-decode.sh
for rep in 1 2 3; do
  for s in default parts4 mw12 both; do
    run $s --config 1.4b --contexts 32768 --batches 8
    [[ $rep -le 2 ]] && run $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    [[ $rep -le 1 ]] && run $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -5 $OUT/err.txt
