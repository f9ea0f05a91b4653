#!/usr/bin/env python3
"""Sets two profiles side by side, row by row: where one run spends more GPU time than the other.

    bench/compare_profiles.py BASE NEW [--top N] [--min-ms X]

BASE and NEW are outputs of bench/summarize_trace.py (its table, or --json), by op or by kernel, both the
same way. Prints each row's kernels and ms in both, and NEW - BASE, largest differences first; then the
totals. A row missing from one side counts as zero there (the table lists only its --top rows, so a row
below that cut reads as absent: summarise with a large --top to compare whole profiles).
"""
import argparse
import json
import re
import sys

ROW = re.compile(r"^(.*\S)\s+(\d+)\s+([\d.]+)\s+[\d.]+%$")


def load(path):
    """-> ({name: (kernels, ms)}, total kernel ms or None)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        sys.exit(f"compare_profiles: {path}: {e}")
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
            return {r["op"]: (r["kernels"], r["ms"]) for r in data["ops"]}, data.get("kernel_ms")
        except (ValueError, KeyError, TypeError) as e:
            sys.exit(f"compare_profiles: {path}: not summarize_trace.py --json output: {e}")
    rows, total = {}, None
    lines = text.splitlines()
    if lines and (m := re.match(r"kernel time ([\d.]+) ms", lines[0])):
        total = float(m.group(1))
    for line in lines[1:]:
        m = ROW.match(line.rstrip())
        if m:
            rows[m.group(1)] = (int(m.group(2)), float(m.group(3)))
    if not rows:
        sys.exit(f"compare_profiles: {path}: no rows of summarize_trace.py's table")
    return rows, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--top", type=int, default=30, help="rows to print (default 30)")
    ap.add_argument("--min-ms", type=float, default=0.0, help="leave out rows whose |difference| is below this")
    args = ap.parse_args()
    base, base_total = load(args.base)
    new, new_total = load(args.new)
    names = sorted(set(base) | set(new), key=lambda n: -abs(new.get(n, (0, 0.0))[1] - base.get(n, (0, 0.0))[1]))
    print(f"{'row':60s} {'kernels':>8s} {'base ms':>9s} {'kernels':>8s} {'new ms':>9s} {'new-base':>9s}")
    shown = 0
    for name in names:
        (bc, bt), (nc, nt) = base.get(name, (0, 0.0)), new.get(name, (0, 0.0))
        if abs(nt - bt) < args.min_ms:
            continue
        if shown == args.top:
            break
        print(f"{name[:60]:60s} {bc:8d} {bt:9.2f} {nc:8d} {nt:9.2f} {nt - bt:+9.2f}")
        shown += 1
    listed_base = sum(t for _, t in base.values())
    listed_new = sum(t for _, t in new.values())
    print(f"{'rows listed, in all':60s} {'':8s} {listed_base:9.2f} {'':8s} {listed_new:9.2f} "
          f"{listed_new - listed_base:+9.2f}")
    if base_total is not None and new_total is not None:
        print(f"{'kernel time of the profile':60s} {'':8s} {base_total:9.2f} {'':8s} {new_total:9.2f} "
              f"{new_total - base_total:+9.2f} ({new_total / base_total:.3f}x)")


if __name__ == "__main__":
    main()
