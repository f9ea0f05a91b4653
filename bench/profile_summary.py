#!/usr/bin/env python3
"""Summarises an ORYX_CUDA_PROFILE=1 log (the CUDA backend's per-kind op times, printed at exit): the kinds of
forward by their total time (forwards x ms per forward), each with its heaviest ops.

  python3 bench/profile_summary.py PROFILE.txt [--kinds 8] [--ops 5]
"""
import argparse
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--kinds", type=int, default=8, help="kinds shown, heaviest first")
    ap.add_argument("--ops", type=int, default=5, help="ops shown per kind, heaviest first")
    args = ap.parse_args()
    head = re.compile(r"^cuda profile, (.*): (\d+) forwards, ([\d.]+) ms of ops per forward$")
    op = re.compile(r"^\s+(\S.*?)\s+([\d.]+) ms per forward \(\s*([\d.]+)%\)$")
    kinds = []
    with open(args.log) as f:
        for line in f:
            m = head.match(line.rstrip("\n"))
            if m:
                kinds.append({"kind": m[1], "forwards": int(m[2]), "ms": float(m[3]), "ops": []})
                continue
            m = op.match(line.rstrip("\n"))
            if m and kinds:
                kinds[-1]["ops"].append((m[1], float(m[2])))
    if not kinds:
        sys.exit(f"{args.log}: no 'cuda profile' lines (was ORYX_CUDA_PROFILE=1 set, and did the process exit cleanly?)")
    total = sum(k["forwards"] * k["ms"] for k in kinds)
    print(f"{len(kinds)} kinds of forward, {sum(k['forwards'] for k in kinds)} forwards, {total / 1e3:.3f} s of ops")
    for k in sorted(kinds, key=lambda k: -k["forwards"] * k["ms"])[: args.kinds]:
        share = k["forwards"] * k["ms"] / max(total, 1e-9)
        print(f"{100 * share:5.1f}%  {k['kind']}: {k['forwards']} x {k['ms']:.3f} ms")
        for name, ms in sorted(k["ops"], key=lambda o: -o[1])[: args.ops]:
            print(f"         {name:<26} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
