#!/usr/bin/env python3
"""Each policy's generated tokens/s against a base policy's, per (prompt length, clients, requests), from
bench/serve_grid.sh output: the ratio of each repeat to the base's run of the same repeat, and their mean,
min and max. A point measured once shows one ratio.

  bench/serve_ratios.py GRID.jsonl [--base attention] [--json]
"""
import argparse
import collections
import json
import statistics
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", help="JSON lines written by bench/serve_grid.sh")
    parser.add_argument("--base", default="attention", help="the policy the others are divided by")
    parser.add_argument("--json", action="store_true", help="one JSON line per point instead of a table")
    args = parser.parse_args()
    rate = {}  # (prompt, clients, requests, policy, repeat) -> generated tokens/s
    try:
        lines = open(args.grid).read().splitlines()
    except OSError as e:
        print(f"serve_ratios: error: {e}", file=sys.stderr)
        return 1
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            key = (r["prompt_tokens"], r["concurrency"], r["requests"], r["policy"], r.get("repeat", 1))
            rate[key] = r["generated_tokens_per_s"]
        except (ValueError, KeyError) as e:
            print(f"serve_ratios: error: {args.grid}:{n}: not a serve_grid line ({e})", file=sys.stderr)
            return 1
    ratios = collections.defaultdict(list)
    for (prompt, clients, requests, policy, repeat), tps in sorted(rate.items()):
        base = rate.get((prompt, clients, requests, args.base, repeat))
        if policy != args.base and base:
            ratios[(prompt, clients, requests, policy)].append(tps / base)
    if not ratios:
        print(f"serve_ratios: error: no policy beside '{args.base}' to compare in {args.grid}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"| prompt | clients | requests | policy | / {args.base}: mean | min | max | repeats |")
        print("|---|---|---|---|---|---|---|---|")
    for (prompt, clients, requests, policy), rs in sorted(ratios.items()):
        point = dict(prompt_tokens=prompt, concurrency=clients, requests=requests, policy=policy, base=args.base,
                     mean=statistics.fmean(rs), min=min(rs), max=max(rs), repeats=len(rs))
        if args.json:
            print(json.dumps(point))
        else:
            print(f"| {prompt} | {clients} | {requests} | {policy} | {point['mean']:.3f}x | {point['min']:.3f}x | "
                  f"{point['max']:.3f}x | {len(rs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
