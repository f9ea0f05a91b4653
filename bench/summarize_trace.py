#!/usr/bin/env python3
"""Sums the GPU kernel time of a Kineto Chrome trace (ORYX_PROFILE_TRACE) by the host op that launched it.

    bench/summarize_trace.py TRACE.json [--top N] [--by op|kernel] [--json]

Each kernel is charged to the outermost aten op around its launch (a kernel launched by aten::linear
inside autograd's backward counts as that op's backward node when the profiler records it); with
--by kernel, to the kernel's own name instead. Prints a table: op (or kernel), kernels, GPU ms, share of
all kernel time; and the total kernel time against the profiled wall time. Backward nodes print as
"backward: NAME", and a custom autograd function (torch::autograd::CppNode<...>) by its class name.
"""
import argparse
import bisect
import collections
import json
import re
import sys


def short_name(name):
    """'autograd::engine::evaluate_function: torch::autograd::CppNode<ns::(anonymous)::FooFunction>' ->
    'backward: FooFunction'; other backward nodes keep their own name after the prefix."""
    prefix = "autograd::engine::evaluate_function: "
    if not name.startswith(prefix):
        return name
    node = name[len(prefix):]
    m = re.match(r"torch::autograd::CppNode<(.*)>$", node)
    if m:
        node = m.group(1).split("::")[-1]
    return "backward: " + node


def kernel_name(name):
    """A kernel's name without its namespaces, template arguments and parameters."""
    base = re.sub(r"\(.*$", "", name.replace("(anonymous namespace)", "anon"))  # parameters
    depth, out = 0, []
    for ch in base:                                    # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).split("::")[-1].replace("void ", "").strip() or name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by", choices=("op", "kernel"), default="op",
                    help="charge each kernel to the host op that launched it (default) or to its own name")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"summarize_trace: {args.trace}: not a Chrome trace: {e}")

    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        sys.exit(f"summarize_trace: {args.trace}: no GPU kernels (profile a CUDA run)")
    # Launch events (runtime API, or driver API as cuBLAS uses) carry the correlation id of their kernel.
    launch_ts = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch_ts[e["args"]["correlation"]] = (e.get("tid"), e["ts"])
    # Host ops per thread, sorted by start, for "outermost op that contains this launch".
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            ops[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for tid in ops:
        ops[tid].sort()
    starts = {tid: [o[0] for o in lst] for tid, lst in ops.items()}

    def owner(tid, ts):
        lst = ops.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        best = None
        # Walk back over ops that start before ts; keep the outermost that still contains it.
        for j in range(i - 1, max(-1, i - 400), -1):
            s, end, name = lst[j]
            if end >= ts:
                best = name
        return best or "(no host op)"

    by_op = collections.defaultdict(lambda: [0, 0.0])
    total = 0.0
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        if args.by == "kernel":
            name = kernel_name(k.get("name", "(unnamed)"))
        else:
            name = short_name(owner(*launch_ts[corr])) if corr in launch_ts else "(unattributed)"
        by_op[name][0] += 1
        by_op[name][1] += k["dur"]
        total += k["dur"]
    first = min(k["ts"] for k in kernels)
    last = max(k["ts"] + k["dur"] for k in kernels)
    rows = sorted(by_op.items(), key=lambda kv: -kv[1][1])
    if args.json:
        print(json.dumps({"kernel_ms": total / 1e3, "span_ms": (last - first) / 1e3,
                          "ops": [{"op": n, "kernels": c, "ms": t / 1e3} for n, (c, t) in rows]}))
        return
    print(f"kernel time {total / 1e3:.1f} ms over a {(last - first) / 1e3:.1f} ms span "
          f"({100 * total / max(1e-9, last - first):.0f}% busy)")
    print(f"{args.by:60s} {'kernels':>8s} {'ms':>9s} {'share':>6s}")
    for name, (count, t) in rows[: args.top]:
        print(f"{name[:60]:60s} {count:8d} {t / 1e3:9.2f} {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main()
