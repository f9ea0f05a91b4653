#!/usr/bin/env bash
# Run ON THE GPU MACHINE after scripts/device-cuda: the CUDA backend's decode benchmark (random 1.4b and
# 130m configs, models/default) and the PyTorch reference (bench/torch_reference.py) of the same configs, in
# one run, as JSON lines under OUTDIR. Each step has its own time limit, in order of importance, so that a
# slow step (torch.compile) cannot take the others with it.
#
# The speculative rounds come first: models/default on validation windows of CORPUS (default data/corpus;
# only its manifest.json and val shard are read), whose measured greedy acceptance at k = 4 is then the
# simulated acceptance of the random 1.4b config's rounds at 32K (and the flag's default 0.84 beside it).
#
#   bench/cuda_decode_bench.sh OUTDIR        (COMPILE_S=0 skips torch.compile, which takes 30 s (reduce-overhead)
#                                             to minutes (max-autotune) per point; COMPILE_IMPLS picks its variants,
#                                             default compile-cg; SPEC_ONLY=1 runs only the speculative steps,
#                                             SKIP_SPEC=1 all but them)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: bench/cuda_decode_bench.sh OUTDIR}
mkdir -p "$OUT_DIR"
ORYX=build-gpu/bin/oryx
CORPUS=${CORPUS:-data/corpus}
run() {  # run LIMIT_S NAME CMD...: stdout (JSON lines) to OUT_DIR/NAME.jsonl, a summary on stderr
  local limit=$1 name=$2; shift 2
  echo "==> $name" >&2
  timeout "$limit" "$@" > "$OUT_DIR/$name.jsonl" 2> >(grep -v "^\s*$" | tail -4 >&2) || echo "    ($name: exit $?)" >&2
}
# Speculative rounds (k linear drafts, one attention verify, commit) against the decode steps of each point.
ACCEPTANCE=0.84
if [[ ${SKIP_SPEC:-0} != 1 && -f $CORPUS/manifest.json ]]; then
  run 60 spec-default $ORYX bench decode --device cuda --model models/default --data "$CORPUS" --contexts 1024 \
    --batches 1,8 --steps 32 --spec-k 1,2,3,4,6,8 --prefill-max-attention 0 --json
  # The acceptance per judged draft at k = 4, pooled over the batch sizes.
  measured=$(python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1]) if "\"speculative\"" in l]
r=[x for x in r if x["k"]==4]
print(round(sum(x["accepted"] for x in r)/sum(x["judged"] for x in r),4) if r else "")' "$OUT_DIR/spec-default.jsonl")
  [[ -n $measured ]] && ACCEPTANCE=$measured
  echo "    measured acceptance at k=4: ${measured:-none}" >&2
fi
[[ ${SKIP_SPEC:-0} == 1 ]] || run 90 spec-1.4b $ORYX bench decode --device cuda --config 1.4b --contexts 1024,8192,32768 --batches 1,4 --steps 20 \
  --spec-k 2,4,8 --prefill-max-attention 0 --json
if [[ ${SKIP_SPEC:-0} != 1 && $ACCEPTANCE != 0.84 ]]; then
  # (Spans of more than 4 rows verify on tensor cores in groups of 16, so k up to 15 reads the cache once.)
  run 90 spec-1.4b-measured $ORYX bench decode --device cuda --config 1.4b --contexts 32768 --batches 1,4 --steps 20 \
    --spec-k 1,2,3,4,6,8,12 --acceptance "$ACCEPTANCE" --prefill-max-attention 0 --json
fi
[[ ${SKIP_SPEC:-0} == 1 ]] || run 60 spec-130m $ORYX bench decode --device cuda --config 130m --contexts 1024,32768 --batches 1,16 --steps 20 \
  --spec-k 2,4,8 --prefill-max-attention 0 --json
[[ ${SPEC_ONLY:-0} == 1 ]] && exit 0
run 110 cuda-1.4b $ORYX bench decode --device cuda --config 1.4b --contexts 1024,8192,32768 --batches 1,4,16 --steps 20 \
  --prefill-max-attention 32768 --json
[[ ${GEMV:-0} == 1 ]] && run 30 gemv-1.4b build-gpu/bin/bench_gemv --config 1.4b
run 60 torch-1.4b python3 bench/torch_reference.py --config 1.4b --contexts 1024,8192,32768 --batches 1,4 --impl eager,graph --steps 20
run 90 cuda-130m $ORYX bench decode --device cuda --config 130m --contexts 1024,8192,32768,131072 --batches 1,4,16,64 --steps 20 --json
run 30 cuda-default $ORYX bench decode --device cuda --model models/default --contexts 1024 --batches 1,4,16,64 --steps 20 --json
run 45 cuda-1.4b-128k $ORYX bench decode --device cuda --config 1.4b --contexts 131072 --batches 1 --steps 20 --prefill-max-attention 0 --json
run 25 cuda-1.4b-gdn $ORYX bench decode --device cuda --config 1.4b --mixer gdn --contexts 32768 --batches 1 --steps 20 --prefill-max-attention 0 --json
run 35 torch-130m python3 bench/torch_reference.py --config 130m --contexts 1024,32768 --batches 1,16 --impl eager,graph --steps 20
[[ ${COMPILE_S:-100} == 0 ]] && exit 0
run "${COMPILE_S:-100}" torch-1.4b-compile python3 bench/torch_reference.py --config 1.4b --contexts 32768 --batches 1 \
  --impl "${COMPILE_IMPLS:-compile-cg}" --steps 20
