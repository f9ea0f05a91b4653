# Call 1: build; the two GPU tests that have not run on a GPU (1e75d66, cc23cda); the router retrained on
# stage 4 with features v3 at 4K-16K, the time cost calibrated here; the held-out comparison with the rules.
source .carry/env.sh
TOTAL=${TOTAL:-585}; TRAIN_END=${TRAIN_END:-400}
build-gpu/bin/ops_cuda_test --gtest_brief=1 2>&1 | tail -n 4
build-gpu/bin/cuda_backend_test --gtest_brief=1 2>&1 | tail -n 4
echo "tests done at $(el) s"
R="build-gpu/bin/oryx train-router --model models/default --data data/c1 --tasks text niah-multikey --lengths 4096,8192,16000 --cost time --device cuda --segment-len 1024 --draft-lengths 0,4 --segment-tail 64 --out out/r/router.safetensors"
timeout $(( TRAIN_END - $(el) )) $R --warm-tail --warm-examples 16 --iterations ${ITER:-24} --batch 24 --samples 4 --lr 1e-3 \
  --entropy-bonus 0.05 --validation-examples 16 --validation-front --lambda ${LAMBDAS:-1,0.4} > $OUT/train-router.out 2>&1
echo "train rc $? at $(el) s"; tail -n 25 $OUT/train-router.out
tar -cf $OUT/routers.tar -C out/r .
E=$(( (TOTAL - $(el) - 25) * 10 / 15 )); [[ $E -lt 8 ]] && E=8
echo "eval E=$E at $(el) s"
timeout $(( TOTAL - $(el) )) $R --lambda ${LAMBDAS:-1,0.4} --validation-front --eval-only --eval-examples $E \
  --eval-rules budget:0.1,match:8,match:32,entropy:1,entropy:3,tail:64,tail:128,tail:256 --log out/r/eval.log.jsonl > $OUT/router-eval.out 2>&1
echo "eval rc $? at $(el) s"; tail -n 40 $OUT/router-eval.out
cp out/r/eval.log.jsonl $OUT/ 2>/dev/null
