#!/usr/bin/env python3
"""Why a model's attention mode fails to copy: the lookup or the readout (issue 26).

Builds `oryx eval copy`'s examples (a passage of the corpus's validation split at a depth of the context,
repeated at the end; the model continues it teacher-forced after a cue) and runs the model in attention mode
in fp32 (LibTorch on the CPU, DESIGN.md §2 in full-sequence form), keeping each head's attention from the
answer's rows. For the row predicting passage token i + 1, the passage's own neighbourhood is the keys
whose conv window holds that token or the one before it: positions p + i .. p + i + 4 of the first
occurrence. Reports, per (length, depth):
  token_accuracy     the share of answer tokens that are the argmax (as `oryx eval copy`)
  token_accuracy_hidden  the same with the passage's first occurrence hidden from the repeat's queries
                     (every head, every layer): what the cue and the model's priors give without looking back
  mean_p             the mean probability of the right token
  heads              per copying head (layer, head), the mean attention mass on the neighbourhood
  looked_up          the share of rows where some copying head puts more than half its mass there
  right_if_looked_up / right_if_not   token accuracy on those rows and on the others
The copying heads are the --top heads with the most neighbourhood mass at the first length (or --heads).

  python3 bench/copy_probe.py --model models/default --data data/c1 --lengths 1024,4096 --seeds 4 \
      --out results/copy-probe.json
"""
import argparse, array, json, math, os, random, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.nn.functional as F
from torch_reference import attn_query_scales, load_checkpoint, rms_norm, rope


