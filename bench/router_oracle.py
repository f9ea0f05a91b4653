#!/usr/bin/env python3
"""What a router that knew each example's task could reach: from `oryx train-router`'s log, every way of
choosing one evaluated policy per task, scored on the mixed workload, and which rules such a choice
Pareto-dominates. It bounds what a learned policy can win by telling the tasks apart, using only the
behaviours already measured (a policy can still do better inside a task than any of them).

  bench/router_oracle.py LOG.jsonl [--run N] [--rules-only] [--json]

LOG.jsonl: the log train-router writes (FILE.log.jsonl); an --eval-only run appends its own evaluation.
--run picks an evaluation by its order in the log (default -1, the last). Dominance uses train-router's
tolerances (train/pareto.h): better by at least 0.005 quality or 0.001 cost, worse on neither.
"""
import argparse
import itertools
import json
import sys

QUALITY_TOLERANCE, COST_TOLERANCE = 0.005, 0.001
CHEAPEST = "linear"  # no policy costs less, so none can dominate it


def dominates(point, rule):
    gain, saving = point[0] - rule[0], rule[1] - point[1]
    return gain >= 0 and saving >= 0 and (gain >= QUALITY_TOLERANCE or saving >= COST_TOLERANCE)


def evaluations(path):
    """The log's evaluations in order: each a dict task -> policy -> (quality, cost, examples)."""
    runs, current, last_phase = [], None, None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"router_oracle: error: {path}:{n}: not JSON ({e})")
            phase = row.get("phase")
            if phase == "eval":
                if last_phase != "eval":
                    current = {}
                    runs.append(current)
                current.setdefault(row["task"], {})[row["policy"]] = (row["quality"], row["cost"], row["examples"])
            last_phase = phase
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="train-router's JSON-lines log")
    parser.add_argument("--run", type=int, default=-1, help="which evaluation in the log (default -1: the last)")
    parser.add_argument("--rules-only", action="store_true", help="choose among the rules only, not learned policies")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    args = parser.parse_args()
    try:
        runs = evaluations(args.log)
    except OSError as e:
        print(f"router_oracle: error: {e}", file=sys.stderr)
        return 1
    if not runs:
        print(f"router_oracle: error: {args.log} holds no evaluation (phase \"eval\")", file=sys.stderr)
        return 1
    if not -len(runs) <= args.run < len(runs):
        print(f"router_oracle: error: --run {args.run}: the log holds {len(runs)} evaluations", file=sys.stderr)
        return 1
    run = runs[args.run]
    tasks = sorted(run)
    policies = [p for p in run[tasks[0]] if all(p in run[t] for t in tasks)]
    rules = [p for p in policies if not p.startswith("learned")]
    choices = rules if args.rules_only else policies
    total = sum(run[t][policies[0]][2] for t in tasks)

    def mixed(assignment):  # one policy per task -> (quality, cost) weighted by the tasks' examples
        q = sum(run[t][p][0] * run[t][p][2] for t, p in zip(tasks, assignment)) / total
        c = sum(run[t][p][1] * run[t][p][2] for t, p in zip(tasks, assignment)) / total
        return q, c

    points = {a: mixed(a) for a in itertools.product(choices, repeat=len(tasks))}
    report = []
    for rule in rules:
        point = points[(rule,) * len(tasks)]
        winners = [a for a, p in points.items() if dominates(p, point)]
        best = max(winners, key=lambda a: points[a][0] - point[0] + point[1] - points[a][1], default=None)
        report.append({"rule": rule, "quality": point[0], "cost": point[1], "dominated": best is not None,
                       "by": dict(zip(tasks, best)) if best else None,
                       "by_point": points[best] if best else None})
    dominated = sum(r["dominated"] for r in report)
    if args.json:
        print(json.dumps({"tasks": tasks, "examples": total, "choices": choices, "rules": report,
                          "dominated": dominated, "of": len(rules)}))
        return 0
    print(f"{len(tasks)} tasks ({', '.join(tasks)}), {total} examples; one of {len(choices)} "
          f"{'rules' if args.rules_only else 'policies'} chosen per task")
    print(f"{'rule':<16}{'quality':>9}{'cost':>8}  dominated by a per-task choice")
    for r in report:
        if r["dominated"]:
            by = ", ".join(f"{t}: {p}" for t, p in r["by"].items())
            what = f"{by}  ({r['by_point'][0]:.3f} at {r['by_point'][1]:.3f})"
        else:
            what = "no (the cheapest policy there is: nothing can)" if r["rule"] == CHEAPEST else "no"
        print(f"{r['rule']:<16}{r['quality']:>9.3f}{r['cost']:>8.3f}  {what}")
    print(f"{dominated} of {len(rules)} rules dominated by some per-task choice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
