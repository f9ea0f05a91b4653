# Calls 4 and 5 began with these lines (inline; their scripts source them here): the machine set up
# (.carry/env.sh), the GPU tests, and the products alone (bench_gemv). Call 6 ran the same lines but bench_gemv's.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
xz -dc .carry/bin2/bench_gemv.xz > build-gpu/bin/bench_gemv && chmod +x build-gpu/bin/bench_gemv
B=build-gpu/bin
timeout 120 $B/ops_cuda_test > $OUT/tests.txt 2>&1; T1="ops_cuda_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok"
timeout 150 $B/cuda_backend_test >> $OUT/tests.txt 2>&1; T2="cuda_backend_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok (both)"
grep -B2 -A12 "Failure" $OUT/tests.txt | head -40
echo "$T1; $T2 at $(el) s"
timeout 60 $B/bench_gemv --config 1.4b --rows 2,3,4,8,16,32 > $OUT/gemm-rows.jsonl 2>> $OUT/err.txt
echo "gemv done at $(el) s"
