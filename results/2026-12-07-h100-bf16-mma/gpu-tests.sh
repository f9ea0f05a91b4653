# Calls 4-6 and 10 began with these lines (inline; their scripts source them here): the machine set up
# (.carry/env.sh) and the GPU tests.
source .carry/env.sh
export ORYX_GIT_REVISION=$(cat .carry/rev)
B=build-gpu/bin
timeout 120 $B/ops_cuda_test > $OUT/tests.txt 2>&1; T1="ops_cuda_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok"
timeout 150 $B/cuda_backend_test >> $OUT/tests.txt 2>&1; T2="cuda_backend_test rc $?: $(grep -c '^\[       OK' $OUT/tests.txt) ok (both)"
grep -B2 -A12 "Failure" $OUT/tests.txt | head -40
echo "$T1; $T2 at $(el) s"
