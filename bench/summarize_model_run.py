#!/usr/bin/env python3
"""Markdown tables from a trained model's device measurements (the JSON of `oryx bench decode`, `oryx bench
serve` via bench/serve_grid.sh, and `oryx eval` tasks), for the results READMEs.

  bench/summarize_model_run.py spec REAL.jsonl [SIMULATED.jsonl]   speculative rounds: acceptance per draft
                                                                   position and speedup, real beside simulated
  bench/summarize_model_run.py serve GRID.jsonl                     tokens/s by prompt length, clients, policy
  bench/summarize_model_run.py task EVAL.json...                    accuracy by policy and length
"""
import json
import sys
from collections import defaultdict


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def spec(real_path, sim_path=None):
    def rounds(path):
        return {(r["context"], r["batch"], r["k"]): r for r in lines(path)
                if r["bench"] == "speculative" and r.get("rounds_run_by") == "backend"}
    real = rounds(real_path)
    sim = rounds(sim_path) if sim_path else {}
    head = "| context | batch | k | drafts judged | acceptance | per-position acceptance | speedup (real) |"
    rule = "|---|---|---|---|---|---|---|"
    if sim:
        head += " speedup (simulated %.2f) |" % next(iter(sim.values()))["acceptance"]
        rule += "---|"
    print(head)
    print(rule)
    for key in sorted(real):
        r = real[key]
        pos = " ".join("%.2f" % p for p in r["per_position_acceptance"])
        row = "| %d | %d | %d | %d | %.3f | %s | %.2fx |" % (*key, r["judged"], r["acceptance"], pos,
                                                            r["speedup_over_attention"])
        if sim:
            row += " %s |" % ("%.2fx" % sim[key]["speedup_over_attention"] if key in sim else "-")
        print(row)


def serve(path):
    rows = lines(path)
    cell = {(r["prompt_tokens"], r["concurrency"], r["policy"]): r for r in rows}
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    base = policies[0]
    print("| prompt tokens | clients | " + " | ".join("%s tok/s" % p for p in policies) +
          " | TTFT p50 ms (%s) | time between tokens ms (%s) | drafts accepted |" % (base, " / ".join(policies)))
    print("|---|---|" + "---|" * len(policies) + "---|---|---|")
    for prompt, clients in sorted({(p, c) for p, c, _ in cell}):
        b = cell.get((prompt, clients, base))
        parts, gaps, accept = [], [], "-"
        for p in policies:
            r = cell.get((prompt, clients, p))
            if r is None:
                parts.append("-")
                gaps.append("-")
                continue
            tps = r["generated_tokens_per_s"]
            parts.append("%.0f" % tps if p == base or not b else "%.0f (%.2fx)" % (tps, tps / b["generated_tokens_per_s"]))
            gaps.append("%.2f" % r["inter_token_ms_p50"])
            if "acceptance_rate" in r:
                accept = "%.1f%%" % (100 * r["acceptance_rate"])
        ttft = "%.1f" % b["ttft_ms"]["p50"] if b else "-"
        print("| %d | %d | %s | %s | %s | %s |" % (prompt, clients, " | ".join(parts), ttft, " / ".join(gaps), accept))


def task(paths):
    for path in paths:
        with open(path) as f:
            j = json.load(f)
        metric = "token_accuracy" if j["eval"] == "copy" else "accuracy"
        acc = defaultdict(lambda: [0.0, 0])
        for r in j["results"]:
            if r.get("summary") or r.get("length") is None:
                continue
            a = acc[(r["policy"], r["length"])]
            a[0] += r[metric] * r["n"]
            a[1] += r["n"]
        policies = list(dict.fromkeys(p for p, _ in acc))
        lengths = sorted({n for _, n in acc})
        print("%s (%s, %s)\n" % (j["eval"], path.rsplit("/", 1)[-1], metric.replace("_", " ")))
        print("| policy | " + " | ".join(str(n) for n in lengths) + " |")
        print("|---|" + "---|" * len(lengths))
        for p in policies:
            print("| %s | " % p + " | ".join("%.3f" % (acc[(p, n)][0] / acc[(p, n)][1]) if acc[(p, n)][1] else "-"
                                            for n in lengths) + " |")
        print()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("spec", "serve", "task"):
        sys.exit(__doc__)
    {"spec": lambda a: spec(*a), "serve": lambda a: serve(a[0]), "task": task}[sys.argv[1]](sys.argv[2:])
