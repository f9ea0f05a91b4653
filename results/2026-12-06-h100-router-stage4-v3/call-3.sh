# Call 3 (warm after call 2): the 16K serving grid of the new policies, two runs of every point, then call-3-ab.sh.
source .carry/env.sh
for rep in 1 2; do for c in 8 32; do
  PROMPTS=15872 POLICIES="attention tail:64 tail:256 learned:out/r/router-lambda0.4.safetensors learned:out/r/router-lambda0.4-iter12.safetensors learned:out/r/router-lambda1.safetensors" \
    CLIENTS=$c REPEATS=1 TIMEOUT=60 bench/serve_grid.sh build-gpu/bin/oryx models/default data/c1 $OUT/serve-grid.jsonl 2>>$OUT/serve.err
  echo "rep $rep c $c at $(el) s"; [[ $(el) -gt 250 ]] && break 2
done; done
python3 bench/serve_ratios.py $OUT/serve-grid.jsonl
TOTAL=390 bash .carry/r3.sh
