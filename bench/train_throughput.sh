#!/usr/bin/env bash
# Training throughput of `oryx train`: short runs (no checkpoints) of the 16M and 205M configs, one JSON
# line per run on stdout with the rate of the last logged window (after warm-up and graph recording).
#
#   bench/train_throughput.sh ORYX CORPUS_DIR OUT_DIR [RUN...]
#   RUN is NAME:BATCH:GRAPH(on|off)[:EXTRA FLAGS]; NAME is 16m, 26m, 29m (the 16K-context candidates) or 205m. Default: a 205M/16M grid on CUDA.
#   Environment: DEVICE=cuda|cpu (default cuda), SEQ (default 2048), STEPS (default 25, logged every 5).
#   On the CPU the MFU is against the fp32 GEMM rate LibTorch reaches on the same machine, measured in the
#   same run (torch.mm of 2048 x 2048, all cores): a ratio, not a datasheet peak.
set -euo pipefail
if [[ $# -lt 3 ]]; then sed -n '2,10p' "$0"; exit 2; fi
ORYX=$1 CORPUS=$2 OUT=$3
shift 3
DEVICE=${DEVICE:-cuda} SEQ=${SEQ:-2048} STEPS=${STEPS:-25}
[[ $DEVICE == cuda || $DEVICE == cpu ]] || { echo "train_throughput: DEVICE must be cuda or cpu" >&2; exit 2; }
RUNS=("$@")
if [[ ${#RUNS[@]} -eq 0 ]]; then
  RUNS=(205m:8:off 205m:8:on 205m:16:on 16m:16:off 16m:16:on 16m:64:on)
fi
declare -A MODEL=(
  [16m]="--d-model 384 --layers 6 --heads 6 --head-dim 64 --mlp-hidden 1024"
  [26m]="--d-model 448 --layers 8 --heads 7 --head-dim 64 --mlp-hidden 1216 --rope-theta 500000"
  [29m]="--d-model 512 --layers 8 --heads 8 --head-dim 64 --mlp-hidden 1024 --rope-theta 500000"
  [205m]="--d-model 768 --layers 24 --heads 12 --head-dim 64 --mlp-hidden 2048"
)
peak=()
if [[ $DEVICE == cpu ]]; then
  gemm_tflops=$(python3 -W ignore - <<'PY'
import time, torch
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
for _ in range(3): a @ b
best = 0.0
for _ in range(5):
    t = time.perf_counter(); n = 10
    for _ in range(n): a @ b
    best = max(best, n * 2 * 2048**3 / (time.perf_counter() - t))
print(f"{best / 1e12:.4f}")
PY
)
  peak=(--peak-tflops "$gemm_tflops")
fi
mkdir -p "$OUT"
for run in "${RUNS[@]}"; do
  IFS=: read -r name batch graph extra <<<"$run"
  [[ -n ${MODEL[$name]:-} ]] || { echo "train_throughput: unknown model '$name' (16m | 26m | 29m | 205m)" >&2; exit 2; }
  tag="$DEVICE-$name-b$batch-s$SEQ-graph-$graph${extra:+-$(echo "$extra" | tr -c 'a-zA-Z0-9.\n' '_')}"
  dir="$OUT/$tag"
  rm -rf "$dir"
  flags=(${MODEL[$name]} --seq-len "$SEQ" --batch "$batch" --steps "$STEPS" --log-every $(( STEPS >= 10 ? 5 : 1 ))
         --eval-every 0 --eval-sequences 1 --warmup 5 --no-save --device "$DEVICE" "${peak[@]}")
  [[ $graph == off ]] && flags+=(--no-cuda-graph)
  # shellcheck disable=SC2206
  [[ -n $extra ]] && flags+=($extra)
  if ! "$ORYX" train --data "$CORPUS" --out "$dir" "${flags[@]}" 2>"$dir.stderr"; then
    echo "{\"run\": \"$tag\", \"error\": $(tail -1 "$dir.stderr" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')}"
    continue
  fi
  python3 - "$dir/log.jsonl" "$tag" "${gemm_tflops:-}" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if l.get("event") == "step"]
start = next(l for l in lines if l.get("event") == "start")
last = steps[-1]
out = {"run": sys.argv[2], "params": start["params"], "step": last["step"],
       "tokens_per_s": round(last["tokens_per_s"]), "mfu": round(last.get("mfu", 0), 4),
       "loss": round(last["loss"], 4)}
if sys.argv[3]:
    out["gemm_tflops_same_run"] = float(sys.argv[3])
print(json.dumps(out))
PY
done
