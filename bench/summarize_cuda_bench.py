#!/usr/bin/env python3
"""Summarises one run of bench/cuda_decode_bench.sh as Markdown tables: the CUDA backend's decode step time
(CUDA graphs on, the last row's logits returned to the host; and, in runs that have it, with the next token
drawn on the device instead), its fraction of the bandwidth roofline, and PyTorch's eager / CUDA-graph / torch.compile step
times of the same config measured in the same run, with the speedups; the speculative rounds (ms per round
and per emitted token, against the attention / linear decode steps of the same point, and the acceptance at
which a round breaks even with attention-mode steps).

The roofline counts the bytes a step must move at least (bench/cuda_bench.h, StepBytes), recomputed here
from the config, so that runs whose JSON carries an older count read the same:
  python3 bench/summarize_cuda_bench.py results/2026-11-29-h200-cuda > SUMMARY.md
"""
import glob, json, os, sys

PRESETS = {"1.4b": dict(d_model=2048, n_layers=24, n_heads=16, head_dim=128),
           "130m": dict(d_model=768, n_layers=24, n_heads=12, head_dim=64)}


def preset_config(name, mixer):
    c = dict(PRESETS[name], vocab_size=32000, conv_width=4, linear_mixer=mixer)
    c["mlp_hidden"] = int(round(8 * c["d_model"] / 3 / 64)) * 64
    return c


def step_bytes(c, attention, context, batch):  # = StepBytes in bench/cuda_bench.cc
    L, D, H, dh, F, V = c["n_layers"], c["d_model"], c["n_heads"], c["head_dim"], c["mlp_hidden"], c["vocab_size"]
    HD, W, G = H * dh, c["conv_width"] - 1, (2 if c["linear_mixer"] == "gdn" else 1) * H
    matrices = L * ((4 * HD + G) * D + D * HD + 3 * F * D) + V * D + batch * D
    vectors = L * (2 * D + 2 * HD * c["conv_width"] + 2 * HD + dh + 3 * H) + D
    kv_read = 2.0 * 2 * L * HD * (context + 1) if attention else 0.0
    per_seq = kv_read + 2.0 * 2 * L * HD + 2.0 * 4 * L * H * dh * dh + 2.0 * 4 * L * W * 2 * HD + 4.0 * V
    return 2.0 * matrices + 4.0 * vectors + batch * per_seq


def lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main(run_dir):
    torch = {}
    for path in glob.glob(os.path.join(run_dir, "torch-*.jsonl")):
        for r in lines(path):
            if "ms_per_step" in r:
                key = (r["config"], r["linear_mixer"], r["mode"], r["context"], r["batch"])
                torch.setdefault(key, {})[r["impl"]] = r["ms_per_step"]
    print("| model | mode | context | batch | CUDA ms/step | graphs off | token drawn on the device | roofline ms | "
          "fraction | torch eager | graph | compile | compile-cg | vs eager | vs graph |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in sorted(glob.glob(os.path.join(run_dir, "cuda-*.jsonl"))):
        rows = [r for r in lines(path) if "decode_ms_per_step" in r]
        key = lambda r: (r["mode"], r["context"], r["batch"])
        off = {key(r): r["decode_ms_per_step"] for r in rows if not r["cuda_graph"]}
        drawn = {key(r): r["decode_ms_per_step"] for r in rows if r.get("next_token") == "device"}
        for r in rows:
            if not r["cuda_graph"] or r.get("next_token") == "device":
                continue
            model = r["model"]
            mixer = "gdn" if model.endswith("-gdn") else "mamba2"
            name = model.split("-")[1] if model.startswith("random-") else None
            attention, ctx, batch, ms = r["mode"] == "attention", r["context"], r["batch"], r["decode_ms_per_step"]
            if name:
                roof_ms = step_bytes(preset_config(name, mixer), attention, ctx, batch) / (r["copy_bandwidth_gb_s"] * 1e9) * 1e3
            else:
                roof_ms = r["roofline_ms"]  # a checkpoint: the run's own count
            t = torch.get((name, mixer, r["mode"], ctx, batch), {})
            fmt = lambda v: f"{v:.3f}" if v is not None else "-"
            ratio = lambda v: f"{v / ms:.2f}x" if v is not None else "-"
            print(f"| {model} | {r['mode']} | {ctx} | {batch} | {ms:.3f} | {fmt(off.get(key(r)))} | {fmt(drawn.get(key(r)))} | "
                  f"{roof_ms:.3f} | {roof_ms / ms:.2f} | {fmt(t.get('eager'))} | {fmt(t.get('graph'))} | "
                  f"{fmt(t.get('compile'))} | {fmt(t.get('compile-cg'))} | {ratio(t.get('eager'))} | {ratio(t.get('graph'))} |")
    print()
    print("| model | rounds run by | k | context | batch | acceptance | tokens/round | round ms | ms/token | "
          "attention ms/step | linear ms/step | vs attention | vs linear | break-even acceptance |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in sorted(glob.glob(os.path.join(run_dir, "*.jsonl"))):
        for r in lines(path):
            if r.get("bench") != "speculative":
                continue
            source = "measured" if r["acceptance_source"].startswith("measured") else "simulated"
            even = r["breakeven_acceptance"]
            print(f"| {r['model']} | {r.get('rounds_run_by', 'decoder')} | {r['k']} | {r['context']} | {r['batch']} | "
                  f"{r['acceptance']:.3f} ({source}) | "
                  f"{r['tokens_per_round']:.2f} | {r['round_ms']:.3f} | {r['ms_per_token']:.3f} | "
                  f"{r['attention_ms_per_step']:.3f} | {r['linear_ms_per_step']:.3f} | "
                  f"{r['speedup_over_attention']:.2f}x | {r['speedup_over_linear']:.2f}x | "
                  f"{'-' if even is None else f'{even:.3f}'} |")
    print()
    print("| model | prefill mode | context | tokens/s |")
    print("|---|---|---:|---:|")
    for path in sorted(glob.glob(os.path.join(run_dir, "cuda-*.jsonl"))):
        for r in lines(path):
            if r.get("bench") == "prefill":
                print(f"| {r['model']} | {r['mode']} | {r['context']} | {r['prefill_tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
