#!/usr/bin/env bash
# Plots `oryx bench serve --out FILE` results as a PNG (gnuplot): generated tokens/s (left) and the median
# time between a request's tokens (right) against the number of concurrent clients (or, for open-loop
# results, the arrival rate in requests/s), one line per model and policy.
#   bench/plot_serve.sh RESULT.jsonl OUT.png [TITLE]
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 RESULT.jsonl OUT.png [TITLE]" >&2; exit 2; }
IN="$1" OUT="$2" TITLE="${3:-oryx serve under load}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 - "$IN" "$TMP" <<'PY'
import json, os, sys
series = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("bench") != "serve":
        continue
    name = f"{os.path.basename(r['model'].rstrip('/'))} {r['policy']} ({r['device']})"
    x = r["concurrency"]
    if "arrival_rate_per_s" in r:  # open loop: x is the arrival rate
        name += ", open loop"
        x = r["arrival_rate_per_s"]
    series.setdefault(name, []).append((x, r["generated_tokens_per_s"], r["inter_token_ms_p50"]))
with open(f"{sys.argv[2]}/names", "w") as names:
    for i, (name, points) in enumerate(series.items()):
        names.write(name + "\n")
        with open(f"{sys.argv[2]}/{i}.dat", "w") as f:
            for c, tps, itl in sorted(points):
                f.write(f"{c} {tps:.3f} {itl:.4f}\n")
PY
n=$(wc -l < "$TMP/names")
[[ $n -gt 0 ]] || { echo "$0: no serve results in $IN" >&2; exit 1; }
plot() {  # plot COLUMN
  local sep="plot" i=0
  while read -r name; do
    printf "%s '%s/%d.dat' using 1:%d with linespoints pt 7 lw 2 title '%s'" "$sep" "$TMP" "$i" "$1" "$name"
    sep=","
    i=$((i + 1))
  done < "$TMP/names"
  echo
}
{
  echo "set terminal pngcairo size 1300,520 font ',10'"
  echo "set output '$OUT'"
  echo "set multiplot layout 1,2 title '$TITLE'"
  echo "set grid; set logscale x 2; set xlabel 'concurrent clients (open loop: requests/s)'; set key top left"
  echo "set title 'throughput'; set ylabel 'generated tokens/s'; set logscale y"
  plot 2
  echo "set title 'time between tokens (median)'; set ylabel 'ms'; unset logscale y; set yrange [0:*]"
  plot 3
  echo "unset multiplot"
} | gnuplot
echo "wrote $OUT" >&2
