#!/usr/bin/env bash
# Plots the held-out comparison of `oryx train-router --eval-examples N` (its log's "eval_mixed" lines) as a
# PNG (gnuplot): quality against cost on the mixed workload, the rules as labelled red points, the learned
# policies in blue (a lambda's validation front joined by a line, its kept network labelled), with the
# quality's standard error as a bar; policies at the same point share one label. Three panels: every
# policy, the cheap end (cost up to CHEAP_MAX, default 0.6) and the dear end (cost from DEAR_MIN, default
# 0.98), where the policies lie close together.
#   bench/plot_router_comparison.sh LOG.jsonl OUT.png [CHEAP_MAX [DEAR_MIN]]
set -euo pipefail
[[ $# -ge 2 && $# -le 4 ]] || { echo "usage: $0 LOG.jsonl OUT.png [CHEAP_MAX [DEAR_MIN]]" >&2; exit 2; }
IN="$1" OUT="$2" CHEAP_MAX="${3:-0.6}" DEAR_MIN="${4:-0.98}"
[[ -r "$IN" ]] || { echo "$0: cannot read $IN" >&2; exit 1; }
command -v gnuplot > /dev/null || { echo "$0: gnuplot is not installed (apt-get install gnuplot-nox)" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 - "$IN" "$TMP" "$CHEAP_MAX" "$DEAR_MIN" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
mixed = [r for r in rows if r.get("phase") == "eval_mixed"]
if not mixed:
    sys.exit(f"{sys.argv[1]}: no eval_mixed lines (run train-router with --eval-examples)")
kind = mixed[0].get("cost_kind", "cost")
rules, kept, fronts = [], [], {}
for r in mixed:
    m = re.fullmatch(r"learned lambda (\S+)(?: iter (\d+))?", r["policy"])
    point = (r["cost"], r["quality"], r["quality_error"])
    if m is None:
        rules.append(point + (r["policy"],))
    elif m.group(2) is None:
        kept.append(point + (f"lambda {m.group(1)}",))
    else:
        fronts.setdefault(m.group(1), []).append(point)
def write(name, points, labelled):
    merged = {}  # policies at the same point (e.g. prefill-linear and budget:0.1) share one label
    for p in points:
        merged.setdefault((round(p[0], 6), round(p[1], 6)), [p[2], []])[1].append(p[3])
    with open(f"{sys.argv[2]}/{name}", "w") as f:
        for (cost, quality), (error, names) in merged.items():
            f.write(f"{cost:.6f} {quality:.6f} {error:.6f}" + (f' "{" = ".join(names)}"' if labelled else "") + "\n")
write("rules.dat", rules, True)
write("kept.dat", kept, True)
with open(f"{sys.argv[2]}/fronts.dat", "w") as f:  # one block per lambda, in cost order
    for lam, points in fronts.items():
        for p in sorted(points):
            f.write(f"{p[0]:.6f} {p[1]:.6f} {p[2]:.6f}\n")
        f.write("\n\n")
# Each zoomed panel's quality range: that of its points, with their error bars and a margin.
for name, inside in (("cheap", lambda c: c <= float(sys.argv[3])), ("dear", lambda c: c >= float(sys.argv[4]))):
    qs = [(r["quality"] - r["quality_error"], r["quality"] + r["quality_error"]) for r in mixed if inside(r["cost"])]
    lo, hi = (min(q[0] for q in qs), max(q[1] for q in qs)) if qs else (0, 1)
    pad = max(0.01, 0.08 * (hi - lo))
    open(f"{sys.argv[2]}/{name}.yrange", "w").write(f"[{lo - pad:.4f}:{hi + pad:.4f}]")
examples = mixed[0].get("examples", "?")
open(f"{sys.argv[2]}/title", "w").write(
    f"Routing policies on {examples} held-out examples a task ({', '.join(mixed[0].get('tasks', []))}): "
    f"quality against cost ({kind}, relative to all-attention)")
PY
[[ -s "$TMP/fronts.dat" ]] && fronts="'$TMP/fronts.dat' using 1:2 with linespoints lc rgb '#9ab8e0' pt 7 ps 0.5 title 'validation fronts', " || fronts=""
{
  echo "set terminal pngcairo size 2100,700 font ',10'"
  echo "set output '$OUT'"
  echo "set multiplot layout 1,3 title \"$(cat "$TMP/title")\""
  echo "set grid; set xlabel 'cost'; set ylabel 'quality'; set key bottom right"
  for panel in "all policies|set autoscale x; set yrange [0:1.05]" \
               "the cheap end (cost <= $CHEAP_MAX)|set xrange [*:$CHEAP_MAX]; set yrange $(cat "$TMP/cheap.yrange")" \
               "the dear end (cost >= $DEAR_MIN)|set xrange [$DEAR_MIN:*]; set yrange $(cat "$TMP/dear.yrange")"; do
    echo "set title '${panel%%|*}'; ${panel#*|}"
    echo "plot $fronts'$TMP/rules.dat' using 1:2:3 with yerrorbars lc rgb '#c0392b' pt 5 ps 0.9 title 'rules', \
      '' using 1:2:4 with labels offset 0.6,0.6 left font ',8' tc rgb '#c0392b' notitle, \
      '$TMP/kept.dat' using 1:2:3 with yerrorbars lc rgb '#1f4e9c' pt 7 ps 0.9 title 'learned (kept network)', \
      '' using 1:2:4 with labels offset 0.6,-0.7 left font ',8' tc rgb '#1f4e9c' notitle"
  done
  echo "unset multiplot"
} > "$TMP/plot.gp"
gnuplot "$TMP/plot.gp"
echo "wrote $OUT"
