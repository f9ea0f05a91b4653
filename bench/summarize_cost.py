#!/usr/bin/env python3
"""Summarises `oryx bench cost --json` files: the cost model's held-out error on short spans (decode steps,
verify spans) and on prefill segments (256 tokens and more), and, where both modes were measured at a
context, the linear mode's share of the attention mode's time, measured and predicted. With --worst N, also
the N held-out shapes the model misses most.

usage: bench/summarize_cost.py [--worst N] FILE.jsonl [FILE.jsonl ...]
"""
import json
import sys


def mean_max(rows):
    errors = [abs(r["relative_error"]) for r in rows]
    return (sum(errors) / len(errors), max(errors)) if errors else (0.0, 0.0)


def summarize(path, worst=0):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    summary = next(r for r in rows if r.get("summary"))
    shapes = [r for r in rows if not r.get("summary") and not r.get("calibration")]
    short = [r for r in shapes if r["tokens"] < 256]
    prefill = [r for r in shapes if r["tokens"] >= 256]
    print(f"{path}: {summary['calibration_shapes']} calibration shapes, {summary.get('device', 'cpu')}")
    if "calibration_mean_abs_relative_error" in summary:
        print("  calibration (in-sample) error: mean %.1f%%" % (100 * summary["calibration_mean_abs_relative_error"]))
    print("  held-out error, short spans: mean %.1f%%, max %.1f%%" % tuple(100 * x for x in mean_max(short)))
    if worst > 0:
        print("  the %d worst held-out shapes:" % min(worst, len(shapes)))
        for r in sorted(shapes, key=lambda r: -abs(r["relative_error"]))[:worst]:
            print("    %-9s batch %3d x %5d tokens after %6d: %8.3f ms measured, %8.3f predicted (%+.1f%%)" % (
                r["mode"], r["batch"], r["tokens"], r["context"], r["measured_ms"], r["predicted_ms"],
                100 * r["relative_error"]))
    if not prefill:
        return
    print("  held-out error, prefill segments: mean %.1f%%, max %.1f%%" % tuple(100 * x for x in mean_max(prefill)))
    print("  %7s %6s  %21s  %21s  %17s" % ("context", "tokens", "attention ms (pred)", "linear ms (pred)",
                                          "linear/attention"))
    for ctx in sorted({r["context"] for r in prefill}):
        for tokens in sorted({r["tokens"] for r in prefill}):
            pair = {r["mode"]: r for r in prefill if r["context"] == ctx and r["tokens"] == tokens}
            if len(pair) < 2:
                continue
            a, l = pair["attention"], pair["linear"]
            print("  %7d %6d  %9.1f (%9.1f)  %9.1f (%9.1f)  %.3f (%.3f)" % (
                ctx, tokens, a["measured_ms"], a["predicted_ms"], l["measured_ms"], l["predicted_ms"],
                l["measured_ms"] / a["measured_ms"], l["predicted_ms"] / a["predicted_ms"]))


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if args else 2)
    worst = 0
    if args[0] == "--worst":
        if len(args) < 3 or not args[1].isdigit():
            sys.exit("usage: bench/summarize_cost.py [--worst N] FILE.jsonl [FILE.jsonl ...]")
        worst, args = int(args[1]), args[2:]
    for p in args:
        summarize(p, worst)
