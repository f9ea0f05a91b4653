# Session 70, call 3 (NOT RUN: no device time was left): adaptive speculation at low load, this tree (d123817) against b43cb50 (the eighth
# session's), alternating: 8K x 1 and 4K x 8, where call 2's acceptance fell below the sixth session's.
source .carry/env.sh
TOTAL=${TOTAL:-150}
xz -dc .carry/bin2/oryx-old.xz > build-gpu/bin/oryx-old && chmod +x build-gpu/bin/oryx-old
for rep in 1 2; do
  for tree in new old; do
    O=build-gpu/bin/oryx; [[ $tree == old ]] && O=build-gpu/bin/oryx-old
    [[ $(( $(el) + 25 )) -gt $TOTAL ]] && break 2
    for pc in 8192:1 4096:8; do
      ORYX_GIT_REVISION=$tree PROMPTS=${pc%:*} CLIENTS=${pc#*:} POLICIES=speculative TIMEOUT=40 \
        bench/serve_grid.sh $O models/default data/c1 $OUT/spec-low.jsonl 2>> $OUT/serve.err
    done
    echo "$tree rep $rep at $(el) s"
  done
done
python3 - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/spec-low.jsonl"):
    j = json.loads(l)
    print(j["git"], j["prompt_tokens"], j["concurrency"], round(j["generated_tokens_per_s"]), round(j["acceptance_rate"], 3), j["rounds_by_length"])
PY
