#!/usr/bin/env bash
# Plots `oryx bench router --out FILE` results, one point per policy (over all lengths), one column per
# task, as a PNG (gnuplot): accuracy against the share of tokens in attention mode (top row) and against
# model FLOPs as a share of all-attention's (bottom row). Learned policies are labelled by file name.
#   bench/plot_router.sh RESULT.jsonl OUT.png
set -euo pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 RESULT.jsonl OUT.png" >&2; exit 2; }
IN="$1" OUT="$2"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 - "$IN" "$TMP" <<'PY'
import json, os, sys
def label(p):
    if not p.startswith("learned:"):
        return p
    name = os.path.splitext(os.path.basename(p[8:]))[0]
    return name if name.startswith("learned") else "learned " + name
rows = [json.loads(l) for l in open(sys.argv[1])]
tasks = []
for r in rows:
    if r.get("summary") is True:
        if r["task"] not in tasks:
            tasks.append(r["task"])
        with open(f"{sys.argv[2]}/{tasks.index(r['task'])}.dat", "a") as f:
            # x: attention share in percent (clamped to 0.1% for the log axis), y: accuracy, label
            # x2: FLOPs in percent of all-attention's
            f.write(f"{max(100 * r['attention_fraction'], 0.1):.4f} {r['accuracy']:.4f} \"{label(r['policy'])}\" "
                    f"{100 * r.get('flops_fraction', 1.0):.4f}\n")
open(f"{sys.argv[2]}/tasks", "w").write("".join(t + "\n" for t in tasks))
PY
n=$(wc -l < "$TMP/tasks")
{
  echo "set terminal pngcairo size $((600 * n)),900 font ',10'"
  echo "set output '$OUT'"
  echo "set multiplot layout 2,$n title 'Routing policies on held-out examples: accuracy against attention share and FLOPs'"
  echo "set yrange [0:1.05]; set grid; set ylabel 'accuracy'"
  # One row of panels per x axis: the attention share (column 1, log scale), then FLOPs (column 4).
  for axis in "1 set logscale x; set xrange [0.08:150]|tokens in attention mode (%, log scale; 0 shown at 0.1)" \
              "4 unset logscale x; set autoscale x|model FLOPs (% of all-attention)"; do
    col=${axis%% *} rest=${axis#* }
    i=0
    while read -r task; do
      echo "set title '$task'; ${rest%%|*}; set xlabel '${rest#*|}'"
      echo "plot '$TMP/$i.dat' using $col:2 with points pt 7 ps 1.2 notitle, '' using $col:2:3 with labels offset 0,0.8 font ',7' notitle"
      i=$((i + 1))
    done < "$TMP/tasks"
  done
  echo "unset multiplot"
} | gnuplot
echo "wrote $OUT" >&2
