# Call 3: 30a261e (a prompt indexed once a request) against its parent: 16K x 8 serving of attention and the
# CPU-scale v3 policy on both trees, interleaved, twice. Then the GPU tests if time is left.
source .carry/env.sh
TOTAL=${TOTAL:-585}
xz -dc .carry/bin2/oryx-old.xz > build-gpu/bin/oryx-old && chmod +x build-gpu/bin/oryx-old
L=learned:.carry/p/router-cpu-v3.safetensors
for rep in 1 2; do
  for tree in new old; do
    O=build-gpu/bin/oryx; [[ $tree == old ]] && O=build-gpu/bin/oryx-old
    [[ $(( $(el) + 140 )) -gt $TOTAL ]] && break 2
    PROMPTS=15872 POLICIES="attention $L" CLIENTS=8 REPEATS=1 TIMEOUT=65 \
      bench/serve_grid.sh $O models/default data/c1 $OUT/serve-$tree-$rep.jsonl 2>> $OUT/serve.err
    echo "$tree rep $rep at $(el) s"
  done
done
for f in $OUT/serve-*.jsonl; do echo "== $f"; python3 bench/serve_ratios.py $f 2>&1 | tail -n 6; done
