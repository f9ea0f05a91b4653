# Call 17: the earlier-match index in a hash table (165d679): learned at 16K x 8 on this tree and on 8f9d9fa,
# interleaved, twice; attention and entropy:3 beside; attention_fraction from this tree's bench serve.
source .carry/env.sh
t0=$(date +%s)
mkdir -p $OUT data
[[ -f models/default/config.json ]] || LD_LIBRARY_PATH=$PWD/.carry/bin zstd -dc .xa/model.tar.zst | tar -xf -
[[ -d data/c16v ]] || tar -xJf .xb/c16v.tar.xz -C data
R=$PWD
rm -rf /tmp/old && mkdir -p /tmp/old && tar -xJf .xb/old.tar.xz -C /tmp/old && ln -sfn $R/.deps /tmp/old/.deps
(cd /tmp/old && scripts/device-build --build-dir build-old --no-tests --targets oryx > /tmp/bo.log 2>&1) &
BO=$!
scripts/device-build --no-tests --targets "oryx" > /tmp/b.log 2>&1 || { tail -40 /tmp/b.log; exit 1; }
wait $BO || { tail -30 /tmp/bo.log; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
L=learned:.carry/p/router-cpu-v3.safetensors
for rep in 1 2; do
  for tree in new old; do
    O=build-gpu/bin/oryx; [[ $tree == old ]] && O=/tmp/old/build-old/bin/oryx
    P="attention $L"
    PROMPTS="15872" POLICIES="$P" CLIENTS=8 REPEATS=1 TIMEOUT=60 \
      timeout 250 bench/serve_grid.sh $O models/default data/c16v $OUT/serve-$tree-$rep.jsonl 2>> $OUT/serve.err
    echo "$tree rep $rep at $(( $(date +%s) - t0 )) s"
    [[ $(( $(date +%s) - t0 )) -gt 330 ]] && break 2
  done
done
python3 - <<'PY'
import json,os,glob
for p in sorted(glob.glob(os.path.join(os.environ["OUT"],"serve-*.jsonl"))):
    for l in open(p):
        j=json.loads(l)
        print(os.path.basename(p), j["policy"][:24], round(j["generated_tokens_per_s"]), "ttft50", round(j["ttft_ms"]["p50"],1),
              "itl50", round(j["inter_token_ms_p50"],3), "attn", j.get("attention_fraction"), "steps", j["server_steps"], "step_s", round(j["server_step_s"],2))
PY
