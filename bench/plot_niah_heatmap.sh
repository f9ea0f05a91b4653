#!/usr/bin/env bash
# Plots needle-in-a-haystack accuracy by (length, depth) as one heatmap per policy, side by side, from an
# `oryx eval niah|niah-multikey|passkey --out FILE` result, as a PNG (gnuplot).
#   bench/plot_niah_heatmap.sh RESULT.json OUT.png [TITLE]
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 RESULT.json OUT.png [TITLE]" >&2; exit 2; }
IN="$1" OUT="$2" TITLE="${3:-needle-in-a-haystack accuracy}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 - "$IN" "$TMP" <<'PY'
import json, sys
result, tmp = json.load(open(sys.argv[1])), sys.argv[2]
cells = [r for r in result["results"] if not r.get("summary") and r.get("depth") is not None]
policies = list(dict.fromkeys(r["policy"] for r in cells))
lengths = sorted({r["length"] for r in cells})
depths = sorted({r["depth"] for r in cells})
summary = {r["policy"]: r for r in result["results"] if r.get("summary")}
for i, p in enumerate(policies):
    acc = {(r["length"], r["depth"]): r["accuracy"] for r in cells if r["policy"] == p}
    with open(f"{tmp}/{i}.dat", "w") as f:  # matrix: rows = depths, columns = lengths
        for d in depths:
            f.write(" ".join(f"{acc.get((l, d), float('nan')):.3f}" for l in lengths) + "\n")
    s = summary.get(p)
    label = p if s is None else f"{p}: {s['accuracy']:.2f} overall, {100 * s['attention_fraction']:.1f}% attention"
    open(f"{tmp}/{i}.title", "w").write(label)
open(f"{tmp}/n", "w").write(str(len(policies)))
open(f"{tmp}/xtics", "w").write(", ".join(f'"{l}" {j}' for j, l in enumerate(lengths)))
open(f"{tmp}/ytics", "w").write(", ".join(f'"{d:g}" {j}' for j, d in enumerate(depths)))
PY
n=$(cat "$TMP/n")
{
  echo "set terminal pngcairo size $((420 * n + 120)),460 font ',11'"
  echo "set output '$OUT'"
  echo "set multiplot layout 1,$n title '$TITLE'"
  echo "set cbrange [0:1]; set palette defined (0 '#b2182b', 0.5 '#f7f7f7', 1 '#2166ac')"
  echo "set xtics ($(cat "$TMP/xtics")); set ytics ($(cat "$TMP/ytics"))"
  echo "set xlabel 'sequence length'; set ylabel 'needle depth'"
  for ((i = 0; i < n; i++)); do
    echo "set title '$(cat "$TMP/$i.title")'"
    echo "plot '$TMP/$i.dat' matrix with image notitle, '$TMP/$i.dat' matrix using 1:2:(sprintf('%.2f', \$3)) with labels notitle"
  done
  echo "unset multiplot"
} | gnuplot
echo "wrote $OUT" >&2
