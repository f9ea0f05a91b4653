# Session 77, call 1. Two binaries: `base` is main at dc06dcd; the other is dc06dcd plus call-1-wip.diff:
#   - the state pointers of the verify recurrence and the chunked scan marked global (GlobalPtr), always on;
#   - ORYX_X_STORE: how the head-per-block mixer stores its new state: 0 a generic store (main), 1 st.global,
#     2 st.global with no memory clobber, 3 st.global.cs, 4 into shared memory in place and copied out in 16-byte
#     stores after the keys, 5 the same copy by four TMA bulk copies. A generic store may alias shared memory,
#     so ptxas keeps the next keys' shared-memory loads behind each one;
#   - ORYX_X_MMA_WARPS: the warps an SM the tensor-core GEMV's grid aims at (main: 16).
# The GPU tests of the wip binary (and so dc06dcd's mixer change, on a GPU for the first time), ops_cuda_test
# again with stores 2, 4 and 5, cuda_backend_test with store 4; then alternating, 1.4b linear at 32K, batch 8:
# bf16 mamba2 three times (twice for stores 1 and 3 and MMA_WARPS 12), gdn twice, fp8 once; batches 16 and 32 at 4K once; speculative rounds (k = 4) at 4K,
# batches 1 and 8, base against the wip binary's default, twice.
rm -rf build-gpu/bin build-gpu/base  # (a warm machine keeps the last call's binaries)
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
mkdir -p build-gpu/base && xz -dc .carry/bin2/oryx-base.xz > build-gpu/base/oryx && chmod +x build-gpu/base/oryx
for st in 2 4 5; do
  ORYX_X_STORE=$st timeout 120 $B/ops_cuda_test > $OUT/tests-store$st.txt 2>&1
  echo "ops_cuda_test store $st rc $?: $(grep -c '^\[       OK' $OUT/tests-store$st.txt) ok"
done
for st in 4; do
  ORYX_X_STORE=$st timeout 150 $B/cuda_backend_test > $OUT/tests-backend-store$st.txt 2>&1
  echo "cuda_backend_test store $st rc $?: $(grep -c '^\[       OK' $OUT/tests-backend-store$st.txt) ok at $(el) s"
done
declare -A SETTING=([base]="" [default]="" [st1]="ORYX_X_STORE=1" [st2]="ORYX_X_STORE=2" [st3]="ORYX_X_STORE=3"
  [st4]="ORYX_X_STORE=4" [st5]="ORYX_X_STORE=5" [mw12]="ORYX_X_MMA_WARPS=12")
source results/2026-12-07-mixer-b8/run-decode.sh
runs() { local s=$1; shift; if [[ $s == base ]]; then B=build-gpu/base; else B=build-gpu/bin; fi; run $s "$@"; B=build-gpu/bin; }
for rep in 1 2 3; do
  for s in base default st1 st2 st3 st4 st5 mw12; do
    [[ $rep -eq 3 && ( $s == st1 || $s == st3 || $s == mw12 ) ]] && continue
    runs $s --config 1.4b --contexts 32768 --batches 8
    [[ $rep -le 2 ]] && runs $s --config 1.4b --mixer gdn --contexts 32768 --batches 8
    [[ $rep -le 1 ]] && runs $s --config 1.4b --weights fp8 --contexts 32768 --batches 8
    [[ $rep -le 1 ]] && runs $s --config 1.4b --contexts 4096 --batches 16,32
  done
  echo "rep $rep at $(el) s"
  python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear | grep " 8 "
done
for rep in 1 2; do
  for s in base default; do runs $s --config 1.4b --contexts 4096 --batches 1,8 --spec-k 4; done
done
echo "spec done at $(el) s"
python3 results/2026-12-07-h100-split-norms/print_steps.py setting | grep linear
tail -5 $OUT/err.txt
echo "$T1; $T2 at $(el) s"