def rope_all(x, theta, position_scale=1.0):  # x [T, H, dh]: RoPE at positions 0.. times position_scale
    T, dh = x.shape[0], x.shape[-1]
    if theta <= 0:
        return x
    freq = theta ** (-2.0 * torch.arange(dh // 2, dtype=torch.float64) / dh)
    ang = (position_scale * torch.arange(T, dtype=torch.float64)[:, None] * freq).float()
    return rope(x, ang.cos()[:, None, :], ang.sin()[:, None, :])


def forward(c, t, ids, rows, block=512, hide=None, sharpen=None, position_scale=1.0):
    """Logits of `rows` and, per layer, the attention of those rows [H, len(rows), T] (attention mode).
    hide = (keys, first row): no query from that row on attends to those keys (the passage's first occurrence).
    sharpen = {(layer, head): factor}: those heads' attention logits multiplied by the factor; position_scale:
    RoPE's positions multiplied by it (diagnostics: neither is the model's math)."""
    H, dh, eps, T = c["n_heads"], c["head_dim"], c["norm_eps"], len(ids)
    HD = H * dh
    x = t["embed.weight"][torch.tensor(ids)]
    kept, causal = [], torch.arange(T)
    hidden = torch.zeros(T, dtype=torch.bool)
    if hide is not None:
        hidden[hide[0]] = True

    def masked(sc, query_rows, e):  # sc [H, rows, e]: causal, and the hidden keys from hide's first row on
        out = sc.masked_fill(causal[None, :e] > query_rows[:, None], float("-inf"))
        if hide is not None:
            out = out.masked_fill(hidden[None, :e] & (query_rows[:, None] >= hide[1]), float("-inf"))
        return out
    q_scale = attn_query_scales(c.get("attn_log_scale_base", 0), T)[:, None, None]
    for i in range(c["n_layers"]):
        p, m = f"layers.{i}.", f"layers.{i}.mixer."
        u = rms_norm(x, t[p + "attn_norm.weight"], eps)
        k, v, g, qa = (u @ t[m + n + ".weight"].T for n in ("k_proj", "v_proj", "g_proj", "q_attn"))
        w = t[m + "conv.weight"]
        pad = torch.cat([torch.zeros(w.shape[1] - 1, 2 * HD), torch.cat([k, v], -1)], 0)
        kv = t[m + "conv.bias"] + sum(w[:, j] * pad[j:j + T] for j in range(w.shape[1]))
        if c["conv_activation"] == "silu":
            kv = F.silu(kv)
        k, v = kv[:, :HD].view(T, H, dh), kv[:, HD:].view(T, H, dh)
        q, k = (rope_all(y, c["rope_theta"], position_scale) for y in (qa.view(T, H, dh), k))
        q = q * q_scale
        for (layer, head), factor in (sharpen or {}).items():
            if layer == i:
                q[:, head] *= factor
        o = torch.empty(T, H, dh)
        for s in range(0, T, block):  # query blocks: scores of [H, block, T] at a time
            e = min(T, s + block)
            sc = torch.einsum("thd,shd->hts", q[s:e], k[:e]) / math.sqrt(dh)
            a = masked(sc, causal[s:e], e).softmax(-1)
            o[s:e] = torch.einsum("hts,shd->thd", a, v[:e])
        a = torch.einsum("thd,shd->hts", q[rows], k) / math.sqrt(dh)
        kept.append(masked(a, torch.tensor(rows), T).softmax(-1))
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * t[m + "gate_norm.weight"]
        x = x + (o * F.silu(g.view(T, H, dh))).reshape(T, HD) @ t[m + "o_proj.weight"].T
        z = rms_norm(x, t[p + "mlp_norm.weight"], eps)
        x = x + (F.silu(z @ t[p + "mlp.gate.weight"].T) * (z @ t[p + "mlp.up.weight"].T)) @ t[p + "mlp.down.weight"].T
    head = t["embed.weight"] if c["tie_embeddings"] else t["lm_head.weight"]
    return rms_norm(x[rows], t["final_norm.weight"], eps) @ head.T, torch.stack(kept)


def example(c, val, length, depth, seed, cue, answer):
    """BOS, haystack, cue, answer (as tasks/copy.cc, without its move to a unique cue); the passage's start."""
    rng = random.Random(seed)
    passage, context = cue + answer, length - 2 - (cue + answer)
    specials = {c["bos_id"], c["eos_id"], c["pad_id"]}
    while True:
        s = rng.randrange(0, len(val) - context)
        text = val[s:s + context]
        if not specials.intersection(text):
            break
    start = round(depth * (context - passage))
    ids = [c["bos_id"]] + text + text[start:start + passage]
    return ids, 1 + start, len(ids) - answer  # (ids, passage position, first answer position)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--data", required=True, help="corpus directory (oryx data prepare): its val-*.bin is read")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--seeds", type=int, default=4, help="examples per (length, depth)")
    ap.add_argument("--cue", type=int, default=16)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--top", type=int, default=3, help="copying heads to follow")
    ap.add_argument("--heads", default="", help="layer.head,... instead of the top ones")
    ap.add_argument("--sharpen", default="", help="layer.head=factor,...: multiply those heads' attention logits "
                    "(a diagnostic: not the model's math)")
    ap.add_argument("--position-scale", type=float, default=1.0,
                    help="RoPE's positions times this (a diagnostic: 0.25 shows 16K positions as 4K ones)")
    ap.add_argument("--rope-theta", type=float, default=0,
                    help="RoPE's theta instead of the model's (a diagnostic: a larger one slows the slow dimensions most)")
    ap.add_argument("--attn-log-scale-base", type=int, default=-1,
                    help="queries at position p times max(1, ln(p+1)/ln(N)) instead of the model's setting (0: off; "
                    "a diagnostic unless the model was trained with it)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (fp32 either way)")
    ap.add_argument("--out", help="write the JSON here too (atomically)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    torch.set_default_device(args.device)
    c, t = load_checkpoint(args.model)
    if args.rope_theta > 0:
        c["rope_theta"] = args.rope_theta
    if args.attn_log_scale_base >= 0:
        c["attn_log_scale_base"] = args.attn_log_scale_base
    t = {k: v.float().to(args.device) for k, v in t.items()}
    shards = sorted(f for f in os.listdir(args.data) if f.startswith("val-") and f.endswith(".bin"))
    if not shards:
        sys.exit(f"copy_probe: error: no val-*.bin in {args.data}")
    val = array.array("H")  # uint16 little-endian tokens (oryx data prepare's token_dtype)
    for f in shards:
        with open(os.path.join(args.data, f), "rb") as fh:
            val.frombytes(fh.read())
    if sys.byteorder != "little":
        val.byteswap()
    val = val.tolist()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    if max(lengths) > c["max_position"]:
        sys.exit(f"copy_probe: error: length {max(lengths)} is past the model's max_position {c['max_position']}")
    heads = [tuple(int(v) for v in h.split(".")) for h in args.heads.split(",") if h]
    sharpen = {tuple(int(v) for v in k.split(".")): float(f) for k, f in (x.split("=") for x in args.sharpen.split(",") if x)}
    results = []
    for length in lengths:
        for depth in depths:
            masses, right, right_blind, probs = [], [], [], []
            for seed in range(args.seeds):
                ids, p, a = example(c, val, length, depth, 1000 * length + 10 * seed + int(10 * depth), args.cue,
                                    args.answer)
                rows = list(range(a - 1, len(ids) - 1))  # the rows predicting the answer's tokens
                logits, att = forward(c, t, ids, rows, sharpen=sharpen, position_scale=args.position_scale)
                target = torch.tensor(ids[a:])
                right.append(logits.argmax(-1) == target)
                # The same rows with the passage's first occurrence hidden from the repeat: what the cue and the
                # model's priors give without looking back.
                blind, _ = forward(c, t, ids, rows, hide=(list(range(p, p + args.cue + args.answer + 4)), a - args.cue),
                                   sharpen=sharpen, position_scale=args.position_scale)
                right_blind.append(blind.argmax(-1) == target)
                probs.append(logits.log_softmax(-1).gather(1, target[:, None])[:, 0].exp())
                i = torch.arange(args.cue - 1, args.cue - 1 + args.answer)  # the row's token: passage token i
                hood = torch.stack([att[:, :, torch.arange(len(rows)), p + i + d] for d in range(5)]).sum(0)
                masses.append(hood)  # [layers, heads, rows]
            mass = torch.cat(masses, -1)
            if not heads:
                flat = mass.mean(-1).flatten().topk(args.top).indices.tolist()
                heads = [(f // c["n_heads"], f % c["n_heads"]) for f in flat]
            right_t, probs_t = torch.cat(right), torch.cat(probs)
            looked = torch.stack([mass[l, h] for l, h in heads]).max(0).values > 0.5
            r = {"length": length, "depth": depth, "n": args.seeds, "token_accuracy": right_t.float().mean().item(),
                 "mean_p": probs_t.mean().item(), "token_accuracy_hidden": torch.cat(right_blind).float().mean().item(),
                 "heads": [{"layer": l, "head": h, "mass": mass[l, h].mean().item()} for l, h in heads],
                 "looked_up": looked.float().mean().item(),
                 "right_if_looked_up": right_t[looked].float().mean().item() if looked.any() else None,
                 "right_if_not": right_t[~looked].float().mean().item() if (~looked).any() else None}
            results.append(r)
            hs = " ".join(f"L{x['layer']}H{x['head']} {x['mass']:.2f}" for x in r["heads"])
            fmt = lambda v: "-" if v is None else f"{v:.2f}"
            print(f"length {length:6d} depth {depth:.2f}: accuracy {r['token_accuracy']:.3f} "
                  f"(passage hidden {r['token_accuracy_hidden']:.3f}) mean p {r['mean_p']:.3f} | "
                  f"{hs} | looked up {r['looked_up']:.2f}: right {fmt(r['right_if_looked_up'])} / "
                  f"{fmt(r['right_if_not'])}", flush=True)
    doc = {"probe": "copy", "model": args.model, "cue": args.cue, "answer": args.answer,
           "sharpen": {f"{l}.{h}": f for (l, h), f in sharpen.items()}, "position_scale": args.position_scale,
           "rope_theta": c["rope_theta"], "attn_log_scale_base": c.get("attn_log_scale_base", 0),
           "results": results}
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.out)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
