#!/usr/bin/env bash
# Plots per-position validation loss by mode schedule from an `oryx eval ppl --out FILE` result, smoothed
# over a window of positions, as a PNG (gnuplot).
#   bench/plot_ppl_curves.sh RESULT.json OUT.png [WINDOW]
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 RESULT.json OUT.png [WINDOW]" >&2; exit 2; }
IN="$1" OUT="$2" WINDOW="${3:-64}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 - "$IN" "$TMP" "$WINDOW" <<'PY'
import json, sys
result, tmp, window = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
names = []
for i, r in enumerate(result["results"]):
    curve = r["per_position_loss"]
    with open(f"{tmp}/{i}.tsv", "w") as f:
        for t in range(len(curve)):
            lo = max(0, t - window + 1)
            f.write(f"{t}\t{sum(curve[lo:t + 1]) / (t + 1 - lo)}\n")
    names.append(r["schedule"])
open(f"{tmp}/names", "w").write("\n".join(names))
PY
plots=""
i=0
while read -r name; do
  plots+="${plots:+, }'$TMP/$i.tsv' using 1:2 with lines lw 2 title '$name'"
  i=$((i + 1))
done < "$TMP/names"
gnuplot <<GP
set terminal pngcairo size 1200,650 font ",11"
set output "$OUT"
set title "Validation loss by position and mode schedule (moving average over $WINDOW positions)"
set xlabel "position"
set ylabel "loss (nats)"
set key outside right
set grid
set autoscale xfixmax
plot $plots
GP
echo "wrote $OUT" >&2
