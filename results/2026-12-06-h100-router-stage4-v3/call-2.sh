# Call 2 (warm after call 1): the held-out comparison on fresh examples (seed 2), then 16K x 8 serving of the
# new policy beside attention and tail:64.
source .carry/env.sh
TOTAL=${TOTAL:-585}; E=${E:-150}
[[ -f out/r/router-lambda1.safetensors ]] || tar -xf .carry/p/routers.tar -C out/r
ls out/r
R="build-gpu/bin/oryx train-router --model models/default --data data/c1 --tasks text niah-multikey --lengths 4096,8192,16000 --cost time --device cuda --segment-len 1024 --draft-lengths 0,4 --segment-tail 64 --out out/r/router.safetensors"
timeout ${EVAL_END:-330} $R --lambda ${LAMBDAS:-1,0.4} --validation-front --eval-only --eval-examples $E --seed 2 \
  --eval-rules match:8,match:32,entropy:3,tail:64,tail:128,tail:256 --log out/r/fresh.log.jsonl > $OUT/router-fresh.out 2>&1
echo "eval rc $? at $(el) s"; tail -n 40 $OUT/router-fresh.out
cp out/r/fresh.log.jsonl $OUT/ 2>/dev/null
for pol in attention tail:64 learned:out/r/router-lambda${LAMBDA_SERVE:-0.4}.safetensors; do
  [[ $(( $(el) + 75 )) -gt $TOTAL ]] && break
  PROMPTS=15872 POLICIES="$pol" CLIENTS=8 REPEATS=1 TIMEOUT=70 \
    bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-16k-8.jsonl 2>> $OUT/serve.err
  echo "$pol at $(el) s"
done
python3 bench/serve_ratios.py $OUT/serve-16k-8.jsonl 2>&1 | tail -n 20
