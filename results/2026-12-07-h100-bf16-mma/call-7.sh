# Session 72, call 7: ops_cuda_test after its FP8 exact-code check became a shared helper.
source .carry/env.sh
timeout 120 build-gpu/bin/ops_cuda_test > $OUT/tests.txt 2>&1; echo "ops_cuda_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok"
grep -B2 -A12 "Failure" $OUT/tests.txt | head -40; grep "^\[       OK" $OUT/tests.txt | grep -i "fp8\|mma\|Gemm"
