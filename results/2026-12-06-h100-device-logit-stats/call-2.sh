# Call 16 (warm, after c15): the new tree's routed policies in the serving grid: 4K and 16K x 1/8/32/64 clients.
source .carry/env.sh
t0=$(date +%s)
mkdir -p $OUT data
[[ -f models/default/config.json ]] || LD_LIBRARY_PATH=$PWD/.carry/bin zstd -dc .xa/model.tar.zst | tar -xf -
[[ -d data/c16v ]] || tar -xJf .xb/c16v.tar.xz -C data
[[ -x build-gpu/bin/oryx ]] || { scripts/device-build --no-tests --targets oryx > /tmp/b.log 2>&1 || { tail -30 /tmp/b.log; exit 1; }; }
echo "ready at $(( $(date +%s) - t0 )) s"
for prompt in 15872 4096; do
for pol in attention speculative entropy:3 budget:0.1 tail:64 learned:.carry/p/router-cpu-v3.safetensors; do
  PROMPTS="$prompt" POLICIES="$pol" CLIENTS=1,8,32,64 REPEATS=1 TIMEOUT=150 \
    bench/serve_grid.sh build-gpu/bin/oryx models/default data/c16v $OUT/serve-grid-routed.jsonl 2>> $OUT/serve.err
  echo "$prompt $pol at $(( $(date +%s) - t0 )) s"
  [[ $(( $(date +%s) - t0 )) -gt 480 ]] && break 2
done
done
python3 bench/serve_ratios.py $OUT/serve-grid-routed.jsonl 2>&1
