#!/usr/bin/env bash
# Plots `oryx bench router --out FILE` results: accuracy against the share of tokens in attention mode, one
# point per policy (over all lengths), one panel per task, as a PNG (gnuplot).
#   bench/plot_router.sh RESULT.jsonl OUT.png
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 RESULT.jsonl OUT.png" >&2; exit 2; }
IN="$1" OUT="$2"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 - "$IN" "$TMP" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tasks = []
for r in rows:
    if r.get("summary") is True:
        if r["task"] not in tasks:
            tasks.append(r["task"])
        with open(f"{sys.argv[2]}/{tasks.index(r['task'])}.dat", "a") as f:
            # x: attention share in percent (clamped to 0.1% for the log axis), y: accuracy, label
            f.write(f"{max(100 * r['attention_fraction'], 0.1):.4f} {r['accuracy']:.4f} \"{r['policy']}\"\n")
open(f"{sys.argv[2]}/tasks", "w").write("".join(t + "\n" for t in tasks))
PY
n=$(wc -l < "$TMP/tasks")
{
  echo "set terminal pngcairo size $((560 * n)),480 font ',10'"
  echo "set output '$OUT'"
  echo "set multiplot layout 1,$n title 'Routing policies: accuracy against attention share (held-out examples)'"
  echo "set logscale x; set xrange [0.08:150]; set yrange [0:1.05]; set grid"
  echo "set xlabel 'tokens in attention mode (%, log scale; 0 shown at 0.1)'; set ylabel 'exact-match accuracy'"
  i=0
  while read -r task; do
    echo "set title '$task'"
    echo "plot '$TMP/$i.dat' using 1:2 with points pt 7 ps 1.2 notitle, '' using 1:2:3 with labels offset 0,0.8 font ',8' notitle"
    i=$((i + 1))
  done < "$TMP/tasks"
  echo "unset multiplot"
} | gnuplot
echo "wrote $OUT" >&2
