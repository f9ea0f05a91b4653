#!/usr/bin/env python3
"""Compares mode policies on a file of prompts (one a line) and prints a table: throughput, attention fraction,
speculative acceptance, and whether each policy's output equals attention mode's.

    python3 python/examples/compare_policies.py --model models/default --prompts python/examples/prompts.txt
    (with the module built: PYTHONPATH=build/python, or after `pip install .`)
"""
import argparse
import time

import oryx

DEFAULT_POLICIES = ["attention", "linear", "prefill-linear", "speculative:4", "speculative", "speculative:ngram",
                    "entropy:2", "match:8"]


def measure(engine, prompts, policy, max_tokens, repeats=1):
    """Generates every prompt in one batch under `policy`, `repeats` times; returns the results and the shortest
    wall time (the least disturbed by whatever else the machine runs)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = engine.generate(prompts, policy=policy, max_tokens=max_tokens)
        times.append(time.perf_counter() - start)
    return results, min(times)


def row(policy, results, seconds, reference):
    """One line of the table: totals over the batch's results."""
    stats = [r.stats for r in results]
    generated = sum(s["generated_tokens"] for s in stats)
    attention = sum(s["attention_tokens"] for s in stats)
    linear = sum(s["linear_tokens"] for s in stats)
    spec = [s["spec"] for s in stats if "spec" in s]
    drafted = sum(s["drafted"] for s in spec)
    accepted = sum(s["accepted"] for s in spec)
    rounds = sum(s["rounds"] for s in spec)
    same = sum(r.tokens == want.tokens for r, want in zip(results, reference))
    return [policy, f"{generated / seconds:.1f}", f"{100 * attention / (attention + linear):.0f}%",
            f"{100 * accepted / drafted:.0f}%" if drafted else "-", f"{accepted / rounds:.2f}" if rounds else "-",
            f"{same}/{len(results)}"]


def print_table(header, rows):
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def text(line):  # the policy left-aligned, the numbers right-aligned
        return "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))

    print(text(header))
    print("  ".join("-" * w for w in widths))
    for line in rows:
        print(text(line))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (config.json, weights, tokenizer.model)")
    parser.add_argument("--prompts", required=True, help="text file, one prompt a line")
    parser.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, help="policies to compare "
                        "(oryx.policies() lists them)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy; the fastest is reported")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with open(args.prompts, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    engine = oryx.Engine(args.model, device=args.device)
    measure(engine, prompts[:1], "attention", 4)  # warm up: first-touch allocations, thread pool
    reference, _ = measure(engine, prompts, "attention", args.max_tokens)
    rows = [row(policy, *measure(engine, prompts, policy, args.max_tokens, args.repeats), reference)
            for policy in args.policies]
    print(f"{len(prompts)} prompts, up to {args.max_tokens} tokens each, one batch per policy, the fastest of "
          f"{args.repeats} runs ({args.device})\n")
    print_table(["policy", "tok/s", "attention", "accepted", "per round", "same as attention"], rows)


if __name__ == "__main__":
    main()
