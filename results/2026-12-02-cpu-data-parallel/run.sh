#!/usr/bin/env bash
# The runs behind README.md: data-parallel `oryx train` on the CPU against one process, each run's log.jsonl
# copied to OUT/NAME-REP.jsonl. CORPUS: `oryx data prepare --input-dir TEXT --vocab 512 --val-fraction 0.15`
# over a copy of the repo's engine/ and tasks/ (as tests/train/distributed_train_test does).
#
#   results/2026-12-02-cpu-data-parallel/run.sh build/bin/oryx CORPUS OUT
set -euo pipefail
ORYX=$1 CORPUS=$2 OUT=$3
mkdir -p "$OUT"
TINY="--d-model 64 --layers 2 --heads 2 --head-dim 32 --mlp-hidden 128 --fragment-len 16 --seq-len 64 --batch 8"
SMALL="--d-model 256 --layers 4 --heads 4 --head-dim 64 --mlp-hidden 768 --fragment-len 64 --seq-len 256"
run() {  # NAME REP STEPS FLAGS...
  local name=$1 rep=$2 steps=$3
  shift 3
  rm -rf "$OUT/run"
  "$ORYX" train --data "$CORPUS" --out "$OUT/run" --steps "$steps" --warmup 10 --eval-every 0 --eval-sequences 1 \
    --log-every 1 --device cpu --allow-short-documents --no-save "$@" 2>"$OUT/run.stderr"
  cp "$OUT/run/log.jsonl" "$OUT/$name-$rep.jsonl"
}
for rep in 1 2 3; do
  run tiny-plain $rep 300 $TINY --threads 1
  run tiny-nproc1 $rep 300 $TINY --threads 1 --nproc 1
  run small-plain $rep 30 $SMALL --batch 4
  run small-nproc1 $rep 30 $SMALL --batch 4 --nproc 1
done
for rep in 1 2 3; do
  run small-2ranks-25mib-overlap $rep 40 $SMALL --batch 2 --nproc 2
  run small-2ranks-1mib-overlap $rep 40 $SMALL --batch 2 --nproc 2 --bucket-mb 1
  run small-2ranks-1mib-after $rep 40 $SMALL --batch 2 --nproc 2 --bucket-mb 1 --no-overlap
  run small-1rank-accum2 $rep 40 $SMALL --batch 2 --accum 2
done
