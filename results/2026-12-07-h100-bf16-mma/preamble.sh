# Calls 4 and 5 then ran the products alone (inline; their scripts source this file after gpu-tests.sh).
xz -dc .carry/bin2/bench_gemv.xz > build-gpu/bin/bench_gemv && chmod +x build-gpu/bin/bench_gemv
timeout 60 $B/bench_gemv --config 1.4b --rows 2,3,4,8,16,32 > $OUT/gemm-rows.jsonl 2>> $OUT/err.txt
echo "gemv done at $(el) s"
