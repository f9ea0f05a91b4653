# Session 72, call 10: the SwiGLU in the tensor-core GEMV's epilogue -- the GPU tests, and the linear and
# attention steps with it (default) and without it (ORYX_CUDA_FUSED=0, which at these batches turns off only it),
# alternating: 1.4b at 32K (batch 8, bf16 and fp8), models/default at 15K (batch 8 and 32).
source results/2026-12-07-h100-bf16-mma/gpu-tests.sh
for rep in 1 2; do
  for fused in 1 0; do
    for w in bf16 fp8; do
      ORYX_CUDA_FUSED=$fused timeout 40 $B/oryx bench decode --device cuda --config 1.4b --weights $w --contexts 32768 --batches 8 \
        --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"fused\":$fused,/" >> $OUT/decode.jsonl 2>> $OUT/err.txt
    done
    ORYX_CUDA_FUSED=$fused timeout 40 $B/oryx bench decode --device cuda --model models/default --contexts 15360 --batches 8,32 \
      --steps 20 --prefill-max-attention 0 --json | sed "s/^{/{\"fused\":$fused,/" >> $OUT/decode.jsonl 2>> $OUT/err.txt
  done
  echo "rep $rep at $(el) s"
done
python3 results/2026-12-07-h100-bf16-mma/print_steps.py
echo "$T1; $T2"
